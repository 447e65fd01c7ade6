"""Dashboard writes: the controller and audit settings, cache actions on a document's KV
(sent to the inference worker, which owns the tiers), and the fidelity audit.

Fidelity audit: when a blend answer is recorded, ``fidelity_maybe_audit`` re-sends the same
request (question, history, chunks) in mode ``full`` with ``audit_of`` set, for a sampled
share of answers; the worker reports that run through RECORD_TASK with ``message_id=None``,
and ``record_outcome`` (webapp.chat.services) hands it to ``fidelity_record``, which scores
the two answers' agreement (token F1, as in SQuAD)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from kvservice.protocol import AnswerOutcome, GenerateRequest, routing, token_ids_sha256
from webapp import dispatch
from webapp.chat.models import Message
from webapp.chat.requests import conversation_history, generate_request
from webapp.dashboard import selectors
from webapp.dashboard.fidelity import token_f1
from webapp.dashboard.models import DashboardSettings, FidelityAudit
from webapp.documents.kv import kv_scope_for
from webapp.documents.models import Chunk, Document
from webapp.redis import redis_client

log = logging.getLogger(__name__)


class DashboardError(ValueError):
    """An operator input that cannot be applied (shown to them as is)."""


# --------------------------------------------------------------------------------------------
# Settings


def _parse_unit(value: str | float | None, what: str) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        raise DashboardError(f"{what} must be a number between 0 and 1.") from err
    if not 0.0 <= number <= 1.0:
        raise DashboardError(f"{what} must be between 0 and 1, got {number:g}.")
    return number


def _locked_settings() -> DashboardSettings:
    selectors.dashboard_settings()  # created on first use
    return DashboardSettings.objects.select_for_update().get(pk=DashboardSettings.SINGLETON_PK)


def _parse_target(value: str | float | None) -> float:
    """A fidelity target: a mean KL to full prefill, a number of at least 0 (0 is full)."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        raise DashboardError("The fidelity target must be a mean KL, a number from 0 up.") from err
    if not 0.0 <= number < float("inf"):
        raise DashboardError(f"The fidelity target must be a mean KL from 0 up, got {number:g}.")
    return number


def controller_set(
    *,
    mode: str,
    fixed_ratio: str | float | None = None,
    fidelity_target: str | float | None = None,
    refresh_ratio: str | float | None = None,
    user=None,
) -> DashboardSettings:
    """Auto, a fixed recompute ratio that every chat request carries from now on, or a
    fidelity target that the measured curve turns into each request's least ratio; and
    progressive blend's upgrade (``refresh_ratio``: blank for the worker's own setting, 0
    for off)."""
    if mode not in DashboardSettings.ControllerMode.values:
        raise DashboardError(f"Unknown controller mode {mode!r}.")
    refresh = None
    if refresh_ratio is not None and str(refresh_ratio).strip():
        refresh = _parse_unit(refresh_ratio, "The ratio progressive blend upgrades to")
    with transaction.atomic():
        row = _locked_settings()
        row.controller_mode = mode
        if mode == DashboardSettings.ControllerMode.FIXED:
            row.fixed_recompute_ratio = _parse_unit(fixed_ratio, "The recompute ratio")
        if mode == DashboardSettings.ControllerMode.TARGET:
            row.fidelity_target = _parse_target(fidelity_target)
        row.refresh_ratio = refresh
        row.updated_by = user
        row.save()
    return row


def audit_set(*, sample_rate: str | float, user=None) -> DashboardSettings:
    rate = _parse_unit(sample_rate, "The audit sample rate")
    with transaction.atomic():
        row = _locked_settings()
        row.audit_sample_rate = rate
        row.updated_by = user
        row.save()
    return row


# --------------------------------------------------------------------------------------------
# Cache actions (the inference worker owns the tiers; these only queue its tasks)


def document_evict(*, document: Document) -> list[str]:
    """Drop the document's chunk caches from the worker's local tiers (device, CPU, disk);
    the durable S3 copy stays, so the next question reads them from S3. Returns the keys."""
    keys = selectors.document_kv_keys(document=document)
    if not keys:
        raise DashboardError(f"“{document.title}” has no cached chunks to evict.")
    # Every inference worker drops its copies (each holds its own memory tiers).
    dispatch.evict_on_commit(
        keys, routing.every_worker_queue(redis_client(), settings.INFERENCE_QUEUE)
    )
    return keys


def document_warm(*, document: Document, tier: str) -> list[str]:
    """Load the document's chunk caches into ``tier`` ahead of the questions."""
    if tier not in selectors.WARMABLE_TIERS:
        raise DashboardError(f"Cannot warm into tier {tier!r}.")
    keys = selectors.document_kv_keys(document=document)
    if not keys:
        raise DashboardError(f"“{document.title}” has no cached chunks to warm.")
    # Warmed where questions over the document will go: its owner's home worker.
    scope = kv_scope_for(document.owner_id)
    digests = [
        routing.chunk_digest(scope, token_ids_sha256(token_ids))
        for token_ids in document.chunks.values_list("token_ids", flat=True)
    ]
    queue = routing.home_queue(redis_client(), digests, settings.INFERENCE_QUEUE)
    dispatch.warm(keys, tier, queue, when_committed=True)
    return keys


