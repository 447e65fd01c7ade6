"""Every Celery task the web app sends, in one place: what goes to which queue, and when.

Tasks are sent by name (the inference worker's are named in ``kvservice.protocol``, the
Celery worker's in ``worker.tasks``) through the web app's own Celery app (``celery_app``,
configured from settings: the broker, the result backend, and ``CELERY_TASK_ROUTES``, which
sends each task of ``worker.tasks`` to its queue). The web process so imports none of the
workers' code, nor what importing it sets up for them (``worker/celery.py``).

Work that follows a database change is sent once the transaction commits (``on_commit``), so
a worker never looks for a row it cannot see yet; a question is sent at once, and its caller
handles a broker that is down.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery
from celery.result import AsyncResult
from django.conf import settings
from django.db import transaction

from kvservice.protocol import EVICT_TASK, GENERATE_TASK, WARM_TASK, GenerateRequest

celery_app = Celery("ragblend-web", set_as_current=False)
celery_app.config_from_object("django.conf:settings", namespace="CELERY")

INGEST_TASK = "worker.tasks.ingest_document"
PRECOMPUTE_TASK = "worker.tasks.precompute_kv"
KDN_PRECOMPUTE_TASK = "worker.tasks.precompute_kdn_text"


def on_commit(send: Callable[[], object]) -> None:
    transaction.on_commit(send, robust=True)


def ask(request: GenerateRequest, queue: str | None = None) -> None:
    """A question (or an audit's re-run) to the inference workers' shared queue, or to one
    worker's own (``kvservice.protocol.routing``). Raises what the broker raises."""
    celery_app.send_task(
        GENERATE_TASK, args=[request.to_dict()], queue=queue or settings.INFERENCE_QUEUE
    )


def ask_on_commit(request: GenerateRequest) -> None:
    """``ask``, to the shared queue, once the transaction commits (an audit's re-run)."""
    on_commit(lambda: ask(request))


def evict_on_commit(keys: list[str], queues: list[str]) -> None:
    """Drop these chunks from the local tiers of the workers serving ``queues``."""
    on_commit(lambda: [celery_app.send_task(EVICT_TASK, args=[keys], queue=q) for q in queues])


def warm(keys: list[str], tier: str, queue: str, *, when_committed: bool = False) -> None:
    """Load these chunks into ``tier`` of the worker serving ``queue`` (best effort)."""

    def send() -> None:
        celery_app.send_task(WARM_TASK, args=[keys, tier], queue=queue)

    if when_committed:
        on_commit(send)
    else:
        send()


def ingest_on_commit(document_id: int) -> None:
    on_commit(lambda: celery_app.send_task(INGEST_TASK, args=[document_id]))


def precompute_on_commit(chunk_ids: Sequence[int]) -> None:
    """Compute these chunks' KV, ``KV_PRECOMPUTE_BATCH`` chunks a task."""
    size = settings.KV_PRECOMPUTE_BATCH
    batches = [list(chunk_ids[i : i + size]) for i in range(0, len(chunk_ids), size)]
    on_commit(lambda: [celery_app.send_task(PRECOMPUTE_TASK, args=[ids]) for ids in batches])


def precompute_text(token_ids: list[int], head_ids: list[int], scope: str) -> AsyncResult[Any]:
    """A text's KV for the knowledge delivery API, now: its caller waits on the result."""
    return celery_app.send_task(KDN_PRECOMPUTE_TASK, args=[token_ids, head_ids, scope])
