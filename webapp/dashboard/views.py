"""The operator's dashboard (staff only): cache tiers, the recompute-ratio controller, metrics
and the fidelity audit.

``GET dashboard/`` serves the full page; htmx polls the same URL for the live panel (tiers,
controller state, queues, worker). Actions are plain POST forms that redirect back."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from kvservice.protocol.curve import predict
from kvservice.protocol.ratio import DEFAULT_RECOMPUTE_RATIO
from webapp import health
from webapp.accounts.decorators import staff_required
from webapp.dashboard import charts, selectors, services, wording
from webapp.documents.models import Document

POLL_SECONDS = 3
METRICS_WINDOW = timedelta(days=7)
TIER_MIX_ANSWERS = 40  # the last answers shown in the tier-mix chart
SERVICE_NAMES = {  # health.CHECKS' names, as an operator knows the parts
    "database": "Database (PostgreSQL)",
    "pgvector": "Passage search (pgvector)",
    "object_store": "Object store",
    "broker": "Task queue (valkey)",
    "web_models": "Web app's embedding model",
    "celery_worker": "Document workers (Celery)",
    "inference_worker": "Inference worker",
    "model": "Language model",
}


def _by_tier_label(by_tier: dict[str, object]) -> dict[str, object]:
    return {selectors.tier_label(name): value for name, value in by_tier.items()}


def _metrics(points: list[dict]) -> dict[str, object]:
    since = timezone.now() - METRICS_WINDOW
    answers = selectors.answered_messages(since=since)
    ttft_by_mode: dict[str, list] = {}
    ratio_points: dict[str, list] = {}
    for message in answers:
        ttft_by_mode.setdefault(message.mode or "?", []).append(
            (message.completed_at, message.ttft_s)
        )
        if message.recompute_ratio is not None:
            ratio_points.setdefault(message.mode or "?", []).append(
                (message.completed_at, message.recompute_ratio)
            )
    recent = answers[-TIER_MIX_ANSWERS:]
    hourly = selectors.questions_per_hour(hours=24)
    audits = selectors.fidelity_audits(since=since)
    for audit in audits:  # what the measured curve expected of the answer's ratio(s)
        ratio, refresh = audit.blend_recompute_ratio, audit.blend_refresh_ratio
        audit.predicted = predict(points, ratio, refresh) if points and ratio is not None else {}
    scored = [a for a in audits if a.token_f1 is not None]
    return {
        "summary": selectors.metrics_summary(answers),
        "answer_count": len(answers),
        "ttft_chart": charts.time_series(
            ttft_by_mode, title="Time to first token per answer (worker)", y_label="seconds"
        ),
        "ttft_histogram": charts.histogram(
            {mode: [v for _, v in points] for mode, points in ttft_by_mode.items()},
            title="How the times to first token spread, per mode",
            x_label="seconds to first token",
        ),
        "ratio_chart": charts.time_series(
            ratio_points, title="Recompute ratio per answer", y_label="share recomputed", y_max=1.0
        ),
        "tier_chart": charts.stacked_bars(
            [(f"#{m.id}", _by_tier_label(m.tiers or {})) for m in recent],
            title="Which tier served each answer's passages (answers by number, oldest first)",
            y_label="passages",
            palette=_by_tier_label(charts.TIER_COLORS),
        ),
        "hourly_chart": charts.bars(
            [(hour.strftime("%H:00"), count) for hour, count in hourly],
            title="Questions per hour (last 24 h)",
            y_label="questions",
            every=4,
        ),
        "questions_24h": sum(count for _, count in hourly),
        "audits": audits[::-1][:20],
        "audit_count": len(scored),
        "audit_mean_f1": sum(a.token_f1 for a in scored) / len(scored) if scored else None,
        "fidelity_chart": charts.time_series(
            {
                "words shared with full": [
                    (a.completed_at or a.created_at, a.token_f1) for a in scored
                ]
            },
            title="Audited blend answers: words shared with full prefill's",
            y_label="token F1 (0 to 1)",
            y_max=1.0,
            palette={"words shared with full": "#3056d3"},
        ),
    }


def _ratio_curve(curve: dict[str, object], model_fingerprint: str | None) -> dict[str, object]:
    chart = charts.ratio_curve(curve["series"], current=curve["codec"]) if curve["series"] else None
    # what the operator's fidelity target asks for, on the curve just read, for the model
    # that runs: the decision the requests carry
    plan = selectors.ratio_plan(curve=curve, model_fingerprint=model_fingerprint)
    return {
        "ratio_curve": curve,
        "ratio_curve_chart": chart,
        "target_ratio": plan.target_ratio,
        "target_refresh": plan.target_refresh,
        "target_no_curve": plan.no_curve,
    }


def _named_checks() -> dict[str, dict]:
    """``health.run_checks`` by the names an operator knows the parts by."""
    names = {**SERVICE_NAMES, "object_store": wording.object_store_name()}
    return {names.get(name, name): check for name, check in health.run_checks().items()}


def _live_context() -> dict[str, object]:
    return {
        **selectors.live_state(),
        "settings": selectors.dashboard_settings(),
        "poll_seconds": POLL_SECONDS,
    }


@staff_required
@require_GET
def index(request: HttpRequest) -> HttpResponse:
    if request.htmx:
        return render(request, "dashboard/_live.html", _live_context())
    live = _live_context()
    beat = live["heartbeat"] or {}
    # the measured curves: read once for the page
    curve = selectors.ratio_curve(running_model=beat.get("model"))
    fingerprint = beat.get("model_fingerprint")  # the running model's KV, not an earlier one's
    context = {
        **live,
        **_metrics(curve["points"] or []),
        **_ratio_curve(curve, fingerprint),
        "health": _named_checks(),
        "documents": selectors.documents_with_cache_counts(fingerprint=fingerprint),
        "stored_kv": selectors.stored_kv_summary(live["model_kv"], fingerprint),
        "warmable_tiers": [
            (tier, selectors.tier_label(tier)) for tier in selectors.warmable_tiers(beat)
        ],
        "serving_bench": selectors.last_serving_bench(),
        "default_recompute_ratio": DEFAULT_RECOMPUTE_RATIO,  # the fixed ratio's field
    }
    return render(request, "dashboard/index.html", context)


def _apply(request: HttpRequest, action: Callable[[], str]) -> HttpResponse:
    """Run a service call; its message (or its refusal) is shown on the dashboard."""
    try:
        messages.success(request, action())
    except services.DashboardError as err:
        messages.error(request, str(err))
    return redirect("dashboard:index")


@staff_required
@require_POST
def controller(request: HttpRequest) -> HttpResponse:
    def action() -> str:
        row = services.controller_set(
            mode=request.POST.get("mode", ""),
            fixed_ratio=request.POST.get("fixed_ratio"),
            fidelity_target=request.POST.get("fidelity_target"),
            refresh_ratio=request.POST.get("refresh_ratio"),
            user=request.user,
        )
        if row.controller_mode == row.ControllerMode.FIXED:
            return f"Recompute ratio fixed at {row.fixed_recompute_ratio:g} from the next answer."
        if row.controller_mode == row.ControllerMode.TARGET:
            plan = selectors.ratio_plan(row.fidelity_target)
            ratio, refresh = plan.target_ratio, plan.target_refresh
            if plan.no_curve:
                target = f"Fidelity target: mean KL to full at most {row.fidelity_target:g}."
                return f"{target} {plan.no_curve}"
            reach = (
                "no measured curve yet for the store's codec "
                f"({wording.codec_in_words(selectors.store_codec())}): the loading controller "
                "decides"
                if ratio is None
                else f"the measured curve gives a ratio of at least {ratio:.3f}"
            )
            if refresh is not None:
                reach += f", upgraded to {refresh:g} after the first token"
            return f"Fidelity target: mean KL to full at most {row.fidelity_target:g}; {reach}."
        return "The loading controller chooses the recompute ratio again."

    return _apply(request, action)


@staff_required
@require_POST
def audit(request: HttpRequest) -> HttpResponse:
    def action() -> str:
        row = services.audit_set(sample_rate=request.POST.get("sample_rate", ""), user=request.user)
        return f"Auditing {row.audit_sample_rate:.0%} of blend answers."

    return _apply(request, action)


@staff_required
@require_POST
def document_evict(request: HttpRequest, document_id: int) -> HttpResponse:
    document = get_object_or_404(Document, pk=document_id)
    return _apply(
        request,
        lambda: (
            f"Evicting {len(services.document_evict(document=document))} cached chunks of "
            f"“{document.title}” from the worker's memory and disk (the object store keeps them)."
        ),
    )


@staff_required
@require_POST
def document_warm(request: HttpRequest, document_id: int) -> HttpResponse:
    document = get_object_or_404(Document, pk=document_id)
    tier = request.POST.get("tier", "")
    return _apply(
        request,
        lambda: (
            f"Warming {len(services.document_warm(document=document, tier=tier))} cached "
            f"chunks of “{document.title}” into {selectors.tier_label(tier)}."
        ),
    )


@staff_required
@require_POST
def document_precompute(request: HttpRequest, document_id: int) -> HttpResponse:
    document = get_object_or_404(Document, pk=document_id)
    return _apply(
        request,
        lambda: (
            f"Precomputing the KV of {services.document_precompute_again(document=document)} "
            f"chunks of “{document.title}” again."
        ),
    )
