"""Ending answers that nobody will finish, so none stays "pending" forever.

Two cases, checked every few seconds by Celery beat (``worker.chat.reap_stale_answers``):

* **The worker died, gave up, or is stuck while answering.** Each request in flight names its
  worker (``kvservice.protocol.inflight_add``), and each worker renews a short-lived alive
  key. An entry is ended when its worker's key has expired, when its worker abandoned it
  (Redis stopped answering while it streamed or reported the answer), or when it is still
  there ``INFLIGHT_GRACE_S`` past its request's timeout: the answer fails with what it had
  streamed so far (a stream already ended, by an older worker that ended streams itself,
  is recorded as it ended).
* **No worker took the question.** An answer still pending past ``ANSWER_PENDING_LIMIT_S``
  and not in flight anywhere fails; its stop flag is set, so a worker that picks the request
  up late drops it at once. Past ``hard_limit_s()`` it fails in flight or not, whatever the
  entry says (one written by an older worker has no start time).

Either way, once the failure is recorded, an ``Error`` event goes on the answer's stream, so
a browser or program reading it learns at once instead of waiting out its own timeout.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models.functions import Coalesce
from django.utils import timezone

from kvservice.protocol import (
    INFLIGHT_GRACE_S,
    AnswerOutcome,
    End,
    Error,
    GenerateRequest,
    Token,
    answer_stream,
    decode_events,
    inflight_entries,
    inflight_overdue,
    inflight_remove,
    outcome_of,
    publish_event,
    request_stop,
    worker_alive,
)
from kvservice.protocol.routing import requeue_orphans
from webapp.chat.models import Message
from webapp.redis import redis_client

logger = logging.getLogger(__name__)

WORKER_DIED = "The model worker stopped while writing this answer. Ask again to get a full one."
WORKER_LOST = (
    "The model worker lost its connection while writing this answer. Ask again to get a full one."
)
OVERDUE = "The model did not finish this answer in time. Ask again in a moment."
NOBODY_ANSWERED = "No model worker took this question in time. Ask again in a moment."


def _stream_so_far(client: Any, request_id: str) -> tuple[str, End | None]:
    """The text streamed so far, and the stream's end if it has one."""
    text, final, name = [], None, answer_stream(request_id)
    for _id, event in decode_events([(name, client.xrange(name))]):
        if isinstance(event, Token):
            text.append(event.text)
        elif isinstance(event, End):
            final = event
    return "".join(text), final


def _end(client: Any, request_id: str, message_id: int | None, reason: str) -> None:
    """Record the answer as failed (or as its stream ended), then tell the stream's readers:
    recorded first, so that a reader that sees the end finds the record."""
    from webapp.chat.services import record_outcome

    text, final = _stream_so_far(client, request_id)
    outcome = outcome_of(final) if final is not None else AnswerOutcome.failed(reason, text)
    request_stop(client, request_id)
    recorded = message_id is not None and record_outcome(message_id=message_id, outcome=outcome)
    if final is None and (recorded or message_id is None):  # readers of the stream learn it now
        publish_event(client, request_id, Error(code="not_answered", message=reason, text=text))


def hard_limit_s() -> float:
    """The longest an answer may stay pending, in flight or not: the longest a question may
    wait for a worker, then the longest that worker may take (its timeout and the grace)."""
    return settings.ANSWER_PENDING_LIMIT_S + GenerateRequest.timeout_s + INFLIGHT_GRACE_S


def _why_ended(client: Any, entry: dict[str, Any], now: float) -> str | None:
    """Why an in-flight entry's answer must be ended now, or None to leave it to its worker."""
    if entry.get("abandoned"):
        return WORKER_LOST
    if not worker_alive(client, entry["worker"]):
        return WORKER_DIED
    return OVERDUE if inflight_overdue(entry, now) else None


def _reap_in_flight(client: Any, inflight: dict[str, dict[str, Any]]) -> int:
    ended, now = 0, time.time()
    for request_id, entry in inflight.items():
        reason = _why_ended(client, entry, now)
        if reason is None:
            continue
        logger.warning("ending request %s of worker %s: %s", request_id, entry["worker"], reason)
        if entry.get("audit_of") is None:  # a fidelity audit has no answer of its own
            _end(client, request_id, entry.get("message_id"), reason)
        inflight_remove(client, request_id)
        ended += 1
    return ended


def _reap_pending(client: Any, inflight: dict[str, dict[str, Any]]) -> int:
    now = timezone.now()
    cutoff = now - timedelta(seconds=settings.ANSWER_PENDING_LIMIT_S)
    hard_cutoff = now - timedelta(seconds=hard_limit_s())
    # Pending since it was asked: an answer asked again (Regenerate) keeps its first
    # creation time, and would otherwise be ended before its first token.
    pending = Message.objects.filter(status=Message.Status.PENDING).annotate(
        since=Coalesce("asked_at", "created_at")
    )
    stale = pending.filter(since__lt=cutoff)
    stale = stale.exclude(request_id__in=list(inflight), since__gte=hard_cutoff)
    ended = 0
    for answer in stale.only("id", "request_id"):
        request_id = str(answer.request_id)
        reason = OVERDUE if request_id in inflight else NOBODY_ANSWERED
        logger.warning("answer %s still pending: ending it (%s)", answer.id, reason)
        _end(client, request_id, answer.id, reason)
        inflight_remove(client, request_id)
        ended += 1
    return ended


def reap_stale_answers() -> int:
    """End the answers described in the module doc; returns how many were ended. Questions
    routed to a worker that died before taking them go back to the shared queue first."""
    client = redis_client()
    if moved := requeue_orphans(client, settings.INFERENCE_QUEUE):
        logger.warning("%d questions waited on a worker that is gone: requeued", moved)
    inflight = inflight_entries(client)
    return _reap_in_flight(client, inflight) + _reap_pending(client, inflight)
