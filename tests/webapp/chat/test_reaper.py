"""Answers nobody will finish are ended (webapp/chat/reaper.py), over the real Redis and
PostgreSQL; the slow test kills a real inference worker in the middle of an answer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.utils import timezone

from kvservice.protocol import (
    GENERATE_TASK,
    INFLIGHT_GRACE_S,
    INFLIGHT_KEY,
    AnswerMetrics,
    AnswerOutcome,
    Done,
    GenerateRequest,
    Token,
    answer_stream,
    decode_events,
    inflight_abandon,
    inflight_add,
    inflight_entries,
    inflight_remove,
    mark_alive,
    publish_event,
    stop_requested,
    worker_alive_key,
)
from tests.conftest import ROOT, wait_for
from webapp.chat import services
from webapp.chat.models import Conversation, Message
from webapp.chat.reaper import (
    NOBODY_ANSWERED,
    OVERDUE,
    WORKER_DIED,
    WORKER_LOST,
    hard_limit_s,
    reap_stale_answers,
)
from webapp.redis import redis_client
from worker.celery import app as celery_app


def wait_until_reaped(answer: Message, timeout: float = 30) -> None:
    """Run the reaper (beat runs it every REAPER_INTERVAL_S) until ``answer`` is no longer
    pending."""

    def ended() -> bool:
        reap_stale_answers()
        return Message.objects.get(pk=answer.pk).status != Message.Status.PENDING

    wait_for(ended, timeout=timeout, interval=0.5, what="the reaper to end the answer")


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user(username="alice", password="alice-passphrase")


@pytest.fixture
def new_answer(alice):
    conversation = Conversation.objects.create(owner=alice, title="t")
    made: list[Message] = []

    def make(**fields) -> Message:
        answer = Message.objects.create(
            conversation=conversation,
            role=Message.Role.ASSISTANT,
            status=Message.Status.PENDING,
            mode="blend",
            **fields,
        )
        made.append(answer)
        return answer

    yield make
    for answer in made:  # the in-flight hash is shared with the suite's live worker
        inflight_remove(redis_client(), str(answer.request_id))


def _in_flight(answer: Message, worker: str) -> None:
    request = GenerateRequest(str(answer.request_id), "q", [], message_id=answer.id)
    inflight_add(redis_client(), worker, request)


def _events(answer: Message) -> list[tuple[str, dict]]:
    name = answer_stream(str(answer.request_id))
    reply = [(name, redis_client().xrange(name))]
    return [(event.kind, event.data()) for _id, event in decode_events(reply)]


@pytest.mark.django_db
def test_a_dead_workers_answer_fails_with_what_it_had_streamed(new_answer) -> None:
    answer = new_answer()
    _in_flight(answer, worker=f"gone:{uuid.uuid4()}")  # no alive key: the worker is dead
    for word in ("The Danube", " flows"):
        publish_event(redis_client(), str(answer.request_id), Token(text=word))

    assert reap_stale_answers() >= 1

    answer.refresh_from_db()
    assert answer.status == Message.Status.FAILED and answer.error_message == WORKER_DIED
    assert answer.content == "The Danube flows"  # the partial answer is kept
    kind, payload = _events(answer)[-1]  # readers of the stream are told at once
    assert kind == "error" and payload["message"] == WORKER_DIED
    assert payload["code"] == "not_answered" and payload["text"] == "The Danube flows"
    assert str(answer.request_id) not in inflight_entries(redis_client())


@pytest.mark.django_db
def test_an_answer_finished_on_the_stream_but_never_reported_is_recorded(new_answer) -> None:
    """A stream ended by its worker (an older one, which ended streams itself) whose report
    never came: recorded as it ended."""
    answer = new_answer()
    _in_flight(answer, worker=f"gone:{uuid.uuid4()}")
    publish_event(redis_client(), str(answer.request_id), Token(text="Vienna"))
    outcome = AnswerOutcome("done", text="Vienna", metrics=AnswerMetrics(ttft_s=0.5, mode="blend"))
    publish_event(redis_client(), str(answer.request_id), Done(outcome))
    reap_stale_answers()
    answer.refresh_from_db()
    assert answer.status == Message.Status.DONE and answer.content == "Vienna"
    assert answer.ttft_s == 0.5


@pytest.mark.django_db
def test_a_live_workers_answer_is_left_alone(new_answer) -> None:
    answer, worker = new_answer(), f"alive:{uuid.uuid4()}"
    mark_alive(redis_client(), worker)
    _in_flight(answer, worker)
    try:
        reap_stale_answers()
        answer.refresh_from_db()
        assert answer.status == Message.Status.PENDING
        assert str(answer.request_id) in inflight_entries(redis_client())
    finally:
        redis_client().delete(worker_alive_key(worker))


@pytest.mark.django_db
def test_a_question_no_worker_took_fails_after_the_limit(new_answer, settings) -> None:
    settings.ANSWER_PENDING_LIMIT_S = 60
    old, recent = new_answer(), new_answer()
    Message.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(seconds=61))
    reap_stale_answers()
    old.refresh_from_db()
    recent.refresh_from_db()
    assert old.status == Message.Status.FAILED and old.error_message == NOBODY_ANSWERED
    assert stop_requested(redis_client(), str(old.request_id))  # a late worker drops it
    assert recent.status == Message.Status.PENDING


@pytest.mark.django_db
def test_an_old_answer_asked_again_is_pending_from_its_asking(new_answer, settings) -> None:
    """Regenerate asks an answer again: it keeps its creation time, its wait starts anew."""
    settings.ANSWER_PENDING_LIMIT_S = 60
    long_ago = timezone.now() - timedelta(hours=1)
    again = new_answer(asked_at=timezone.now())
    never_taken = new_answer(asked_at=long_ago + timedelta(seconds=1))
    Message.objects.filter(pk__in=[again.pk, never_taken.pk]).update(created_at=long_ago)
    reap_stale_answers()
    again.refresh_from_db()
    never_taken.refresh_from_db()
    assert again.status == Message.Status.PENDING
    assert never_taken.status == Message.Status.FAILED


@pytest.fixture
def live_worker() -> Iterator[str]:
    """A worker id whose alive key is set: the reaper must not take it for dead."""
    worker = f"alive:{uuid.uuid4()}"
    mark_alive(redis_client(), worker)
    yield worker
    redis_client().delete(worker_alive_key(worker))


@pytest.mark.django_db
def test_answers_their_live_worker_abandoned_are_ended_from_their_streams(
    new_answer, live_worker
) -> None:
    """A worker whose broker stopped answering gives its requests up: an answer it had
    finished on the stream is recorded, one it had not fails with what it streamed."""
    finished, cut = new_answer(), new_answer()
    for answer in (finished, cut):
        request = GenerateRequest(str(answer.request_id), "q", [], message_id=answer.id)
        inflight_abandon(redis_client(), live_worker, request)
    ended = Done(AnswerOutcome("done", text="Vienna"))  # by an older worker, which ended streams
    publish_event(redis_client(), str(finished.request_id), ended)
    publish_event(redis_client(), str(cut.request_id), Token(text="The Danube"))
    reap_stale_answers()
    finished.refresh_from_db()
    cut.refresh_from_db()
    assert finished.status == Message.Status.DONE and finished.content == "Vienna"
    assert cut.status == Message.Status.FAILED and cut.error_message == WORKER_LOST
    assert cut.content == "The Danube" and _events(cut)[-1][0] == "error"
    assert not {str(finished.request_id), str(cut.request_id)} & set(
        inflight_entries(redis_client())
    )


def _in_flight_since(answer: Message, worker: str, seconds_ago: float | None) -> None:
    """An entry as a worker writes it, started ``seconds_ago`` (None: an older worker's,
    with no start time)."""
    entry = {"worker": worker, "message_id": answer.id, "audit_of": None, "timeout_s": 300.0}
    if seconds_ago is not None:
        entry["since"] = time.time() - seconds_ago
    redis_client().hset(INFLIGHT_KEY, str(answer.request_id), json.dumps(entry))


@pytest.mark.django_db
def test_an_answer_in_flight_past_its_timeout_fails_though_its_worker_is_alive(
    new_answer, live_worker
) -> None:
    """A worker alive but stuck on a request (a broker frozen under it, a hung engine) does
    not keep its answer pending: past the request's timeout and the grace, it is ended."""
    stuck, working = new_answer(), new_answer()
    _in_flight_since(stuck, live_worker, seconds_ago=300 + INFLIGHT_GRACE_S + 1)
    _in_flight_since(working, live_worker, seconds_ago=300 + INFLIGHT_GRACE_S - 5)
    publish_event(redis_client(), str(stuck.request_id), Token(text="The Danube"))
    reap_stale_answers()
    stuck.refresh_from_db()
    working.refresh_from_db()
    assert stuck.status == Message.Status.FAILED and stuck.error_message == OVERDUE
    assert stuck.content == "The Danube"
    assert stop_requested(redis_client(), str(stuck.request_id))  # the worker drops it
    assert working.status == Message.Status.PENDING


