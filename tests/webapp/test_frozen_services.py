"""Services that stop answering without closing their connections: a private valkey or S3
gateway is started, then frozen with SIGSTOP (the kernel still accepts connections and
takes requests; nothing replies), and thawed with SIGCONT. Every call has a deadline
(kvservice/serve/deadlines.py, webapp/storage.py): /healthz and /readyz answer within
``HEALTH_TIMEOUT_S`` naming the component, an upload is a 503 and a delete goes through within
seconds, and an answer whose worker lost its broker is ended once the broker is back.
The figures printed here are those of docs/reliability.md, "Frozen services"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core.cache import cache
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from deploy import services
from kvservice.protocol import (
    GENERATE_TASK,
    GenerateRequest,
    answer_stream,
    decode_events,
    inflight_add,
    inflight_entries,
    mark_alive,
    publish_event,
)
from kvservice.serve.deadlines import CELERY_RETRY_POLICY, REDIS_COMMAND_TIMEOUT_S, redis_from_url
from tests.conftest import ROOT, TEST_S3_BUCKETS, wait_for
from tests.webapp.chat.test_reaper import wait_until_reaped
from webapp.chat.models import Conversation, Message
from webapp.chat.reaper import WORKER_LOST, reap_stale_answers
from webapp.dispatch import celery_app
from webapp.documents.models import Document, OrphanObject
from webapp.outages import is_outage
from webapp.redis import redis_client
from webapp.storage import S3_CONNECT_TIMEOUT_S, S3_READ_TIMEOUT_S, object_store

# What a request may take with a frozen S3: one read timeout (not retried), its connection,
# and room for a busy machine; it took 90.5 s before the deadlines.
S3_REQUEST_LIMIT_S = S3_READ_TIMEOUT_S + S3_CONNECT_TIMEOUT_S + 3


@contextmanager
def frozen(service: services.RunningService) -> Iterator[None]:
    """The service's processes stopped (SIGSTOP), and always continued again."""
    os.killpg(service.process.pid, signal.SIGSTOP)  # its own session (deploy.services._spawn)
    try:
        yield
    finally:
        os.killpg(service.process.pid, signal.SIGCONT)


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    """(what ``call`` returned or raised, the seconds it took)."""
    started = time.monotonic()
    try:
        outcome = call()
    except Exception as err:  # noqa: BLE001 - the caller asserts on it
        outcome = err
    return outcome, time.monotonic() - started


@pytest.fixture(scope="module")
def private_valkey(tmp_path_factory) -> Iterator[services.RunningService]:
    directory = tmp_path_factory.mktemp("frozen-valkey")
    valkey = services.start_valkey(directory, port=services.free_port(), password="frozen-vk")
    yield valkey
    os.killpg(valkey.process.pid, signal.SIGCONT)  # a failed test never leaves it stopped
    valkey.stop()


@pytest.fixture(scope="module")
def private_s3(tmp_path_factory) -> Iterator[services.RunningService]:
    s3 = services.start_seaweedfs(
        tmp_path_factory.mktemp("frozen-s3"), port=services.free_port(also_free_at_offset=10000),
        access_key="frozen-access", secret_key="frozen-secret-key", buckets=TEST_S3_BUCKETS,
    )  # fmt: skip
    yield s3
    os.killpg(s3.process.pid, signal.SIGCONT)
    s3.stop()


def _reset_celery_connections() -> None:
    """Celery keeps its broker connections once made: drop them, so the next send connects
    to the broker the configuration now names."""
    celery_app._pool = None
    celery_app.amqp._producer_pool = None


@pytest.fixture
def web_on_private_valkey(settings, private_valkey) -> Iterator[str]:
    """The web app's Redis client, Django's cache and Celery's broker on the private valkey."""
    url, live_broker = private_valkey.env["REDIS_URL"], celery_app.conf.broker_url
    settings.REDIS_URL = url
    settings.CACHES = {"default": {**settings.CACHES["default"], "LOCATION": url}}
    celery_app.conf.broker_url = url
    _reset_celery_connections()
    redis_client.cache_clear()
    yield url
    celery_app.conf.broker_url = live_broker
    _reset_celery_connections()
    redis_client.cache_clear()


