from __future__ import annotations

import socket

import pytest
from django.contrib.auth import get_user_model

from tests.conftest import wait_for, wait_until_the_workers_are_idle
from webapp.health import warm_key
from webapp.redis import redis_client
from worker.tasks import ingest_echo


@pytest.mark.django_db(transaction=True)
def test_task_round_trips_through_real_broker_and_worker(celery_worker_process) -> None:
    import os

    result = ingest_echo.delay("hello").get(timeout=30)
    assert result["value"] == "hello"
    # It ran in the worker process, not in this one (no eager mode).
    assert int(result["worker_pid"]) != os.getpid()


@pytest.mark.django_db(transaction=True)
def test_a_pool_process_marks_its_worker_warm_after_loading_models(celery_worker_process):
    """The test worker runs with warm-up on: its pool process loads both models, then says
    so (the next test relies on that mark being set already)."""
    key = warm_key("ingest-test@" + socket.gethostname())
    wait_for(lambda: redis_client().exists(key), timeout=300, what="the warm-up mark")


@pytest.mark.django_db(transaction=True)
def test_healthz_sees_the_celery_worker_once_its_models_are_loaded(
    celery_worker_process, client, settings
) -> None:
    settings.HEALTH_CACHE_S = 0
    client.force_login(get_user_model().objects.create_user("ops", is_staff=True))
    redis_client().delete(warm_key("ingest-test@" + socket.gethostname()))  # as if it restarted

    def celery_check() -> dict:
        return client.get("/healthz").json()["components"]["celery_worker"]

    cold = celery_check()
    assert cold["status"] == "down" and "warming up" in cold["error"], cold
    redis_client().set(warm_key("ingest-test@" + socket.gethostname()), "1")  # what warm-up sets
    warm = celery_check()
    assert warm["status"] == "up" and warm["warm"] == ["ingest-test@" + socket.gethostname()]


@pytest.mark.django_db(transaction=True)
def test_a_test_waits_for_the_workers_last_write_before_its_database_is_emptied(
    celery_worker_process, django_user_model
) -> None:
    """An answer's report still in the worker when a test ends raced the test's flush (a CI
    run failed on it): ``wait_until_the_workers_are_idle``, which every test of the live
    workers ends with, returns only once such a report is stored."""
    from webapp.chat import services
    from webapp.chat.models import Message
    from worker.chat import record_answer

    owner = django_user_model.objects.create_user("reporter")
    conversation = services.conversation_create(owner=owner)
    answer = Message.objects.create(conversation=conversation, role="assistant", status="pending")
    # Held by the worker (taken, not finished) for two seconds, as a report that is late.
    record_answer.apply_async(args=[answer.id, {"status": "done", "text": "late"}], countdown=2)

    wait_until_the_workers_are_idle(timeout=60)

    answer.refresh_from_db()
    assert (answer.status, answer.content) == ("done", "late")
