"""Real services for the test suite.

PostgreSQL (+pgvector), the S3 gateway and valkey start once per session, before Django is
set up, on free ports with their data in a temporary directory, and stop at the end. A real
Celery worker (and, for end-to-end tests, the real inference worker) run as subprocesses
against the same services and the test database.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deploy import services
from tests.interrupt import interrupt_on_sigterm

TEST_S3_BUCKETS = ("documents", "kvcache")
# The real inference worker serves its own queue in tests, so that fast tests can inspect
# what lands on the default ``inference`` queue while the worker (a session fixture) runs.
LIVE_INFERENCE_QUEUE = "inference-live"
LIVE_HEARTBEAT_KEY = "ragblend:inference:heartbeat:live"  # likewise for its heartbeat
CELERY_QUEUES = ("answers", "ingest", "kv")  # what the test Celery worker serves
ROOT = Path(__file__).resolve().parent.parent

_started: list[services.RunningService] = []
_services_dir: Path | None = None


def _start_services() -> None:
    """Start the backing services and point the environment (hence Django) at them."""
    global _services_dir
    _services_dir = Path(tempfile.mkdtemp(prefix="ragblend-test-"))
    pg = services.start_postgres(_services_dir, port=services.free_port(), password="test-pg")
    _started.append(pg)
    s3 = services.start_seaweedfs(
        _services_dir,
        port=services.free_port(also_free_at_offset=10000),
        access_key="test-access",
        secret_key="test-secret-key",
        buckets=TEST_S3_BUCKETS,
    )
    _started.append(s3)
    vk = services.start_valkey(_services_dir, port=services.free_port(), password="test-vk")
    _started.append(vk)
    os.environ.update(pg.env | s3.env | vk.env)
    os.environ.update(
        {
            "DATA_DIR": str(_services_dir / "data"),
            "SECRET_KEY": "test-secret-key-not-for-production-" + "x1y2z3" * 4,
            "DEBUG": "false",
            "HTTPS": "false",
            "SECURE_COOKIES": "false",
            "HEALTH_PING_TIMEOUT_S": "2",
            "HEALTH_CACHE_S": "0",  # each test sees the components as they are now
            # The suite logs in and signs up from one address many times; the limits' own
            # tests (tests/webapp/accounts/test_ratelimits.py) set small ones.
            "LOGIN_RATE_LIMIT": "10000/m",
            "SIGNUP_RATE_LIMIT": "10000/m",
            # Its tests (tests/webapp/accounts/test_account_lock.py) set the product's 10: the
            # suite's users (alice, stella) take wrong passwords in many tests within its window.
            "LOGIN_ACCOUNT_FAILURE_LIMIT": "10000",
        }
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    interrupt_on_sigterm()  # a killed run still stops the services (pytest_unconfigure)
    if not _started:
        _start_services()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    # Load the settings now that the services' URLs are in the environment; pytest-django's
    # own (trylast) pytest_configure then finishes django.setup().
    from django.conf import settings

    settings.INSTALLED_APPS  # noqa: B018 - forces the settings module to load


def pytest_unconfigure(config: pytest.Config) -> None:
    for service in reversed(_started):
        service.stop()
    _started.clear()
    if _services_dir is not None:
        shutil.rmtree(_services_dir, ignore_errors=True)


def _service(name: str) -> services.RunningService:
    return next(s for s in _started if s.name == name)


@pytest.fixture(scope="session")
def s3_service() -> services.RunningService:
    """The real S3 endpoint; ``.env`` has S3_ENDPOINT, S3_ACCESS_KEY, S3_SECRET_KEY."""
    return _service("seaweedfs")


@pytest.fixture(scope="session")
def redis_service() -> services.RunningService:
    return _service("valkey")


def _test_database_url() -> str:
    """The URL of the database pytest-django created for this session (test_<name>)."""
    from django.db import connection

    cfg = connection.settings_dict
    return f"postgres://{cfg['USER']}:{cfg['PASSWORD']}@{cfg['HOST']}:{cfg['PORT']}/{cfg['NAME']}"


def wait_for(predicate, *, timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _spawn_worker(args: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    log = open(log_path, "wb")  # noqa: SIM115 - closed when the process is reaped
    return subprocess.Popen(
        args,
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=services.die_with_parent(),  # a killed test run leaves no worker behind
    )


def _stop(process: subprocess.Popen, log_path: Path) -> None:
    process.terminate()
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


@contextmanager
def started_inference_worker(
    tmp_path: Path, tag: str, env: dict[str, str]
) -> Iterator[tuple[dict, Path]]:
    """An inference worker of a test's own (``python -m kvservice.worker``, the bundled
    model, one row), on queue and heartbeat named by ``tag``, with ``env`` over the suite's
    environment: its heartbeat once its model is loaded, and its log. Stopped at the end."""
    from webapp.redis import redis_client

    heartbeat = f"ragblend:inference:heartbeat:{tag}"
    environ = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "INFERENCE_QUEUE": f"inference-{tag}",
        "INFERENCE_NODE_NAME": f"{tag}@%h",
        "INFERENCE_CONCURRENCY": "1",
        "HEARTBEAT_KEY": heartbeat,
        "KV_DISK_DIR": str(tmp_path / "disk"),
        **env,
    }

    def loaded_heartbeat() -> dict | None:
        beat = json.loads(redis_client().get(heartbeat) or "{}")
        return beat if beat.get("model_loaded") else None

    log = tmp_path / "inference.log"
    process = _spawn_worker([sys.executable, "-m", "kvservice.worker"], log, environ)
    try:
        beat = wait_for(
            lambda: process.poll() is not None or loaded_heartbeat(),
            timeout=300,
            interval=1,
            what="the inference worker's heartbeat",
        )
        assert process.poll() is None, log.read_text()[-3000:]
        yield beat, log
    finally:
        _stop(process, log)
        redis_client().delete(heartbeat)


@pytest.fixture(scope="session")
def celery_worker_process(
    django_db_setup, django_db_blocker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen]:
    """A real ``celery worker`` process on the ingest and kv queues, on the test database."""
    with django_db_blocker.unblock():
        database_url = _test_database_url()
    log_path = tmp_path_factory.mktemp("logs") / "celery.log"
    # What this worker sends to the inference worker (fidelity audits) goes to the live one.
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "PYTHONUNBUFFERED": "1",
        "INFERENCE_QUEUE": LIVE_INFERENCE_QUEUE,
    }
    process = _spawn_worker(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "worker",
            "worker",
            "-Q",
            ",".join(CELERY_QUEUES),
            "--concurrency",
            "1",
            "--hostname",
            "ingest-test@%h",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
        ],
        log_path,
        env,
    )
    from worker.celery import app

    try:
        wait_for(
            lambda: process.poll() is not None or app.control.ping(timeout=0.5),
            timeout=60,
            what="the Celery worker",
        )
        if process.poll() is not None:
            raise RuntimeError(f"celery worker died:\n{log_path.read_text()[-3000:]}")
        yield process
    finally:
        _stop(process, log_path)


@pytest.fixture(scope="session")
def inference_worker_process(
    redis_service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen]:
    """The real inference worker (``python -m kvservice.worker``) with the bundled model."""
    from webapp.redis import redis_client

    log_path = tmp_path_factory.mktemp("logs") / "inference.log"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "INFERENCE_CONCURRENCY": "4",
        "INFERENCE_QUEUE": LIVE_INFERENCE_QUEUE,
        "HEARTBEAT_KEY": LIVE_HEARTBEAT_KEY,
    }
    process = _spawn_worker([sys.executable, "-m", "kvservice.worker"], log_path, env)
    try:
        wait_for(
            lambda: (
                process.poll() is not None
                or (json.loads(redis_client().get(LIVE_HEARTBEAT_KEY) or "{}")).get("model_loaded")
            ),
            timeout=300,
            interval=1,
            what="the inference worker's heartbeat",
        )
        if process.poll() is not None:
            raise RuntimeError(f"inference worker died:\n{log_path.read_text()[-3000:]}")
        yield process
    finally:
        _stop(process, log_path)


@pytest.fixture(autouse=True)
def _route_requests_to_the_live_worker(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests that use the real inference worker send their requests to its queue and read
    its heartbeat."""
    if "inference_worker_process" not in request.fixturenames:
        yield
        return
    from django.test import override_settings

    with (
        override_settings(INFERENCE_QUEUE=LIVE_INFERENCE_QUEUE),
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setenv("HEARTBEAT_KEY", LIVE_HEARTBEAT_KEY)
        yield


def _work_left(client) -> dict[str, int]:
    """What the live workers still have to do: tasks queued for either worker, tasks a Celery
    worker took and has not finished (they are acknowledged late), answers being generated."""
    from kvservice.protocol import INFLIGHT_KEY
    from kvservice.protocol.routing import backlog

    work = {
        "queued for the Celery worker": sum(client.llen(queue) for queue in CELERY_QUEUES),
        "queued for the inference worker": backlog(client, LIVE_INFERENCE_QUEUE),
        "taken, not finished": client.hlen("unacked"),  # kombu's hash of unacknowledged tasks
        "answers in flight": client.hlen(INFLIGHT_KEY),
    }
    return {what: n for what, n in work.items() if n}


def wait_until_the_workers_are_idle(*, timeout: float = 180, settled_polls: int = 3) -> None:
    """Return once the live workers have had nothing to do for ``settled_polls`` polls in a
    row (a task moves from its queue to the taken ones in two steps)."""
    from webapp.redis import redis_client

    client, idle_polls, left = redis_client(), 0, {}
    deadline = time.monotonic() + timeout
    while idle_polls < settled_polls:
        if time.monotonic() > deadline:
            raise AssertionError(f"the live workers were still busy after {timeout:.0f} s: {left}")
        left = _work_left(client)
        idle_polls = 0 if left else idle_polls + 1
        time.sleep(0.2)


@pytest.fixture(autouse=True)
def _let_the_live_workers_finish(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that used the real workers ends once they are idle, before its database is
    emptied: a task still writing (an answer's report, a fidelity audit) would otherwise race
    the flush, which then fails on a deadlock, or lands in the next test."""
    live = {"celery_worker_process", "inference_worker_process"} & set(request.fixturenames)
    if live and request.node.get_closest_marker("django_db"):
        request.getfixturevalue("_django_db_helper")  # set up first, so torn down after this
    yield
    if live:
        wait_until_the_workers_are_idle()
