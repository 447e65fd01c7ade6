"""The browser's answer stream (SSE) over the real Redis stream: long silences, reconnects."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from django.urls import reverse

from kvservice.protocol import (
    AnswerMetrics,
    AnswerOutcome,
    Done,
    Error,
    Queue,
    Token,
    answer_stream,
    decode_events,
    publish_event,
)
from webapp.chat.models import Conversation, Message
from webapp.chat.services import record_report
from webapp.chat.views import _event_stream
from webapp.redis import STREAM_SOCKET_TIMEOUT_S


@pytest.fixture
def publisher():
    client = redis.Redis.from_url(settings.REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def answer(django_user_model) -> Message:
    alice = django_user_model.objects.create_user(username="alice", password="alice-passphrase")
    conversation = Conversation.objects.create(owner=alice, title="t")
    return Message.objects.create(
        conversation=conversation, role=Message.Role.ASSISTANT, status=Message.Status.PENDING
    )


def _collect(answer: Message, last_id: str = "0") -> list[str]:
    async def run() -> list[str]:
        return [event async for event in _event_stream(answer, last_id)]

    return asyncio.run(run())


def _body(response) -> list[str]:
    async def read() -> bytes:
        return b"".join([part async for part in response.streaming_content])

    return asyncio.run(read()).decode().split("\n\n")


def _events(frames: list[str]) -> list[tuple[str, str, str]]:
    """(id, event, data) of each SSE frame that is an event (comments dropped)."""
    events = []
    for frame in frames:
        fields = dict(line.split(": ", 1) for line in frame.strip().split("\n") if ": " in line)
        if "event" in fields:
            events.append((fields.get("id", ""), fields["event"], fields.get("data", "")))
    return events


@pytest.mark.django_db
def test_a_silence_longer_than_the_socket_timeout_keeps_the_stream(answer, publisher) -> None:
    """The model may be silent for longer than redis-py's default 5 s socket timeout (a long
    prefill on a busy machine); the stream must keep waiting, not raise a TimeoutError."""
    assert STREAM_SOCKET_TIMEOUT_S > 5

    def later() -> None:
        time.sleep(6.5)
        publish_event(publisher, str(answer.request_id), Token(text="Vienna"))
        publish_event(publisher, str(answer.request_id), Done(AnswerOutcome("done", text="Vienna")))

    thread = threading.Thread(target=later)
    thread.start()
    try:
        frames = _collect(answer)
    finally:
        thread.join()
    assert ": keep-alive\n\n" in frames  # the first 5 s block ended empty, and went on
    assert [(e, d) for _, e, d in _events(frames)][0] == ("token", "Vienna")
    assert _events(frames)[-1][1] == "done"


@pytest.mark.django_db
def test_a_reconnect_resumes_after_the_last_event_id(answer, publisher, client) -> None:
    for word in ("The", " Danube", " flows"):
        publish_event(publisher, str(answer.request_id), Token(text=word))
    ended = Done(AnswerOutcome("done", text="The Danube flows"))
    publish_event(publisher, str(answer.request_id), ended)
    first = _events(_collect(answer))
    assert [d for _, e, d in first if e == "token"] == ["The", " Danube", " flows"]
    assert all(event_id for event_id, _, _ in first)  # every event names its entry

    # The browser's EventSource sends back the last id it saw when it reconnects.
    client.force_login(answer.conversation.owner)
    response = client.get(f"/chat/messages/{answer.id}/stream", HTTP_LAST_EVENT_ID=first[1][0])
    assert response.status_code == 200
    again = _events(_body(response))
    assert [d for _, e, d in again if e == "token"] == [" flows"]
    assert again[-1][1] == "done"

    # An id that is not a stream id is ignored: the whole answer again, nothing broken.
    response = client.get(f"/chat/messages/{answer.id}/stream", HTTP_LAST_EVENT_ID="0; DROP")
    assert [d for _, e, d in _events(_body(response)) if e == "token"] == [
        "The",
        " Danube",
        " flows",
    ]


@pytest.mark.django_db(transaction=True)
def test_the_browser_hears_done_once_the_workers_report_is_recorded(answer, publisher) -> None:
    """The worker streams the words and reports the answer; the record task stores it, then
    ends the stream (``record_report``): the page's re-fetch on done finds the answer."""
    request_id = str(answer.request_id)
    publish_event(publisher, request_id, Token(text="Vienna"))
    metrics = AnswerMetrics(mode="blend", ttft_s=0.25)
    outcome = AnswerOutcome.answered("done", text="Vienna", metrics=metrics)
    seen_open = []

    def report_later() -> None:  # the record task, a moment after the last words
        time.sleep(0.3)
        record_report(message_id=answer.id, request_id=request_id, outcome=outcome)
        connections.close_all()

    async def run() -> None:
        async for frame in _event_stream(answer):
            if "event: done" in frame:  # what the browser reads: the record is already there
                stored = await Message.objects.aget(id=answer.id)
                seen_open.append(stored.is_open)
        await sync_to_async(connections.close_all)()  # the executor thread's connection

    reporter = threading.Thread(target=report_later)
    reporter.start()
    asyncio.run(run())
    reporter.join()
    assert seen_open == [False]
    answer.refresh_from_db()
    assert answer.status == Message.Status.DONE and answer.content == "Vienna"
    assert answer.ttft_s == 0.25