@pytest.fixture
def web_on_private_s3(settings, private_s3) -> Iterator[None]:
    settings.S3_ENDPOINT = private_s3.env["S3_ENDPOINT"]
    settings.S3_ACCESS_KEY = private_s3.env["S3_ACCESS_KEY"]
    settings.S3_SECRET_KEY = private_s3.env["S3_SECRET_KEY"]
    object_store.cache_clear()
    yield
    object_store.cache_clear()


@pytest.fixture
def staff_client(client, django_user_model) -> Client:
    staff = django_user_model.objects.create_user("stella", password="pw-stella-1", is_staff=True)
    client.force_login(staff)
    return client


@pytest.fixture
def api_auth(django_user_model) -> dict[str, str]:
    from webapp.accounts.services import api_key_create

    alice = django_user_model.objects.create_user(username="alice", password="alice-passphrase")
    _, key = api_key_create(user=alice, name="k")
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def _get(client: Client, path: str) -> tuple[Any, float]:
    return timed(lambda: client.get(path))


def _health_while_frozen(client: Client, service: services.RunningService, settings) -> tuple:
    """/healthz and /readyz asked while ``service`` is frozen (both 200 before): each must
    answer within HEALTH_TIMEOUT_S (and 2 s of slack); their responses."""
    assert _get(client, "/readyz")[0].status_code == 200  # up before the freeze
    with frozen(service):
        health, health_s = _get(client, "/healthz")
        ready, ready_s = _get(client, "/readyz")
    print(f"frozen {service.name}: /healthz {health_s:.2f} s, /readyz {ready_s:.2f} s")
    limit_s = settings.HEALTH_TIMEOUT_S + 2
    assert health_s < limit_s and ready_s < limit_s
    return health, ready


# --- valkey frozen ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db
def test_healthz_and_readyz_answer_in_time_with_the_broker_down_while_valkey_is_frozen(
    staff_client, web_on_private_valkey, private_valkey, settings
) -> None:
    health, ready = _health_while_frozen(staff_client, private_valkey, settings)
    components = health.json()["components"]
    assert health.status_code == 503 and components["broker"]["status"] == "down"
    assert components["database"]["status"] == "up"  # the others are still told apart
    assert ready.status_code == 503 and ready.json()["failed"] == ["broker"]


@pytest.mark.slow
@pytest.mark.django_db
def test_redis_cache_and_celery_calls_fail_within_their_deadlines_while_valkey_is_frozen(
    web_on_private_valkey, private_valkey
) -> None:
    """The web side's clients on a frozen broker: each call ends with an outage error (a 503
    for a request) within its deadline; a Celery send used to wait until valkey came back
    (still waiting after 120 s)."""
    probe_queue = f"frozen-probe-{uuid.uuid4().hex[:8]}"
    calls: dict[str, tuple[Callable[[], Any], float]] = {
        "redis command": (lambda: redis_client().set("probe", "1"), REDIS_COMMAND_TIMEOUT_S),
        "django cache": (lambda: cache.get("probe"), REDIS_COMMAND_TIMEOUT_S),
        "celery send": (
            lambda: celery_app.send_task("probe", queue=probe_queue),
            (1 + CELERY_RETRY_POLICY["max_retries"]) * REDIS_COMMAND_TIMEOUT_S + 1,
        ),
    }
    for call, _deadline in calls.values():
        call()  # connected while valkey answers, as a running web process is
    with frozen(private_valkey):
        outcomes = {name: timed(call) for name, (call, _deadline) in calls.items()}
    for name, (outcome, took_s) in outcomes.items():
        print(f"frozen valkey: {name} failed after {took_s:.2f} s ({type(outcome).__name__})")
        assert isinstance(outcome, Exception) and is_outage(outcome), (name, outcome)
        assert took_s < calls[name][1] + 2, (name, took_s)


@pytest.fixture
def pending_answer(django_user_model) -> Message:
    owner = django_user_model.objects.create_user(username="bob", password="bob-passphrase")
    conversation = Conversation.objects.create(owner=owner, title="t")
    return Message.objects.create(
        conversation=conversation, role=Message.Role.ASSISTANT,
        status=Message.Status.PENDING, mode="blend",
    )  # fmt: skip


