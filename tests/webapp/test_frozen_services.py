"""Services that stop answering without closing their connections: a private valkey or S3
gateway is started, then frozen with SIGSTOP (the kernel still accepts connections and
takes requests; nothing replies), and thawed with SIGCONT. Every call has a deadline
(kvservice/protocol/deadlines.py, webapp/storage.py): /healthz and /readyz answer within
``HEALTH_TIMEOUT_S`` naming the component, an upload is a 503 and a delete goes through within
seconds, and an answer whose worker lost its broker is ended once the broker is back.
The figures printed here are those of docs/reliability.md, "Frozen services"."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
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
    Token,
    answer_stream,
    decode_events,
    inflight_add,
    inflight_entries,
    mark_alive,
    publish_event,
)
from kvservice.protocol.deadlines import (
    CELERY_RETRY_POLICY,
    REDIS_COMMAND_TIMEOUT_S,
    redis_from_url,
)
from tests.conftest import ROOT, TEST_S3_BUCKETS, wait_for
from tests.webapp.chat.test_chat import PASSAGES, make_document
from tests.webapp.chat.test_reaper import wait_until_reaped
from webapp.chat.models import Conversation, Message
from webapp.chat.reaper import WORKER_LOST, reap_stale_answers
from webapp.dispatch import celery_app
from webapp.documents.models import Document, OrphanObject
from webapp.outages import is_outage
from webapp.redis import STREAM_SOCKET_TIMEOUT_S, redis_client
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
        tmp_path_factory.mktemp("frozen-s3"),
        port=services.free_port(also_free_at_offset=10000),
        access_key="frozen-access",
        secret_key="frozen-secret-key",
        buckets=TEST_S3_BUCKETS,
    )
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
def test_healthz_reports_the_broker_down_at_once_when_valkey_freezes_after_an_up(
    client, web_on_private_valkey, private_valkey, settings
) -> None:
    """The issue's probe: the first /healthz of a frozen valkey said 200 "all up", the results
    of a /healthz just before, reused for ``HEALTH_CACHE_S`` (5 s in production)."""
    assert client.get("/healthz").json()["components"]["broker"]["status"] == "up"
    settings.HEALTH_CACHE_S = 5  # (set after the up: a failure of an earlier test is reused)
    with frozen(private_valkey):
        health, took_s = _get(client, "/healthz")
    print(
        f"frozen valkey: the first /healthz after an up: {health.status_code} "
        f"in {took_s:.2f} s, broker {health.json()['components']['broker']['status']}"
    )
    assert health.status_code == 503
    assert health.json()["components"]["broker"]["status"] == "down"
    assert took_s < settings.HEALTH_TIMEOUT_S + 2


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
        conversation=conversation,
        role=Message.Role.ASSISTANT,
        status=Message.Status.PENDING,
        mode="blend",
    )


def _events(client: redis.Redis, request_id: str) -> list[tuple[str, dict]]:
    name = answer_stream(request_id)
    entries = client.xrange(name)
    return [(event.kind, event.data()) for _id, event in decode_events([(name, entries)])]


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
    publish_event(client, request_id, Token(text="The Danube"))
    with frozen(private_valkey):
        published, publish_s = timed(lambda: publish_event(client, request_id, Token(text="!")))
        _, leave_s = timed(lambda: inference_server._leave_flight(client, request, reported=False))
        assert request_id in inference_server._unsettled  # kept for the heartbeat
    print(
        f"frozen valkey: a token's publish failed after {publish_s:.2f} s, "
        f"leaving flight after {leave_s:.2f} s"
    )
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
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "REDIS_URL": web_on_private_valkey,
        "INFERENCE_QUEUE": queue,
        "INFERENCE_CONCURRENCY": "1",
    }
    log_path = tmp_path / "inference.log"
    with open(log_path, "wb") as log:
        argv = [sys.executable, "-m", "kvservice.worker"]
        worker = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _freeze_mid_answer(worker, private_valkey, pending_answer, queue, log_path)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)


def _freeze_mid_answer(
    worker: subprocess.Popen,
    valkey: services.RunningService,
    answer: Message,
    queue: str,
    log_path: Path,
) -> None:
    client, request_id = redis_client(), str(answer.request_id)
    request = GenerateRequest(
        request_id,
        "Write a long story about a river.",
        [],
        message_id=answer.id,
        max_new_tokens=400,
    )
    celery_app.send_task(GENERATE_TASK, args=[request.to_dict()], queue=queue)
    wait_for(
        lambda: worker.poll() is not None or _events(client, request_id),
        timeout=300,
        interval=0.5,
        what="the first token",
    )
    assert worker.poll() is None, log_path.read_text()[-3000:]
    with frozen(valkey):
        time.sleep(25)  # the worker's calls time out meanwhile (about 15 s of them)
    thawed = time.monotonic()
    wait_for(
        lambda: inflight_entries(client).get(request_id, {}).get("abandoned"),
        timeout=30,
        interval=0.5,
        what="the worker to give the request up",
    )

    wait_until_reaped(answer)
    print(f"frozen valkey 25 s: answer failed {time.monotonic() - thawed:.1f} s after the thaw")
    answer.refresh_from_db()
    assert answer.status == Message.Status.FAILED and answer.error_message == WORKER_LOST
    assert answer.content  # what was streamed before the freeze is kept
    assert request_id not in inflight_entries(client)
    assert worker.poll() is None  # the worker lived through it


def _frames_timed(events: AsyncIterator[str], started: float) -> Awaitable[list]:
    """[(seconds since ``started``, frame)] of a stream, as its client gets them."""

    async def collect() -> list[tuple[float, str]]:
        return [(time.monotonic() - started, frame) async for frame in events]

    return collect()


async def _streams_over_a_freeze(valkey: services.RunningService, answer: Message) -> dict:
    """Both APIs' streams and the browser's of one pending answer, valkey frozen 1 s in until
    all ended (at most 25 s, as in the issue's probe); {stream: [(s, frame)]}."""
    from webapp.api.openai import _completion_events
    from webapp.api.v1 import _query_events
    from webapp.chat.views import _event_stream

    started = time.monotonic()
    streams = {
        "/api/v1/query": _frames_timed(_query_events(answer, []), started),
        "/v1/chat/completions": _frames_timed(_completion_events(answer, "ragblend"), started),
        "the browser's stream": _frames_timed(_event_stream(answer), started),
    }
    tasks = {name: asyncio.ensure_future(frames) for name, frames in streams.items()}
    await asyncio.sleep(1)
    with frozen(valkey):
        await asyncio.wait(tasks.values(), timeout=25)
        thawed_s = time.monotonic() - started
    for name, task in tasks.items():  # still running (a hang): report it, then end it
        if not task.done():
            task.cancel()
            print(f"frozen valkey: {name} still streaming at the thaw ({thawed_s:.1f} s)")
    return {name: task.result() for name, task in tasks.items() if not task.cancelled()}


@pytest.mark.slow
@pytest.mark.django_db
def test_every_answer_stream_ends_with_an_error_event_while_valkey_is_frozen(
    web_on_private_valkey, private_valkey, pending_answer
) -> None:
    """The issue's probe: valkey frozen 1 s into a stream. The stream used to break at 15.4 s
    (the XREAD's socket timeout raised through the response: "Response ended prematurely");
    now each API ends it with its own error, one XREAD deadline after the freeze (the block,
    then a command's timeout: 10 s, where the browser's ``failed`` came at 15 s)."""
    received = asyncio.run(_streams_over_a_freeze(private_valkey, pending_answer))
    limit_s = 1 + STREAM_SOCKET_TIMEOUT_S + 3  # the freeze, one read's deadline, a busy machine
    for name, frames in received.items():
        ended_s = frames[-1][0]
        print(f"frozen valkey: {name} ended after {ended_s:.1f} s with {frames[-1][1]!r}")
        assert ended_s < limit_s, (name, ended_s)
    assert set(received) == {"/api/v1/query", "/v1/chat/completions", "the browser's stream"}
    assert received["the browser's stream"][-1][1].startswith("event: failed")
    query = [frame for _s, frame in received["/api/v1/query"]]
    assert query[-1].startswith("event: error\n") and "service_unavailable" in query[-1]
    completion = [frame for _s, frame in received["/v1/chat/completions"]]
    assert completion[-1] == "data: [DONE]\n\n"
    error = json.loads(completion[-2].split("data: ", 1)[1])["error"]
    assert error["code"] == "service_unavailable" and "not responding" in error["message"]


Timeline = list[tuple[float, str]]  # (time.monotonic(), what the client got)


def _read_query_stream(base_url: str, auth: str, timeline: Timeline) -> None:
    """A streamed /api/v1/query as a program reads it (requests), each line as it comes."""
    import requests

    try:
        with requests.post(
            f"{base_url}/api/v1/query",
            json={"question": "Which rice for a risotto?", "stream": True},
            headers={"Authorization": auth},
            stream=True,
            timeout=120,
        ) as response:
            for line in response.iter_lines(chunk_size=None):
                if line:
                    timeline.append((time.monotonic(), line.decode()))
        timeline.append((time.monotonic(), "the stream ended"))
    except Exception as err:  # noqa: BLE001 - what the client got is the result
        timeline.append((time.monotonic(), f"{type(err).__name__}: {err}"))


def _read_completion_stream(base_url: str, auth: str, timeline: Timeline) -> None:
    """A streamed /v1/chat/completions as OpenAI's own client reads it."""
    import openai

    client = openai.OpenAI(
        base_url=f"{base_url}/v1", api_key=auth.removeprefix("Bearer "), timeout=120, max_retries=0
    )
    messages = [{"role": "user", "content": "Which rice for a risotto?"}]
    try:
        for chunk in client.chat.completions.create(
            model="ragblend", messages=messages, stream=True
        ):
            timeline.append((time.monotonic(), f"chunk {chunk.choices[0].delta.model_dump()}"))
        timeline.append((time.monotonic(), "the stream ended"))
    except Exception as err:  # noqa: BLE001
        timeline.append((time.monotonic(), f"{type(err).__name__}: {err}"))


def _streams_over_http_over_a_freeze(
    base_url: str, auth: str, valkey: services.RunningService
) -> dict[str, Timeline]:
    """Both streams started; 1 s after both began, valkey frozen for 25 s. {API: timeline},
    times in seconds since the freeze."""
    timelines: dict[str, Timeline] = {"/api/v1/query": [], "/v1/chat/completions": []}
    readers = [
        threading.Thread(target=read, args=(base_url, auth, timeline), daemon=True)
        for read, timeline in zip(
            (_read_query_stream, _read_completion_stream), timelines.values(), strict=True
        )
    ]
    for reader in readers:
        reader.start()
    wait_for(lambda: all(timelines.values()), timeout=180, what="both streams to begin")
    time.sleep(1)
    with frozen(valkey):
        froze = time.monotonic()
        time.sleep(25)
    for reader in readers:
        reader.join(60)
    return {
        name: [(round(at - froze, 1), got) for at, got in timeline]
        for name, timeline in timelines.items()
    }


def _healthz_over_http_over_a_freeze(base_url: str, valkey: services.RunningService) -> Timeline:
    """/healthz once the broker is up again, then at once after valkey froze; [(seconds since
    the freeze, "status broker ...")]."""
    import requests

    def probe() -> tuple[float, str]:
        health = requests.get(f"{base_url}/healthz", timeout=30)
        broker = health.json()["components"]["broker"]["status"]
        return time.monotonic(), f"{health.status_code} broker {broker}"

    before = wait_for(
        lambda: (got := probe())[1].endswith("broker up") and got,
        timeout=30,
        interval=0.5,
        what="the broker up again",
    )
    with frozen(valkey):
        froze = time.monotonic()
        after = probe()
    return [(round(at - froze, 1), got) for at, got in (before, after)]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_over_http_both_streams_end_with_their_error_and_healthz_says_the_broker_is_down(
    django_db_blocker, private_valkey, api_auth, django_user_model, tmp_path
) -> None:
    """The issue's probes as a client sees them, on uvicorn: valkey frozen 1 s into a streamed
    query and completion, for 25 s. Before: both connections cut at +15 s ("Response ended
    prematurely"), and /healthz said the broker was up (its results of just before)."""
    from tests.e2e.test_browser_chat import running_asgi_server

    make_document(django_user_model.objects.get(username="alice"), "notes", list(PASSAGES.values()))
    env = {"REDIS_URL": private_valkey.env["REDIS_URL"], "HEALTH_CACHE_S": "5"}
    with running_asgi_server(django_db_blocker, tmp_path / "uvicorn.log", **env) as base_url:
        got = _streams_over_http_over_a_freeze(
            base_url, api_auth["HTTP_AUTHORIZATION"], private_valkey
        )
        got["/healthz"] = _healthz_over_http_over_a_freeze(base_url, private_valkey)
    for name, timeline in got.items():
        print(
            f"frozen valkey over HTTP, {name}: "
            + "; ".join(f"{at:+.1f} s {what[:160]}" for at, what in timeline)
        )
    query = got["/api/v1/query"]
    error_at = next((at for at, line in query if line == "event: error"), None)
    assert error_at is not None and error_at < 25, query
    assert "service_unavailable" in query[-2][1], query
    assert query[-1][1] == "the stream ended", query
    completion = got["/v1/chat/completions"]
    assert completion[-1][1].startswith("APIError: Lost the connection"), completion
    assert completion[-1][0] < 25, completion
    assert got["/healthz"][1][1] == "503 broker down"  # the up of just before not reused


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
