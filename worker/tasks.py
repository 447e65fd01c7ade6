"""Celery tasks: thin wrappers that take ids and call a service."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="worker.tasks.ingest_echo")
def ingest_echo(value: str) -> dict[str, str]:
    """A no-op round trip through the broker and a worker (used by health tests and ops)."""
    import os

    return {"value": value, "worker_pid": str(os.getpid())}