@pytest.mark.django_db
def test_an_answer_pending_past_the_hard_limit_fails_even_in_flight(
    new_answer, live_worker, settings
) -> None:
    """An entry with no start time (an older worker's) cannot be judged by its timeout: the
    answer still fails once it has been pending past ``hard_limit_s()``."""
    settings.ANSWER_PENDING_LIMIT_S = 60
    old, recent = new_answer(), new_answer()
    for answer, age in ((old, hard_limit_s() + 1), (recent, hard_limit_s() - 30)):
        _in_flight_since(answer, live_worker, seconds_ago=None)
        created = timezone.now() - timedelta(seconds=age)
        Message.objects.filter(pk=answer.pk).update(created_at=created)
    reap_stale_answers()
    old.refresh_from_db()
    recent.refresh_from_db()
    assert old.status == Message.Status.FAILED and old.error_message == OVERDUE
    assert str(old.request_id) not in inflight_entries(redis_client())
    assert recent.status == Message.Status.PENDING  # past the pending limit, but in flight


@pytest.mark.django_db
def test_stop_on_an_answer_no_worker_started_stops_it_at_once(new_answer) -> None:
    waiting, started = new_answer(), new_answer()
    _in_flight(started, worker=f"alive:{uuid.uuid4()}")
    services.chat_stop(answer=waiting)
    services.chat_stop(answer=started)
    waiting.refresh_from_db()
    started.refresh_from_db()
    assert waiting.status == Message.Status.STOPPED
    assert _events(waiting)[-1][0] == "done"
    # A started one is stopped by its worker, which reports it: only the flag is set here.
    assert started.status == Message.Status.PENDING
    assert stop_requested(redis_client(), str(started.request_id))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_killing_the_inference_worker_mid_answer_fails_the_answer_within_seconds(
    new_answer, tmp_path
) -> None:
    """A real inference worker, on a queue of its own, is killed with SIGKILL after its first
    token: the reaper ends the answer as soon as the worker's alive key expires."""
    queue = f"inference-reaper-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "INFERENCE_QUEUE": queue,
        "HEARTBEAT_KEY": f"ragblend:inference:heartbeat:{queue}",
    }
    log = open(tmp_path / "inference.log", "wb")  # noqa: SIM115
    worker = subprocess.Popen(
        [sys.executable, "-m", "kvservice.worker"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        answer = new_answer()
        request = GenerateRequest(
            str(answer.request_id),
            "Write a long story about a river.",
            [],
            message_id=answer.id,
            max_new_tokens=400,
        )
        celery_app.send_task(GENERATE_TASK, args=[request.to_dict()], queue=queue)
        wait_for(
            lambda: worker.poll() is not None or _events(answer),
            timeout=300,
            interval=0.5,
            what="the first token",
        )
        assert worker.poll() is None, (tmp_path / "inference.log").read_text()[-3000:]
        assert str(answer.request_id) in inflight_entries(redis_client())
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        killed_at = time.monotonic()

        wait_until_reaped(answer)
        print(f"answer ended {time.monotonic() - killed_at:.1f} s after the kill")
        answer.refresh_from_db()
        assert answer.status == Message.Status.FAILED and answer.error_message == WORKER_DIED
        assert answer.content  # what was streamed before the kill is kept
        assert _events(answer)[-1][0] == "error"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
        log.close()
