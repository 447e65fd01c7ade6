"""The web app with its Redis/valkey (streams, stop flags, rate limit, Celery broker) stopped:
a real valkey is started, then stopped, and the web app is pointed at it. Every request that
needs it gets a 503 with ``Retry-After`` and a plain message; nothing is left ``pending``; the
debug page never shows the service passwords."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from deploy import services
from tests.webapp.chat.test_chat import PASSAGES, make_document
from webapp.chat import services as chat
from webapp.chat.models import Conversation, Message
from webapp.chat.views import _event_stream
from webapp.dispatch import celery_app
from webapp.redis import redis_client

PASSWORD = "vk-pass-that-must-not-leak"


@pytest.fixture(scope="module")
def stopped_valkey_url() -> str:
    """The URL of a valkey that ran and was stopped (connections to it are refused)."""
    with tempfile.TemporaryDirectory(prefix="ragblend-stopped-vk-") as directory:
        valkey = services.start_valkey(
            Path(directory), port=services.free_port(), password=PASSWORD
        )
        valkey.stop()
        yield valkey.env["REDIS_URL"]


def _reset_celery_connections() -> None:
    """Celery keeps its broker connection pool once made; drop it (not closed: the live
    broker's pool is taken up again afterwards) so the next send connects to the new URL."""
    celery_app._pool = None
    celery_app.amqp._producer_pool = None


@pytest.fixture
def valkey_down(settings, stopped_valkey_url):
    """Point the web app's Redis client, Django's cache and Celery's broker at the stopped
    valkey (one valkey serves all three)."""
    live_broker = celery_app.conf.broker_url
    settings.REDIS_URL = stopped_valkey_url
    settings.CACHES = {"default": {**settings.CACHES["default"], "LOCATION": stopped_valkey_url}}
    settings.CELERY_BROKER_URL = stopped_valkey_url
    celery_app.conf.broker_url = stopped_valkey_url
    _reset_celery_connections()
    redis_client.cache_clear()
    yield
    celery_app.conf.broker_url = live_broker
    _reset_celery_connections()
    redis_client.cache_clear()


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user(username="alice", password="alice-passphrase")


@pytest.mark.django_db(transaction=True)
def test_asking_with_the_broker_down_is_a_503_and_the_answer_does_not_stay_pending(
    alice, valkey_down, client
) -> None:
    client.force_login(alice)
    conversation = chat.conversation_create(owner=alice)
    response = client.post(
        f"/chat/{conversation.id}/ask",
        {"question": "Where does the Danube flow?"},
        HTTP_HX_REQUEST="true",
    )
    assert response.status_code == 503 and response["Retry-After"].isdigit()
    assert "not responding" in response.content.decode()  # refused up front (rate limit)
    assert not Message.objects.filter(conversation=conversation).exists()

    # Past the checks, a question whose message cannot be sent is kept, its answer failed
    # with the reason (the broker went down in between). The question's words are the
    # passage's, so that it passes the relevance bar and is sent, not answered "not found".
    make_document(alice, "notes", list(PASSAGES.values()))
    with pytest.raises(chat.AnswerServiceUnavailable):
        chat.chat_ask(
            user=alice, conversation=conversation, question="Which sea does the Danube flow into?"
        )
    answer = Message.objects.get(conversation=conversation, role=Message.Role.ASSISTANT)
    assert answer.status == Message.Status.FAILED and "not reachable" in answer.error_message
    assert Message.objects.filter(conversation=conversation, role=Message.Role.USER).exists()


@pytest.mark.django_db(transaction=True)
def test_the_api_answers_503_with_retry_after_when_redis_is_down(alice, valkey_down) -> None:
    from webapp.accounts.services import api_key_create

    _, key = api_key_create(user=alice, name="k")
    response = Client().get("/api/v1/documents", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 503, response.content  # the rate limit needs Redis
    assert response["Retry-After"].isdigit()
    assert response.json()["code"] == "service_unavailable"
    assert PASSWORD not in response.content.decode()


@pytest.mark.django_db(transaction=True)
def test_the_debug_page_never_shows_the_redis_password(alice, valkey_down, settings) -> None:
    """With DEBUG on (``make dev``), a request that fails for a reason other than an outage
    shows Django's debug page: the settings holding URLs are masked there."""
    settings.DEBUG = True
    client = Client(raise_request_exception=False)
    client.force_login(alice)
    conversation = chat.conversation_create(owner=alice)
    answer = Message.objects.create(
        conversation=conversation, role=Message.Role.ASSISTANT, status=Message.Status.PENDING
    )
    # Stopping an answer sets a flag in Redis: an outage, so a plain 503 page.
    response = client.post(f"/chat/messages/{answer.id}/stop")
    assert response.status_code == 503 and PASSWORD not in response.content.decode()

    from django.views.debug import ExceptionReporter

    try:
        raise RuntimeError("a bug")
    except RuntimeError as exc:
        html = ExceptionReporter(None, type(exc), exc, exc.__traceback__).get_traceback_html()
    assert "REDIS_URL" in html and "CELERY_BROKER_URL" in html
    assert PASSWORD not in html
    # Django's cache is a valkey too: its URL, password and all, is masked as well.
    assert "CACHES" in html and settings.CACHES["default"]["LOCATION"] not in html


@pytest.mark.django_db
def test_the_answer_stream_ends_with_a_clear_failure_when_redis_is_down(alice, valkey_down) -> None:
    conversation = Conversation.objects.create(owner=alice, title="t")
    answer = Message.objects.create(
        conversation=conversation, role=Message.Role.ASSISTANT, status=Message.Status.PENDING
    )

    async def frames() -> list[str]:
        return [frame async for frame in _event_stream(answer)]

    events = asyncio.run(frames())
    assert events[-1].startswith("event: failed") and "Lost the connection" in events[-1]


@pytest.mark.django_db(transaction=True)
def test_a_question_beyond_the_backlog_limit_is_refused_before_anything_is_recorded(
    alice, client, settings
) -> None:
    """Admission control: with INFERENCE_MAX_BACKLOG questions waiting, the next one gets a
    503 with Retry-After in the browser and the API, and no message is stored."""
    from webapp.accounts.services import api_key_create

    settings.INFERENCE_QUEUE = "inference-backlog-test"
    settings.INFERENCE_MAX_BACKLOG = 3
    redis_client().rpush(settings.INFERENCE_QUEUE, *["waiting"] * 3)
    try:
        client.force_login(alice)
        conversation = chat.conversation_create(owner=alice)
        page = client.post(
            f"/chat/{conversation.id}/ask", {"question": "Anyone there?"}, HTTP_HX_REQUEST="true"
        )
        assert page.status_code == 503 and page["Retry-After"].isdigit()
        assert "busy" in page.content.decode()
        _, key = api_key_create(user=alice, name="k")
        auth = {"HTTP_AUTHORIZATION": f"Bearer {key}"}
        api = Client().post(
            "/api/v1/query", {"question": "Anyone?"}, content_type="application/json", **auth
        )
        assert api.status_code == 503 and api["Retry-After"].isdigit()
        assert not Message.objects.filter(conversation__owner=alice).exists()
        redis_client().lpop(settings.INFERENCE_QUEUE)  # one was taken: room again
        assert chat.inference_backlog() == 2
    finally:
        redis_client().delete(settings.INFERENCE_QUEUE)


@pytest.mark.django_db(transaction=True)
def test_an_upload_while_s3_is_down_is_a_503_and_stores_nothing(alice, settings) -> None:
    from webapp.accounts.services import api_key_create
    from webapp.documents.models import Document
    from webapp.storage import object_store

    _, key = api_key_create(user=alice, name="k")
    settings.S3_ENDPOINT = f"127.0.0.1:{services.free_port()}"  # S3 stopped: refused
    object_store.cache_clear()
    try:
        response = Client().post(
            "/api/v1/documents",
            {"file": SimpleUploadedFile("a.txt", b"Some notes.")},
            HTTP_AUTHORIZATION=f"Bearer {key}",
        )
    finally:
        object_store.cache_clear()
    assert response.status_code == 503, response.content
    assert response["Retry-After"].isdigit() and response.json()["code"] == "service_unavailable"
    assert not Document.objects.filter(owner=alice).exclude(status="failed").exists()


@pytest.mark.django_db
def test_readiness_fails_while_redis_is_down_and_liveness_does_not(valkey_down, client) -> None:
    """Kubernetes takes a web replica out of the load balancer while its Redis is down, and
    does not restart it for that (a restart cannot fix Redis)."""
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["failed"] == ["broker"]
    assert PASSWORD not in ready.content.decode()
    assert client.get("/livez").status_code == 200


@pytest.mark.django_db
def test_logging_in_works_with_the_rate_limits_cache_down(
    alice, settings, stopped_valkey_url, caplog
) -> None:
    """The per-address login limit is counted in Django's cache (valkey): with it down the
    attempt is let through (axes still locks a guessed username), not a 503 for everyone."""
    settings.CACHES = {"default": {**settings.CACHES["default"], "LOCATION": stopped_valkey_url}}
    settings.LOGIN_RATE_LIMIT = "1/d"
    client = Client()
    for _ in range(2):  # past the limit, had it been counted
        response = client.post(
            "/accounts/login/", {"username": "alice", "password": "alice-passphrase"}
        )
        assert response.status_code == 302
    assert "the login rate limit is not counted, the cache is down" in caplog.text


def _frames(events) -> list[str]:
    async def collect() -> list[str]:
        return [frame async for frame in events]

    return asyncio.run(collect())


def _pending_answer(owner) -> Message:
    conversation = Conversation.objects.create(owner=owner, title="t", source="api")
    return Message.objects.create(
        conversation=conversation, role=Message.Role.ASSISTANT, status=Message.Status.PENDING
    )


@pytest.mark.django_db
def test_the_apis_answer_stream_ends_with_an_error_event_when_redis_is_down(
    alice, valkey_down
) -> None:
    """Its response began (200, ``start``): the lost stream is an ``error`` event in the
    API's shape, saying where the answer will be, not a connection cut mid-stream."""
    from webapp.api.v1 import _query_events

    answer = _pending_answer(alice)
    frames = _frames(_query_events(answer, []))
    assert frames[0].startswith("event: start")
    assert frames[-1].startswith("event: error\n")
    error = json.loads(frames[-1].split("data: ", 1)[1])
    assert error["code"] == "service_unavailable"
    assert f"/api/v1/conversations/{answer.conversation_id}" in error["message"]
    assert PASSWORD not in "".join(frames)


@pytest.mark.django_db
def test_the_openai_stream_ends_with_an_error_object_and_done_when_redis_is_down(
    alice, valkey_down
) -> None:
    """OpenAI's clients raise the ``{"error": ...}`` object of a stream; ``[DONE]`` ends it."""
    from webapp.api.openai import _completion_events

    answer = _pending_answer(alice)
    frames = _frames(_completion_events(answer, "ragblend"))
    assert frames[-1] == "data: [DONE]\n\n"
    error = json.loads(frames[-2].split("data: ", 1)[1])["error"]
    assert error["code"] == "service_unavailable" and error["type"] == "server_error"
    assert "not responding" in error["message"] and set(error) >= {"message", "type", "param"}