def _events(client: redis.Redis, request_id: str) -> list[tuple[str, dict]]:
    name = answer_stream(request_id)
    return [(kind, data) for _id, kind, data in decode_events([(name, client.xrange(name))])]


@pytest.fixture
def inference_server():
    """kvservice.serve.server's functions in this process. Importing it makes its own Celery app
    the current one: the web app's is made current again."""
    from kvservice.serve import server

    celery_app.set_current()
    yield server
    server._unsettled.clear()


@pytest.mark.slow
@pytest.mark.django_db
def test_a_worker_whose_broker_freezes_gives_its_request_up_and_the_reaper_ends_it(
    web_on_private_valkey, private_valkey, pending_answer, inference_server
) -> None:
    """The worker's side of issue #48.3, step by step on a real valkey: a publish fails within
    its deadline, the request leaves flight (abandoned) as soon as valkey answers again, and
    the reaper then ends the answer, though the worker is alive."""
    client = redis_from_url(web_on_private_valkey)
    request_id, worker = str(pending_answer.request_id), inference_server.WORKER_ID
    request = GenerateRequest(request_id, "q", [], message_id=pending_answer.id)
    inflight_add(client, worker, request)
    publish_event(client, request_id, "token", text="The Danube")
    with frozen(private_valkey):
        published, publish_s = timed(lambda: publish_event(client, request_id, "token", text="!"))
        _, leave_s = timed(lambda: inference_server._leave_flight(client, request, reported=False))
        assert request_id in inference_server._unsettled  # kept for the heartbeat
    print(f"frozen valkey: a token's publish failed after {publish_s:.2f} s, "
          f"leaving flight after {leave_s:.2f} s")  # fmt: skip
    assert isinstance(published, redis.TimeoutError)
    assert publish_s < REDIS_COMMAND_TIMEOUT_S + 2 and leave_s < REDIS_COMMAND_TIMEOUT_S + 2

    mark_alive(client, worker)  # what the heartbeat thread does once valkey answers,
    inference_server._settle_left_in_flight(client)  # and then this
    assert inflight_entries(client)[request_id]["abandoned"] is True
    assert not inference_server._unsettled

    assert reap_stale_answers() == 1
    pending_answer.refresh_from_db()
    assert pending_answer.status == Message.Status.FAILED
    assert pending_answer.error_message == WORKER_LOST
    assert pending_answer.content.startswith("The Danube")  # what was streamed is kept
    assert _events(client, request_id)[-1][0] == "error"
    assert request_id not in inflight_entries(client)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_whose_broker_freezes_mid_answer_has_its_answer_failed_once_it_is_back(
    web_on_private_valkey, private_valkey, pending_answer, tmp_path
) -> None:
    """Issue #48.3 as it was found: valkey frozen for 25 s after the first token left the
    answer pending until the worker was killed (11 min 36 s). The real inference worker now
    gives the request up, and the reaper ends the answer within seconds of valkey's return."""
    queue = f"inference-frozen-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "REDIS_URL": web_on_private_valkey,
           "INFERENCE_QUEUE": queue, "INFERENCE_CONCURRENCY": "1"}  # fmt: skip
    log_path = tmp_path / "inference.log"
    with open(log_path, "wb") as log:
        argv = [sys.executable, "-m", "kvservice.serve.server"]
        worker = subprocess.Popen(argv, cwd=ROOT, env=env,
                                  stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        _freeze_mid_answer(worker, private_valkey, pending_answer, queue, log_path)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)


