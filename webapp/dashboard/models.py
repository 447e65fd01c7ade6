"""What the operator sets on the dashboard (one settings row) and the fidelity audits.

The live state of the cache tiers and of the loading controller is not stored here: the
inference worker owns it and publishes it in its heartbeat (kvservice/protocol/heartbeat.py)."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

UNIT_INTERVAL = [MinValueValidator(0.0), MaxValueValidator(1.0)]


class DashboardSettings(models.Model):
    """The singleton (pk 1) of operator settings; read with ``selectors.dashboard_settings``."""

    class ControllerMode(models.TextChoices):
        AUTO = "auto", "Auto (the worker's loading controller decides)"
        FIXED = "fixed", "Fixed ratio"
        TARGET = "target", "Fidelity target (the measured curve gives the ratio)"

    SINGLETON_PK = 1

    controller_mode = models.CharField(
        max_length=8, choices=ControllerMode.choices, default=ControllerMode.AUTO
    )
    # Sent as GenerateRequest.recompute_ratio on every chat request while the mode is fixed.
    fixed_recompute_ratio = models.FloatField(null=True, blank=True, validators=UNIT_INTERVAL)
    # While the mode is "target": the mean KL to full prefill answers may have at most; the
    # measured ratio curve turns it into the least ratio, sent as GenerateRequest.target_ratio
    # (the worker's controller may raise it where loading takes longer, never lower it).
    fidelity_target = models.FloatField(null=True, blank=True, validators=[MinValueValidator(0.0)])
    # Progressive blend: a blend's cache upgraded to this ratio after the first token, sent as
    # GenerateRequest.refresh_ratio (0: off; None: the worker's BLEND_REFRESH_RATIO). With a
    # fidelity target, used where the curve measured at it reaches the target at a lower
    # first-token ratio than plain blend.
    refresh_ratio = models.FloatField(null=True, blank=True, validators=UNIT_INTERVAL)
    # Share of finished blend answers re-run in full prefill to measure their fidelity.
    audit_sample_rate = models.FloatField(default=0.0, validators=UNIT_INTERVAL)
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )

    class Meta:
        verbose_name = "dashboard settings"
        verbose_name_plural = "dashboard settings"
        constraints = [
            models.CheckConstraint(condition=models.Q(pk=1), name="dashboard_settings_singleton"),
            models.CheckConstraint(
                condition=models.Q(audit_sample_rate__gte=0.0, audit_sample_rate__lte=1.0),
                name="dashboard_audit_rate_0_1",
            ),
            models.CheckConstraint(
                condition=models.Q(fixed_recompute_ratio__isnull=True)
                | models.Q(fixed_recompute_ratio__gte=0.0, fixed_recompute_ratio__lte=1.0),
                name="dashboard_fixed_ratio_0_1",
            ),
            models.CheckConstraint(
                condition=~models.Q(controller_mode="fixed")
                | models.Q(fixed_recompute_ratio__isnull=False),
                name="dashboard_fixed_mode_has_ratio",
            ),
            models.CheckConstraint(
                condition=~models.Q(controller_mode="target") | models.Q(fidelity_target__gte=0.0),
                name="dashboard_target_mode_has_target",
            ),
            models.CheckConstraint(
                condition=models.Q(refresh_ratio__isnull=True)
                | models.Q(refresh_ratio__gte=0.0, refresh_ratio__lte=1.0),
                name="dashboard_refresh_ratio_0_1",
            ),
        ]

    def __str__(self) -> str:
        if self.controller_mode == self.ControllerMode.FIXED:
            return f"fixed ratio {self.fixed_recompute_ratio:.3f}"
        if self.controller_mode == self.ControllerMode.TARGET:
            return f"fidelity target: mean KL to full <= {self.fidelity_target:g}"
        return "auto"


class FidelityAudit(models.Model):
    """A blend answer re-run in ``full`` prefill, and how far the two answers agree."""

    class Status(models.TextChoices):
        PENDING = "pending", "Waiting for the full-prefill answer"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"

    message = models.OneToOneField(
        "chat.Message", on_delete=models.CASCADE, related_name="fidelity_audit"
    )
    # The exact GenerateRequest sent for the re-run (question, history, chunks' token ids).
    request = models.JSONField(default=dict)
    blend_text = models.TextField(blank=True)
    blend_recompute_ratio = models.FloatField(null=True, blank=True)
    blend_refresh_ratio = models.FloatField(null=True, blank=True)  # progressive blend's upgrade
    full_text = models.TextField(blank=True)
    token_f1 = models.FloatField(null=True, blank=True)  # full answer vs the blend answer
    blend_ttft_s = models.FloatField(null=True, blank=True)
    full_ttft_s = models.FloatField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    error_message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["status", "completed_at"])]

    def __str__(self) -> str:
        f1 = "…" if self.token_f1 is None else f"{self.token_f1:.2f}"
        return f"audit of message {self.message_id}: F1 {f1}"
