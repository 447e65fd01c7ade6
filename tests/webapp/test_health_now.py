"""/healthz reports what answers now: a finished check's "up" is never reused (a valkey frozen
after one got a cached "all up"), a failure is, for ``HEALTH_CACHE_S``, and a request joins
a check already under way rather than starting another (a probe storm stays cheap)."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import wait_for
from webapp import health

pytestmark = pytest.mark.django_db


def _object_store_status(client) -> str:
    return client.get("/healthz").json()["components"]["object_store"]["status"]


def test_an_up_is_never_reused_and_a_failure_is_for_health_cache_s(client, settings) -> None:
    bucket = settings.S3_KV_BUCKET
    assert _object_store_status(client) == "up"
    settings.HEALTH_CACHE_S = 60  # (set after the up: a failure of an earlier test is reused)
    settings.S3_KV_BUCKET = "no-such-bucket"  # the store stops serving what the app needs
    assert _object_store_status(client) == "down"  # at once, not after HEALTH_CACHE_S
    settings.S3_KV_BUCKET = bucket
    assert _object_store_status(client) == "down"  # the failure, reused
    settings.HEALTH_CACHE_S = 0
    assert _object_store_status(client) == "up"


def test_a_request_joins_the_check_under_way(settings) -> None:
    """The Celery ping waits out ``HEALTH_PING_TIMEOUT_S``: requests meanwhile share it; a
    request after it ends starts another (an up is never reused, nor a failure here)."""
    settings.HEALTH_CACHE_S = 0
    before = health._runs.get("celery_worker")
    first = threading.Thread(target=health.run_checks, args=(["celery_worker"],))
    first.start()
    try:
        run = wait_for(
            lambda: _under_way("celery_worker", before),
            timeout=10,
            interval=0.01,
            what="the first request's ping",
        )
        health.run_checks(["celery_worker"])
        assert health._runs["celery_worker"] is run  # joined: no second ping
    finally:
        first.join()
    health.run_checks(["celery_worker"])
    assert health._runs["celery_worker"] is not run


def _under_way(name: str, before: health._Run | None) -> health._Run | None:
    run = health._runs.get(name)
    return run if run is not before and run is not None and not run.future.done() else None