def document_precompute_again(*, document: Document) -> int:
    """Run the KV step of a finished (or failed) document again: every chunk goes back to
    pending and through ``precompute_kv``, which computes whatever KV is missing from the
    store (e.g. after an eviction) and marks the document ready again. Returns chunks queued.
    """

    if document.is_active:
        raise DashboardError(f"“{document.title}” is still being processed.")
    with transaction.atomic():
        locked = Document.objects.select_for_update().filter(pk=document.pk).first()
        if locked is None:
            raise DashboardError("That document was deleted.")
        chunk_ids = list(locked.chunks.values_list("id", flat=True))
        if not chunk_ids:
            raise DashboardError(f"“{document.title}” has no chunks; retry its ingest instead.")
        locked.chunks.update(kv_status=Chunk.KVStatus.PENDING, kv_error="")
        Document.objects.filter(pk=locked.pk).update(
            status=Document.Status.PROCESSING,
            stage=Document.Stage.KV,
            progress=70,
            error_message="",
            updated_at=timezone.now(),
        )
        dispatch.precompute_on_commit(chunk_ids)
    return len(chunk_ids)


# --------------------------------------------------------------------------------------------
# Fidelity audit


def _audit_request(answer: Message) -> GenerateRequest | None:
    """The original request of ``answer`` rebuilt from the database, in mode ``full``."""
    conversation = answer.conversation
    question = (
        conversation.messages.filter(role=Message.Role.USER, id__lt=answer.id)
        .order_by("-id")
        .first()
    )
    if question is None:
        return None
    citations = list(answer.citations.select_related("chunk__document").order_by("rank"))
    if any(c.chunk is None for c in citations):
        return None  # a cited document was deleted: the same context cannot be rebuilt
    return generate_request(  # the history the original read, in full prefill
        question=question.content,
        history=conversation_history(conversation, before=question),
        citations=citations,
        mode=Message.Mode.FULL,
        audit_of=answer.id,
    )


def _model_words(outcome: AnswerOutcome) -> str:
    """What the model wrote: an answer's text, or its words withheld for want of a passage
    supporting them (the same "not found" in place of two different answers hides a
    difference)."""
    return outcome.withheld or outcome.text


def fidelity_maybe_audit(
    *, message_id: int | None, outcome: AnswerOutcome, draw: Callable[[], float] = random.random
) -> FidelityAudit | None:
    """Called as a blend answer is reported: with the configured probability, queue the same
    request in ``full`` prefill to audit it. Idempotent (one audit per answer at most)."""
    if message_id is None or outcome.audit_of or outcome.status != "done":
        return None
    if outcome.metrics.nothing_retrieved:  # no model ran: nothing to compare
        return None
    metrics = outcome.metrics
    rate = selectors.audit_sample_rate()
    if rate <= 0.0 or draw() >= rate:
        return None
    answer = Message.objects.filter(id=message_id, role=Message.Role.ASSISTANT).first()
    if answer is None or not answer.is_open or (metrics.mode or answer.mode) != "blend":
        return None
    request = _audit_request(answer)
    if request is None:
        return None
    try:
        with transaction.atomic():
            audit = FidelityAudit.objects.create(
                message=answer,
                request=request.to_dict(),
                blend_text=_model_words(outcome),
                blend_recompute_ratio=metrics.recompute_ratio,
                blend_refresh_ratio=metrics.refresh_ratio,
                blend_ttft_s=metrics.ttft_s,
            )
            dispatch.ask_on_commit(request)
    except IntegrityError:
        return None  # a repeated report: that answer is audited already
    return audit


def fidelity_record(*, audit_of: int, outcome: AnswerOutcome) -> FidelityAudit | None:
    """Store the full-prefill re-run of answer ``audit_of`` and its token F1 against the blend
    answer. Idempotent: a repeated report changes nothing once the audit is closed."""
    with transaction.atomic():
        audit = FidelityAudit.objects.select_for_update().filter(message_id=audit_of).first()
        if audit is None:
            log.warning("fidelity result for message %s, which has no audit", audit_of)
            return None
        if audit.status != FidelityAudit.Status.PENDING:
            return audit
        audit.full_text = _model_words(outcome)
        audit.full_ttft_s = outcome.metrics.ttft_s
        if outcome.status == "done":
            audit.status = FidelityAudit.Status.DONE
            audit.token_f1 = token_f1(audit.blend_text, audit.full_text)
        else:
            audit.status = FidelityAudit.Status.FAILED
            audit.error_message = outcome.error or f"status {outcome.status}"
        audit.completed_at = timezone.now()
        audit.save()
    return audit
