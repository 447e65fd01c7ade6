"""The REST API and the OpenAI-compatible endpoint without the model: auth, isolation between
users, validation, rate limits, answers (a stand-in worker streams them through Redis)."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from django.test import Client

from kvservice.protocol import AnswerMetrics, AnswerOutcome, Done, Queue, Token, publish_event
from tests.webapp.api.conftest import bearer
from tests.webapp.api.fake_worker import FakeInferenceWorker
from tests.webapp.chat.test_chat import PASSAGES, make_document
from webapp.accounts.models import ApiKey
from webapp.accounts.services import api_key_revoke
from webapp.chat import services as chat
from webapp.chat.models import Conversation, Message
from webapp.chat.requests import HISTORY_TURNS
from webapp.documents.models import Document
from webapp.redis import redis_client
from webapp.storage import object_store

ENDPOINTS = [
    ("get", "/api/v1/documents"),
    ("post", "/api/v1/documents"),
    ("get", "/api/v1/documents/usage"),
    ("get", "/api/v1/documents/1"),
    ("delete", "/api/v1/documents/1"),
    ("post", "/api/v1/query"),
    ("get", "/api/v1/conversations"),
    ("get", "/api/v1/conversations/1"),
    ("get", "/api/v1/cache/stats"),
    ("get", "/api/v1/collections"),
    ("post", "/api/v1/collections"),
    ("get", "/api/v1/collections/1"),
    ("patch", "/api/v1/collections/1"),
    ("delete", "/api/v1/collections/1"),
    ("post", "/v1/chat/completions"),
    ("get", "/v1/models"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("method", "url"), ENDPOINTS)
def test_every_endpoint_needs_authentication(alice, method, url) -> None:
    """A missing or bad key is a 401 before any CSRF check, as a program sees it (the CSRF
    check on: it made ``POST /api/v1/query`` a 403 "CSRF check Failed"), with the OpenAI
    error body on /v1/; a signed-in browser's session with a bad key is judged by the key."""
    client = Client(enforce_csrf_checks=True)
    body = {"question": "q", "model": "ragblend", "messages": [{"role": "user", "content": "q"}]}
    for headers in (
        {},
        {"HTTP_AUTHORIZATION": "Bearer rbk_not-a-key"},
        {"HTTP_AUTHORIZATION": "Basic YWxpY2U6cHc="},
    ):
        response = getattr(client, method)(url, body, content_type="application/json", **headers)
        assert response.status_code == 401, (url, headers, response.content)
        assert response["WWW-Authenticate"] == "Bearer"
        error = response.json() if url.startswith("/api/") else response.json()["error"]
        assert "Bearer" in error["message"]
        if not url.startswith("/api/"):
            assert error["type"] == "authentication_error"
        client.force_login(alice)  # the next headers with a session cookie too
    client.logout()


@pytest.mark.django_db
def test_a_browser_session_still_needs_its_csrf_token(alice) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    assert client.get("/api/v1/collections").status_code == 200
    response = client.post("/api/v1/collections", {"name": "x"}, content_type="application/json")
    assert response.status_code == 403 and "CSRF" in response.json()["message"]
    client.get("/documents/")  # a page sets the CSRF cookie, as in the browser
    token = client.cookies["csrftoken"].value
    response = client.post(
        "/api/v1/collections",
        {"name": "x"},
        content_type="application/json",
        HTTP_X_CSRFTOKEN=token,
    )
    assert response.status_code == 201, response.content


@pytest.mark.django_db
def test_documents_upload_list_detail_delete(client, alice_auth) -> None:
    from django.core.files.uploadedfile import SimpleUploadedFile

    upload = SimpleUploadedFile("notes.md", b"# Rivers\n\nThe Danube flows to the Black Sea.\n")
    response = client.post("/api/v1/documents", {"file": upload}, **alice_auth)
    assert response.status_code == 201, response.content
    created = response.json()
    assert created["status"] == "queued" and set(created) == {"id", "status"}

    detail = client.get(f"/api/v1/documents/{created['id']}", **alice_auth).json()
    assert {k: detail[k] for k in ("id", "title", "status", "progress", "error")} == {
        "id": created["id"],
        "title": "notes.md",
        "status": "queued",
        "progress": 0,
        "error": "",
    }
    listing = client.get("/api/v1/documents?limit=10", **alice_auth).json()
    assert listing["count"] == 1 and listing["items"][0]["id"] == created["id"]

    assert client.delete(f"/api/v1/documents/{created['id']}", **alice_auth).status_code == 204
    assert client.get(f"/api/v1/documents/{created['id']}", **alice_auth).status_code == 404
    assert not Document.objects.filter(pk=created["id"]).exists()