@pytest.mark.django_db(transaction=True)
def test_the_stream_view_ends_on_done_without_polling_for_the_record(
    answer, publisher, monkeypatch
) -> None:
    """The end is appended once the answer is recorded, so the view relays it at once and
    never asks the database (it used to poll for the record for up to 10 s after ``done``)."""
    asked = []
    monkeypatch.setattr(Message.objects, "filter", lambda *a, **k: asked.append(k))
    request_id = str(answer.request_id)
    publish_event(publisher, request_id, Token(text="Vienna"))
    publish_event(publisher, request_id, Done(AnswerOutcome.answered("done", text="Vienna")))
    started = time.monotonic()
    frames = _collect(answer)
    assert any("event: done" in frame for frame in frames) and asked == []
    assert time.monotonic() - started < 1.0


@pytest.mark.django_db(transaction=True)
def test_a_report_ends_the_stream_once_even_when_the_task_runs_again(answer, publisher) -> None:
    """The record task retried (or delivered twice): the answer is stored once and its stream
    ends once; an answer the reaper ended first keeps the reaper's end."""
    request_id = str(answer.request_id)
    outcome = AnswerOutcome.answered("done", text="Vienna")
    for _ in range(2):
        record_report(message_id=answer.id, request_id=request_id, outcome=outcome)
    name = answer_stream(request_id)
    ends = [e for _, e in decode_events([(name, publisher.xrange(name))])]
    assert ends == [Done(outcome)]
    answer.refresh_from_db()
    assert answer.status == Message.Status.DONE

    failed = Message.objects.create(
        conversation=answer.conversation, role="assistant", status=Message.Status.FAILED
    )
    publish_event(publisher, str(failed.request_id), Error("not_answered", "gone"))
    record_report(message_id=failed.id, request_id=str(failed.request_id), outcome=outcome)
    name = answer_stream(str(failed.request_id))
    assert [e.kind for _, e in decode_events([(name, publisher.xrange(name))])] == ["error"]


@pytest.mark.django_db
def test_a_waiting_question_shows_its_place_in_line_then_its_words(answer, publisher) -> None:
    """The worker's ``queue`` entries become the page's place line, cleared once the
    question is being answered; the words follow as before."""
    request_id = str(answer.request_id)
    for ahead in (2, 1, 0, None):
        publish_event(publisher, request_id, Queue(ahead=ahead))
    publish_event(publisher, request_id, Token(text="Vienna"))
    publish_event(publisher, request_id, Done(AnswerOutcome("done", text="Vienna")))
    events = [(event, data) for _, event, data in _events(_collect(answer))]
    assert events[:4] == [
        ("queue", "2 questions ahead of yours."),
        ("queue", "1 question ahead of yours."),
        ("queue", "Yours is the next question the model takes."),
        ("queue", ""),
    ]
    assert events[4] == ("token", "Vienna") and events[-1][0] == "done"


@pytest.mark.django_db
def test_the_message_being_written_has_a_place_for_the_line(answer, client) -> None:
    client.force_login(answer.conversation.owner)
    page = client.get(reverse("chat:conversation", args=[answer.conversation_id]))
    page = page.content.decode()
    block = page.split(f'id="message-{answer.id}"')[1]
    assert 'sse-swap="queue"' in block.split('sse-swap="token"')[0]
