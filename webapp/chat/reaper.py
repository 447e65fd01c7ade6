"""Ending answers that nobody will finish, so none stays "pending" forever.

Two cases, checked every few seconds by Celery beat (``worker.chat.reap_stale_answers``):

* **The worker died while answering.** Each request in flight names its worker
  (``kvservice.protocol.inflight_add``), and each worker renews a short-lived alive key. An
  entry whose worker's key has expired is ended: if the worker had already published the
  answer's last event (it died between that and reporting it), that event is recorded;
  otherwise the answer fails with what it had streamed so far.
* **No worker took the question.** An answer still pending past ``ANSWER_PENDING_LIMIT_S``
  and not in flight anywhere fails; its stop flag is set, so a worker that picks the request
  up late drops it at once.

Either way an ``error`` event goes on the answer's stream, so a browser or program reading it
learns at once instead of waiting out its own timeout.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from kvservice.protocol import (
    answer_stream,
    decode_events,
    inflight_entries,
    inflight_remove,
    publish_event,
    request_stop,
    worker_alive,
)
from kvservice.routing import requeue_orphans
from webapp.chat.models import Message
from webapp.redis import redis_client

logger = logging.getLogger(__name__)

WORKER_DIED = "The model worker stopped while writing this answer. Ask again to get a full one."
NOBODY_ANSWERED = "No model worker took this question in time. Ask again in a moment."


def _stream_so_far(client: Any, request_id: str) -> tuple[str, dict[str, Any] | None]:
    """The text streamed so far, and the final event's (type, payload) if there is one."""
    text, final, name = [], None, answer_stream(request_id)
    for _id, kind, payload in decode_events([(name, client.xrange(name))]):
        if kind == "token":
            text.append(payload.get("text", ""))
        elif kind in ("done", "error"):
            final = {"kind": kind, **payload}
    return "".join(text), final


def _end(client: Any, request_id: str, message_id: int | None, reason: str) -> None:
    from webapp.chat.services import chat_record_answer

    text, final = _stream_so_far(client, request_id)
    if final is not None and final["kind"] == "done":
        result = {"status": final.get("status", "done"), "text": final.get("text", ""),
                  "error": "", "metrics": final.get("metrics") or {}}  # fmt: skip
    else:
        result = {"status": "error", "text": text, "error": reason, "metrics": {}}
        if final is None:  # readers of the stream learn it now
            publish_event(client, request_id, "error", error=reason, message=reason, text=text)
    request_stop(client, request_id)
    if message_id is not None:
        chat_record_answer(message_id=message_id, result=result)


def reap_stale_answers() -> int:
    """End the answers described in the module doc; returns how many were ended. Questions
    routed to a worker that died before taking them go back to the shared queue first."""
    client = redis_client()
    if moved := requeue_orphans(client, settings.INFERENCE_QUEUE):
        logger.warning("%d questions waited on a worker that is gone: requeued", moved)
    ended = 0
    inflight = inflight_entries(client)
    for request_id, entry in inflight.items():
        if worker_alive(client, entry["worker"]):
            continue
        logger.warning("worker %s is gone: ending request %s", entry["worker"], request_id)
        if entry.get("audit_of") is None:  # a fidelity audit has no answer of its own
            _end(client, request_id, entry.get("message_id"), WORKER_DIED)
        inflight_remove(client, request_id)
        ended += 1
    cutoff = timezone.now() - timedelta(seconds=settings.ANSWER_PENDING_LIMIT_S)
    stale = Message.objects.filter(status=Message.Status.PENDING, created_at__lt=cutoff)
    for answer in stale.exclude(request_id__in=list(inflight)).only("id", "request_id"):
        logger.warning("answer %s was never taken by a worker: ending it", answer.id)
        _end(client, str(answer.request_id), answer.id, NOBODY_ANSWERED)
        ended += 1
    return ended