@pytest.mark.django_db
def test_a_refused_upload_is_a_422_and_stores_nothing(client, alice, alice_auth) -> None:
    from django.core.files.uploadedfile import SimpleUploadedFile

    program = SimpleUploadedFile("setup.exe", b"MZ\x90\x00\x03" + bytes(range(256)) * 4)
    response = client.post("/api/v1/documents", {"file": program}, **alice_auth)
    assert response.status_code == 422, response.content
    body = response.json()
    assert body["code"] == "upload_refused" and "Unsupported file type" in body["message"]
    assert not Document.objects.exists()
    mine = f"originals/{alice.pk}/"
    assert not list(object_store().list_objects(settings.S3_DOCUMENTS_BUCKET, prefix=mine))


@pytest.mark.django_db
def test_bad_payloads_get_4xx_with_a_message(client, alice_auth) -> None:
    from django.core.files.uploadedfile import SimpleUploadedFile

    cases = [
        client.post("/api/v1/documents", {}, **alice_auth),  # no file
        client.post("/api/v1/documents", {"file": SimpleUploadedFile("e.txt", b"")}, **alice_auth),
        client.post("/api/v1/query", "{not json", content_type="application/json", **alice_auth),
        client.post(
            "/api/v1/query", {"question": ""}, content_type="application/json", **alice_auth
        ),
        client.post(
            "/api/v1/query", {"question": "  "}, content_type="application/json", **alice_auth
        ),
        client.post(
            "/api/v1/query",
            {"question": "q", "mode": "warp"},
            content_type="application/json",
            **alice_auth,
        ),
        client.post(
            "/api/v1/query",
            {"question": "q", "colour": 1},
            content_type="application/json",
            **alice_auth,
        ),
        client.get("/api/v1/documents?limit=0", **alice_auth),
        client.get("/api/v1/documents/not-a-number", **alice_auth),
    ]
    for response in cases:
        assert 400 <= response.status_code < 500, response.content
        body = response.json()
        assert body["code"] and body["message"], body
    assert cases[1].json()["message"] == "The file is empty."

    for payload in (
        {"model": "ragblend", "messages": []},
        {"model": "ragblend", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "ragblend", "messages": [{"role": "assistant", "content": "x"}]},
        {"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]},
    ):
        response = client.post(
            "/v1/chat/completions", payload, content_type="application/json", **alice_auth
        )
        assert 400 <= response.status_code < 500, response.content
        assert response.json()["error"]["message"]


@pytest.mark.django_db
def test_one_users_key_never_reaches_another_users_data(
    client, alice, alice_auth, mallory_auth
) -> None:
    document = make_document(alice, "alice's secrets", [PASSAGES["space"]])
    conversation = chat.conversation_create(owner=alice, title="alice's chat")
    for method, url in [
        ("get", f"/api/v1/documents/{document.id}"),
        ("delete", f"/api/v1/documents/{document.id}"),
        ("get", f"/api/v1/conversations/{conversation.id}"),
    ]:
        response = getattr(client, method)(url, **mallory_auth)
        assert response.status_code == 404, url
        assert response.json()["code"] == "not_found"
    response = client.post(
        "/api/v1/query",
        {"question": "q", "conversation_id": conversation.id},
        content_type="application/json",
        **mallory_auth,
    )
    assert response.status_code == 404
    assert client.get("/api/v1/documents", **mallory_auth).json()["count"] == 0
    assert client.get("/api/v1/conversations", **mallory_auth).json()["count"] == 0
    assert Document.objects.filter(pk=document.pk).exists()
    assert client.get(f"/api/v1/documents/{document.id}", **alice_auth).status_code == 200


@pytest.mark.django_db
def test_revoked_key_is_refused(client, alice) -> None:
    headers = bearer(alice)
    assert client.get("/api/v1/documents", **headers).status_code == 200
    api_key_revoke(api_key=ApiKey.objects.get(user=alice))
    assert client.get("/api/v1/documents", **headers).status_code == 401


@pytest.mark.django_db
def test_rate_limit_answers_429_with_retry_after(client, alice, mallory, settings) -> None:
    settings.API_RATE_LIMIT_REQUESTS = 3
    headers = bearer(alice)
    statuses = [client.get("/api/v1/documents", **headers).status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    response = client.get("/api/v1/documents", **headers)
    assert response.json()["code"] == "rate_limited"
    assert 1 <= int(response["Retry-After"]) <= settings.API_RATE_LIMIT_WINDOW_S
    # The limit is the user's: another of her keys, her session and her questions in the
    # browser are over it too; another user is not.
    assert client.get("/api/v1/documents", **bearer(alice, "another")).status_code == 429
    client.force_login(alice)
    assert client.get("/api/v1/documents").status_code == 429
    conversation = Conversation.objects.create(owner=alice, title="t")
    asked = client.post(f"/chat/{conversation.id}/ask", {"question": "q"}, HTTP_HX_REQUEST="true")
    assert asked.status_code == 429 and asked["Retry-After"].isdigit()
    client.logout()
    assert client.get("/api/v1/documents", **bearer(mallory)).status_code == 200


@pytest.mark.django_db
def test_session_auth_works_for_the_browser(client, alice) -> None:
    client.force_login(alice)
    assert client.get("/api/v1/conversations").status_code == 200


@pytest.mark.django_db
def test_other_modes_and_cache_stats_are_for_staff(client, alice_auth, staff) -> None:
    response = client.post(
        "/api/v1/query",
        {"question": "q", "mode": "full"},
        content_type="application/json",
        **alice_auth,
    )
    assert response.status_code == 403 and "staff" in response.json()["message"]
    assert client.get("/api/v1/cache/stats", **alice_auth).status_code == 403
    stats = client.get("/api/v1/cache/stats", **bearer(staff)).json()
    assert set(stats["chunks"]) == {"pending", "ready", "failed"}
    models = client.get("/v1/models", **alice_auth).json()
    assert [m["id"] for m in models["data"]] == ["ragblend"]
    assert "ragblend-full" in [
        m["id"] for m in client.get("/v1/models", **bearer(staff)).json()["data"]
    ]


@pytest.mark.django_db
def test_answer_that_never_comes_is_a_504_not_a_hang(client, alice, alice_auth, settings) -> None:
    settings.API_ANSWER_TIMEOUT_S = 0.5
    make_document(alice, "notes", list(PASSAGES.values()))
    response = client.post(
        "/api/v1/query",
        {"question": "Which rice for risotto?"},
        content_type="application/json",
        **alice_auth,
    )
    assert response.status_code == 504 and response.json()["code"] == "timeout"


# The answer is sent to the worker on commit, so these tests commit (transactional_db).


@pytest.fixture
def worker():
    with FakeInferenceWorker(redis_client()) as fake:
        yield fake


@pytest.mark.django_db(transaction=True)
def test_query_answers_with_citations_and_metrics(client, alice, alice_auth, worker) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    response = client.post(
        "/api/v1/query",
        {"question": "Which rice goes into a risotto?"},
        content_type="application/json",
        **alice_auth,
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["answer"] == "Arborio rice [1]."
    assert body["citations"][0]["text"] == PASSAGES["cooking"]
    assert body["citations"][0]["document_id"] and body["citations"][0]["chunk_id"]
    assert body["metrics"]["mode"] == "blend" and body["metrics"]["recompute_ratio"] == 0.15
    assert body["metrics"]["tiers"] == {"cpu": len(body["citations"])}
    assert set(body["metrics"]) >= {"ttft_s", "total_s", "mode", "recompute_ratio", "tiers"}

    # A follow-up in the same conversation carries the history to the worker.
    follow = client.post(
        "/api/v1/query",
        {"question": "And the stock?", "conversation_id": body["conversation_id"]},
        content_type="application/json",
        **alice_auth,
    )
    assert follow.status_code == 200
    assert worker.requests[-1]["history"][0]["content"] == "Which rice goes into a risotto?"
    detail = client.get(f"/api/v1/conversations/{body['conversation_id']}", **alice_auth).json()
    assert [m["role"] for m in detail["messages"]] == ["user", "assistant"] * 2


@pytest.mark.django_db(transaction=True)
def test_query_streams_server_sent_events(client, alice, alice_auth, worker) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    response = client.post(
        "/api/v1/query",
        {"question": "Risotto rice?", "stream": True},
        content_type="application/json",
        **alice_auth,
    )
    assert response.status_code == 200 and response["Content-Type"] == "text/event-stream"
    events = []
    for block in b"".join(response).decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    kinds = [kind for kind, _ in events]
    assert kinds == ["start", "token", "token", "token", "done"]
    assert "".join(data["text"] for kind, data in events if kind == "token") == "Arborio rice [1]."
    assert events[-1][1]["citations"][0]["text"] == PASSAGES["cooking"]


async def _asgi_query(auth: str, question: str):
    """POST a streamed query to the ASGI application; returns the pending call and the
    queue its ASGI messages arrive on, one ``http.response.body`` per event sent."""
    from django.core.asgi import get_asgi_application

    inbox, outbox = asyncio.Queue(), asyncio.Queue()
    body = json.dumps({"question": question, "stream": True}).encode()
    await inbox.put({"type": "http.request", "body": body, "more_body": False})
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/v1/query",
        "raw_path": b"/api/v1/query",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"authorization", auth.encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
    }
    call = asyncio.create_task(get_asgi_application()(scope, inbox.get, outbox.put))
    return call, outbox


async def _next_body(outbox: asyncio.Queue) -> bytes:
    while True:
        message = await asyncio.wait_for(outbox.get(), 30)
        if message["type"] == "http.response.body" and message.get("body"):
            return message["body"]


@pytest.mark.django_db(transaction=True)
def test_streamed_query_sends_each_token_as_it_comes_under_asgi(alice, alice_auth) -> None:
    """Under ASGI (uvicorn) a token reaches the client while the answer is still being
    written: the stream is not buffered until the worker's ``done``."""
    make_document(alice, "notes", list(PASSAGES.values()))
    client = redis_client()

    async def scenario() -> None:
        call, outbox = await _asgi_query(alice_auth["HTTP_AUTHORIZATION"], "Risotto rice?")
        head = await asyncio.wait_for(outbox.get(), 30)
        assert head["type"] == "http.response.start" and head["status"] == 200
        start = await _next_body(outbox)
        assert start.startswith(b"event: start")
        message_id = json.loads(start.decode().split("data: ", 1)[1])["message_id"]
        answer = await Message.objects.aget(pk=message_id)
        publish_event(client, str(answer.request_id), Token(text="Arborio"))
        token = await _next_body(outbox)  # no done event exists yet
        assert token.startswith(b"event: token") and b"Arborio" in token
        publish_event(client, str(answer.request_id), Done(AnswerOutcome("done", text="Arborio")))
        done = await _next_body(outbox)
        assert done.startswith(b"event: done") and b'"answer": "Arborio"' in done
        await asyncio.wait_for(call, 30)
        await sync_to_async(connections.close_all)()  # the ORM thread's connection

    asyncio.run(scenario())


@pytest.mark.django_db(transaction=True)
def test_a_streamed_query_says_how_many_questions_are_ahead(alice, alice_auth) -> None:
    """While the question waits for the model, ``queue`` events carry its place (null once
    it is being answered); then its words."""
    make_document(alice, "notes", list(PASSAGES.values()))
    client = redis_client()

    async def scenario() -> None:
        call, outbox = await _asgi_query(alice_auth["HTTP_AUTHORIZATION"], "Risotto rice?")
        assert (await asyncio.wait_for(outbox.get(), 30))["status"] == 200
        start = await _next_body(outbox)
        message_id = json.loads(start.decode().split("data: ", 1)[1])["message_id"]
        answer = await Message.objects.aget(pk=message_id)
        for ahead in (1, None):
            publish_event(client, str(answer.request_id), Queue(ahead=ahead))
            place = await _next_body(outbox)
            assert place.startswith(b"event: queue")
            assert json.loads(place.decode().split("data: ", 1)[1]) == {"ahead": ahead}
        publish_event(client, str(answer.request_id), Token(text="Arborio"))
        assert (await _next_body(outbox)).startswith(b"event: token")
        publish_event(client, str(answer.request_id), Done(AnswerOutcome("done", text="Arborio")))
        assert (await _next_body(outbox)).startswith(b"event: done")
        await asyncio.wait_for(call, 30)
        await sync_to_async(connections.close_all)()

    asyncio.run(scenario())


@pytest.mark.django_db(transaction=True)
def test_an_openai_stream_waits_through_the_queue_for_its_words(alice) -> None:
    """OpenAI's chunks have no place in line: a ``queue`` event is a comment, and the
    stream goes on to its words and its end (it used to end at the first other event)."""
    from webapp.api.openai import _completion_events

    conversation = Conversation.objects.create(owner=alice, title="t")
    answer = Message.objects.create(
        conversation=conversation, role=Message.Role.ASSISTANT, status=Message.Status.PENDING
    )
    client = redis_client()
    publish_event(client, str(answer.request_id), Queue(ahead=3))
    publish_event(client, str(answer.request_id), Token(text="Arborio"))
    outcome = AnswerOutcome.answered(
        "done", text="Arborio", metrics=AnswerMetrics(completion_tokens=1)
    )
    publish_event(client, str(answer.request_id), Done(outcome))

    async def collect() -> list[str]:
        frames = [frame async for frame in _completion_events(answer, "ragblend")]
        await sync_to_async(connections.close_all)()
        return frames

    frames = asyncio.run(collect())
    assert frames[1] == ": waiting for the model\n\n"
    chunks = [json.loads(f.split("data: ", 1)[1]) for f in frames[2:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"content": "Arborio"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert frames[-1].startswith("data: [DONE]")


@pytest.mark.django_db(transaction=True)
def test_failed_generation_is_a_502_with_the_reason(client, alice, alice_auth) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    with FakeInferenceWorker(redis_client(), fail=True):
        response = client.post(
            "/api/v1/query",
            {"question": "Which rice for a risotto?"},
            content_type="application/json",
            **alice_auth,
        )
    assert response.status_code == 502 and "exploded" in response.json()["message"]


@pytest.mark.django_db(transaction=True)
def test_chat_completions_uses_the_last_user_message_and_history(
    client, alice, alice_auth, worker
) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    payload = {
        "model": "ragblend",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Where does the Danube flow?"},
            {"role": "assistant", "content": "To the Black Sea."},
            {"role": "user", "content": [{"type": "text", "text": "Which rice for risotto?"}]},
        ],
    }
    response = client.post(
        "/v1/chat/completions", payload, content_type="application/json", **alice_auth
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Arborio rice [1]."}
    assert body["citations"][0]["text"] == PASSAGES["cooking"]
    request = worker.requests[-1]
    assert request["question"] == "Which rice for risotto?"
    assert request["history"] == []  # a new topic: the earlier question is not the model's
    assert Message.objects.filter(conversation_id=body["ragblend"]["conversation_id"]).count() == 4

    follow_up = {"role": "user", "content": "And which stock?"}
    response = client.post(
        "/v1/chat/completions",
        payload
        | {
            "messages": [
                *payload["messages"],
                {"role": "assistant", "content": "Arborio."},
                follow_up,
            ]
        },
        content_type="application/json",
        **alice_auth,
    )
    assert response.status_code == 200, response.content
    # A follow-up's earlier questions go to the model; the answers (the client's) do not.
    assert [t["content"] for t in worker.requests[-1]["history"]] == ["Which rice for risotto?"]


@pytest.mark.django_db(transaction=True)
def test_chat_completions_keeps_only_the_history_the_model_reads(
    client, alice, alice_auth, worker, settings
) -> None:
    """A client that resends a long conversation (here 100 turns of 8 KB) stores what the
    model reads: the last exchanges, each cut to the question limit."""
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"{i} " + "x" * 8000}
        for i in range(100)
    ]
    payload = {"model": "ragblend", "messages": [*turns, {"role": "user", "content": "Rice?"}]}
    response = client.post(
        "/v1/chat/completions", payload, content_type="application/json", **alice_auth
    )
    assert response.status_code == 200, response.content
    stored = Message.objects.filter(conversation_id=response.json()["ragblend"]["conversation_id"])
    history = [m.content for m in stored.order_by("id")][:-2]  # the question and its answer last
    assert len(history) == 2 * HISTORY_TURNS
    assert history[0].startswith("94 ") and history[-1].startswith("99 ")
    assert all(len(text) <= settings.CHAT_MAX_QUESTION_CHARS for text in history)


@pytest.mark.django_db(transaction=True)
def test_an_answer_cut_at_the_token_limit_says_length_not_stop(client, alice, alice_auth) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    question = "Tell me more about risotto rice."
    payload = {"model": "ragblend", "messages": [{"role": "user", "content": question}]}
    for stream in (False, True):
        with FakeInferenceWorker(redis_client(), finish_reason="length"):
            response = client.post(
                "/v1/chat/completions",
                payload | {"stream": stream},
                content_type="application/json",
                **alice_auth,
            )
            assert response.status_code == 200, response.content
            if stream:
                body = b"".join(response).decode()
                assert '"finish_reason": "length"' in body
            else:
                assert response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.django_db(transaction=True)
def test_api_conversations_stay_out_of_the_browsers_sidebar(
    client, alice, alice_auth, worker
) -> None:
    payload = {"model": "ragblend", "messages": [{"role": "user", "content": "Rice?"}]}
    for _ in range(3):
        client.post("/v1/chat/completions", payload, content_type="application/json", **alice_auth)
    mine = chat.conversation_create(owner=alice, title="Asked in the browser")
    client.force_login(alice)
    page = client.get("/chat/").content.decode()
    assert f'href="/chat/{mine.id}/"' in page  # how the sidebar links a conversation
    assert Conversation.objects.filter(owner=alice, source="api").count() == 3
    api_ids = set(Conversation.objects.filter(source="api").values_list("pk", flat=True))
    assert not any(f'href="/chat/{pk}/"' in page for pk in api_ids)
    listed = client.get("/api/v1/conversations", **alice_auth).json()
    assert listed["count"] == 4  # the API lists them all


@pytest.mark.django_db(transaction=True)
def test_with_no_documents_the_answer_says_nothing_was_found(client, alice, alice_auth) -> None:
    """Nothing to retrieve: no request reaches the model (none runs here), and the answer,
    streamed and stored like any other, says so instead of inventing one."""
    response = client.post(
        "/api/v1/query",
        {"question": "What is our leave policy?"},
        content_type="application/json",
        **alice_auth,
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["answer"] == chat.NOTHING_FOUND and body["citations"] == []
    stored = Message.objects.get(pk=body["message_id"])
    assert stored.status == Message.Status.DONE and stored.content == chat.NOTHING_FOUND


@pytest.mark.django_db(transaction=True)
def test_the_answer_lists_the_passages_it_cites_and_the_rest_as_also_retrieved(
    client, alice, alice_auth, worker
) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    response = client.post(
        "/api/v1/query",
        {"question": "Which rice and stock for a risotto?"},
        content_type="application/json",
        **alice_auth,
    )
    body = response.json()
    assert body["answer"] == "Arborio rice [1]."
    assert [c["rank"] for c in body["citations"]] == [1] and body["citations"][0]["cited"]
    assert body["citations"][0]["highlight"] == PASSAGES["cooking"]
    assert all(not c["cited"] for c in body["also_retrieved"])
    retrieval = body["metrics"]["retrieval"]
    assert [r["rank"] for r in retrieval] == list(range(1, len(retrieval) + 1))
    assert all(r["score"] >= 0.3 for r in retrieval) and body["metrics"]["not_found"] is False


@pytest.mark.django_db(transaction=True)
def test_a_question_the_documents_do_not_answer_is_not_found_in_both_apis(
    client, alice, alice_auth, worker
) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    response = client.post(
        "/api/v1/query",
        {"question": "What is the office dress code?"},
        content_type="application/json",
        **alice_auth,
    )
    body = response.json()
    assert body["answer"] == chat.NOT_IN_DOCUMENTS and body["citations"] == []
    assert body["metrics"]["not_found"] is True and body["metrics"]["retrieval"] == []
    completion = client.post(
        "/v1/chat/completions",
        {"model": "ragblend", "messages": [{"role": "user", "content": "Office dress code?"}]},
        content_type="application/json",
        **alice_auth,
    ).json()
    assert completion["choices"][0]["message"]["content"] == chat.NOT_IN_DOCUMENTS
    assert completion["ragblend"]["metrics"]["not_found"] is True
    assert worker.requests == []  # the model was never asked


def test_a_nul_character_anywhere_in_a_request_is_a_422_naming_where(client, alice_auth) -> None:
    """PostgreSQL's text cannot hold a NUL: a request with one is refused before any service
    sees it (it was a 500, found by the schema fuzzing one field at a time), in both APIs, and
    the message says which field."""
    json_request = {"content_type": "application/json", **alice_auth}
    cases = {
        "name": client.post("/api/v1/collections", {"name": "Kit\x00chen"}, **json_request),
        "shared_with.1": client.post(
            "/api/v1/collections", {"name": "K", "shared_with": ["bob", "b\x00b"]}, **json_request
        ),
        "question": client.post("/api/v1/query", {"question": "Why\x00?"}, **json_request),
        "messages.0.content": client.post(
            "/v1/chat/completions",
            {"model": "ragblend", "messages": [{"role": "user", "content": "a\x00"}]},
            **json_request,
        ),
    }
    for where, response in cases.items():
        assert response.status_code == 422, (where, response.content)
        assert where in response.content.decode(), (where, response.content)
    assert not Conversation.objects.exists()  # nothing was stored
    listed = client.get("/api/v1/collections", **alice_auth).json()
    assert not [c for c in listed["items"] if c["name"].startswith("K")]
