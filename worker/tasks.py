"""Celery tasks: thin wrappers that take ids and call a service."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="worker.tasks.ingest_echo")
def ingest_echo(value: str) -> dict[str, str]:
    """A no-op round trip through the broker and a worker (used by health tests and ops)."""
    import os

    return {"value": value, "worker_pid": str(os.getpid())}


# --- documents ---------------------------------------------------------------------------------
# Thin: take ids, call a service, retry transient failures with exponential backoff. The
# services are idempotent, so a redelivered or retried task never duplicates anything.

MAX_RETRIES = 5
# An unexpected error (a bug, a worker-side fault) is retried this many times before the
# document fails: it is not necessarily the file's fault.
MAX_UNEXPECTED_RETRIES = 2


def _transient_errors() -> tuple[type[BaseException], ...]:
    from django.db import InterfaceError, OperationalError

    from webapp.documents.services import TransientError

    return (TransientError, OperationalError, InterfaceError)


def _backoff(retries: int) -> int:
    return min(60, 2 ** (retries + 1))


@shared_task(
    name="worker.tasks.ingest_document",
    bind=True,
    max_retries=MAX_RETRIES,
    acks_late=True,
    soft_time_limit=600,
)
def ingest_document(self, document_id: int) -> None:
    import logging

    from webapp.documents import services
    from worker.celery import wait_for_warm_up

    wait_for_warm_up()
    try:
        services.document_ingest(document_id=document_id)
    except _transient_errors() as exc:
        if self.request.retries >= self.max_retries:
            services.document_fail(
                document_id=document_id,
                message="Storage was unavailable for too long; press Retry to try again.",
            )
            return
        raise self.retry(exc=exc, countdown=_backoff(self.request.retries)) from exc
    except Exception as exc:  # a bug or an unexpected file: fail this document, keep the worker
        logging.getLogger(__name__).exception("ingest of document %s failed", document_id)
        if self.request.retries < MAX_UNEXPECTED_RETRIES:
            raise self.retry(exc=exc, countdown=_backoff(self.request.retries)) from exc
        services.document_fail(
            document_id=document_id,
            message=f"Processing failed unexpectedly ({type(exc).__name__}); press Retry, "
            "or contact the administrator if it fails again.",
        )


@shared_task(
    name="worker.tasks.precompute_kv",
    bind=True,
    max_retries=MAX_RETRIES,
    acks_late=True,
    soft_time_limit=900,
)
def precompute_kv(self, chunk_ids: list[int]) -> None:
    import logging

    from webapp.documents import services
    from worker.celery import wait_for_warm_up
    from worker.kv import KVUnavailable, kv_producer, kv_store

    wait_for_warm_up()
    try:
        services.document_precompute_kv(
            chunk_ids=chunk_ids, producer=kv_producer(), store=kv_store()
        )
    except _transient_errors() as exc:
        if self.request.retries >= self.max_retries:
            services.document_fail_kv(
                chunk_ids=chunk_ids, message="the KV store was unavailable for too long."
            )
            return
        raise self.retry(exc=exc, countdown=_backoff(self.request.retries)) from exc
    except KVUnavailable as exc:
        services.document_fail_kv(chunk_ids=chunk_ids, message=str(exc))
    except Exception as exc:
        logging.getLogger(__name__).exception("KV precompute of chunks %s failed", chunk_ids)
        if self.request.retries < MAX_UNEXPECTED_RETRIES:
            raise self.retry(exc=exc, countdown=_backoff(self.request.retries)) from exc
        services.document_fail_kv(
            chunk_ids=chunk_ids, message=f"unexpected error ({type(exc).__name__})."
        )


@shared_task(name="worker.tasks.precompute_kdn_text", soft_time_limit=600)
def precompute_kdn_text(token_ids: list[int], head_ids: list[int], scope: str) -> dict:
    """The KV of a text stored through the knowledge delivery API (``PUT /kdn/v1/kv``),
    computed on the ``kv`` queue unless stored; the web process waits for its result, so
    a failure is the PUT's error rather than a retry here."""
    from webapp.kdn.services import kdn_compute
    from worker.celery import wait_for_warm_up
    from worker.kv import kv_producer, kv_store

    wait_for_warm_up()
    return kdn_compute(
        token_ids=token_ids,
        head_ids=head_ids,
        scope=scope,
        producer=kv_producer(),
        store=kv_store(),
    )


@shared_task(name="worker.tasks.purge_orphan_objects", ignore_result=True)
def purge_orphan_objects() -> int:
    """Delete the S3 objects of deleted documents that S3 did not take at the time, and the
    originals no document names (an upload refused after S3 wrote its file)."""
    from webapp.documents.services import purge_orphan_objects as purge
    from webapp.documents.services import purge_unreferenced_originals

    return purge() + purge_unreferenced_originals()
