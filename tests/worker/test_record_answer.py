"""The record task (the inference worker's report of an answer) on the real Celery worker:
the answer is stored, then its stream ended with the same outcome, the one journey it makes."""

from __future__ import annotations

import pytest

from kvservice.protocol import (
    AnswerMetrics,
    AnswerOutcome,
    Done,
    Error,
    Token,
    answer_stream,
    decode_events,
    publish_event,
)
from tests.conftest import wait_for, wait_until_the_workers_are_idle
from webapp.chat import services
from webapp.chat.models import Message
from webapp.redis import redis_client


def _stream(request_id: str) -> list:
    name = answer_stream(request_id)
    return [event for _id, event in decode_events([(name, redis_client().xrange(name))])]


@pytest.fixture
def pending(django_user_model):
    owner = django_user_model.objects.create_user("reporter")
    conversation = services.conversation_create(owner=owner)

    def make() -> Message:
        return Message.objects.create(
            conversation=conversation, role="assistant", status=Message.Status.PENDING
        )

    return make


@pytest.mark.django_db(transaction=True)
def test_the_report_is_stored_then_ends_the_answers_stream(celery_worker_process, pending):
    from worker.chat import record_answer

    answer = pending()
    request_id = str(answer.request_id)
    publish_event(redis_client(), request_id, Token(text="Vienna"))
    outcome = AnswerOutcome.answered(
        "done", text="Vienna", metrics=AnswerMetrics(mode="blend", ttft_s=0.2, prompt_tokens=9)
    )
    record_answer.delay(answer.id, outcome.to_dict(), request_id)
    wait_for(lambda: len(_stream(request_id)) == 2, timeout=60, what="the stream's end")
    wait_until_the_workers_are_idle(timeout=60)
    assert _stream(request_id) == [Token(text="Vienna"), Done(outcome)]
    answer.refresh_from_db()
    assert (answer.status, answer.content, answer.ttft_s) == ("done", "Vienna", 0.2)
    assert answer.prompt_tokens == 9


@pytest.mark.django_db(transaction=True)
def test_a_report_this_version_cannot_read_fails_the_answer_and_says_why(
    celery_worker_process, pending
):
    """Metrics of the wrong type (a worker of another version): the answer fails at once
    with its words kept, rather than the task retrying into nothing and the answer pending."""
    from worker.chat import MALFORMED_REPORT, record_answer

    answer = pending()
    request_id = str(answer.request_id)
    report = {"status": "done", "text": "Vienna", "metrics": {"ttft_s": "fast"}}
    record_answer.delay(answer.id, report, request_id)
    wait_for(lambda: _stream(request_id), timeout=60, what="the stream's end")
    wait_until_the_workers_are_idle(timeout=60)
    (end,) = _stream(request_id)
    assert isinstance(end, Error) and end.code == "generation_failed"
    assert end.message.startswith(MALFORMED_REPORT) and "ttft_s" in end.message
    answer.refresh_from_db()
    assert answer.status == Message.Status.FAILED and answer.content == "Vienna"
    assert answer.error_message == end.message