def _freeze_mid_answer(
    worker: subprocess.Popen, valkey: services.RunningService, answer: Message, queue: str,
    log_path: Path,
) -> None:  # fmt: skip
    client, request_id = redis_client(), str(answer.request_id)
    request = GenerateRequest(request_id, "Write a long story about a river.", [],
                              message_id=answer.id, max_new_tokens=400)  # fmt: skip
    celery_app.send_task(GENERATE_TASK, args=[request.to_dict()], queue=queue)
    wait_for(lambda: worker.poll() is not None or _events(client, request_id), timeout=300,
             interval=0.5, what="the first token")  # fmt: skip
    assert worker.poll() is None, log_path.read_text()[-3000:]
    with frozen(valkey):
        time.sleep(25)  # the worker's calls time out meanwhile (about 15 s of them)
    thawed = time.monotonic()
    wait_for(lambda: inflight_entries(client).get(request_id, {}).get("abandoned"), timeout=30,
             interval=0.5, what="the worker to give the request up")  # fmt: skip

    wait_until_reaped(answer)
    print(f"frozen valkey 25 s: answer failed {time.monotonic() - thawed:.1f} s after the thaw")
    answer.refresh_from_db()
    assert answer.status == Message.Status.FAILED and answer.error_message == WORKER_LOST
    assert answer.content  # what was streamed before the freeze is kept
    assert request_id not in inflight_entries(client)
    assert worker.poll() is None  # the worker lived through it


# --- S3 frozen -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_readyz_needs_s3(client, settings) -> None:
    """Uploads, downloads and deletes need S3: without it this replica is not ready."""
    settings.S3_ENDPOINT = f"127.0.0.1:{services.free_port()}"  # nothing listens: refused
    object_store.cache_clear()
    try:
        ready = client.get("/readyz")
    finally:
        object_store.cache_clear()
    assert ready.status_code == 503 and ready.json()["failed"] == ["object_store"]


@pytest.mark.slow
@pytest.mark.django_db
def test_healthz_and_readyz_report_a_frozen_s3_in_time(
    staff_client, web_on_private_s3, private_s3, settings
) -> None:
    health, ready = _health_while_frozen(staff_client, private_s3, settings)
    object_store_check = health.json()["components"]["object_store"]
    assert object_store_check["status"] == "down", object_store_check
    assert ready.status_code == 503 and ready.json()["failed"] == ["object_store"]


@pytest.mark.slow
@pytest.mark.django_db
def test_an_upload_with_s3_frozen_is_a_503_within_seconds(
    web_on_private_s3, private_s3, api_auth
) -> None:
    upload = SimpleUploadedFile("frozen.txt", b"Notes written while S3 was frozen.")
    with frozen(private_s3):
        response, took_s = timed(
            lambda: Client().post("/api/v1/documents", {"file": upload}, **api_auth)
        )
    print(f"frozen S3: upload answered {response.status_code} after {took_s:.2f} s")
    assert response.status_code == 503, response.content
    assert response["Retry-After"].isdigit()
    assert response.json()["code"] == "service_unavailable"
    assert took_s < S3_REQUEST_LIMIT_S
    assert not Document.objects.exclude(status="failed").exists()


@pytest.mark.slow
@pytest.mark.django_db
def test_a_delete_with_s3_frozen_goes_through_within_seconds_and_purges_later(
    web_on_private_s3, private_s3, api_auth, settings
) -> None:
    """The document goes at once and its original is recorded for the purge, as with S3
    stopped (test_outages): frozen, the purge gives up after one S3 timeout."""
    created = Client().post(
        "/api/v1/documents",
        {"file": SimpleUploadedFile("gone.txt", b"Notes deleted while S3 was frozen.")},
        **api_auth,
    )
    assert created.status_code == 201, created.content
    document = Document.objects.get(pk=created.json()["id"])
    with frozen(private_s3):
        response, took_s = timed(
            lambda: Client().delete(f"/api/v1/documents/{document.pk}", **api_auth)
        )
    print(f"frozen S3: delete answered {response.status_code} after {took_s:.2f} s")
    assert response.status_code == 204 and took_s < S3_REQUEST_LIMIT_S
    assert not Document.objects.filter(pk=document.pk).exists()
    orphan = OrphanObject.objects.get(key=document.object_key)
    assert orphan.attempts == 1 and orphan.last_error

    from webapp.documents.services import purge_orphan_objects

    assert purge_orphan_objects(keys=[document.object_key]) == 1  # S3 back: purged
    names = object_store().list_objects(settings.S3_DOCUMENTS_BUCKET, prefix=document.object_key)
    assert not list(names)
