from __future__ import annotations

import pytest

from worker.tasks import ingest_echo


@pytest.mark.django_db(transaction=True)
def test_task_round_trips_through_real_broker_and_worker(celery_worker_process) -> None:
    import os

    result = ingest_echo.delay("hello").get(timeout=30)
    assert result["value"] == "hello"
    # It ran in the worker process, not in this one (no eager mode).
    assert int(result["worker_pid"]) != os.getpid()


@pytest.mark.django_db(transaction=True)
def test_healthz_sees_the_celery_worker(celery_worker_process, client) -> None:
    body = client.get("/healthz").json()
    assert body["components"]["celery_worker"]["status"] == "up", body["components"]
