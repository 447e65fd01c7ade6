"""Fidelity audit: a sampled blend answer is re-run in full prefill with the same question,
history and chunks, and the worker's report of that re-run is scored against it."""

from __future__ import annotations

import base64
import json

import pytest
from django.urls import reverse

from kvservice.protocol import GENERATE_TASK, INFERENCE_QUEUE, AnswerOutcome, GenerateRequest
from tests.webapp.dashboard.factories import make_document
from webapp.chat import services as chat
from webapp.chat.models import Citation, Conversation, Message
from webapp.dashboard import fidelity, services
from webapp.dashboard.models import DashboardSettings, FidelityAudit
from webapp.redis import redis_client

pytestmark = pytest.mark.django_db

BLEND_RESULT = {
    "status": "done",
    "text": "The Danube flows through Vienna and Budapest [1].",
    "metrics": {
        "mode": "blend",
        "recompute_ratio": 0.15,
        "ttft_s": 0.08,
        "total_s": 0.9,
        "chunk_tiers": {},
    },
}


def _pending_blend_answer(owner) -> Message:
    """A conversation with one finished exchange, then a question awaiting its blend answer."""
    document = make_document(owner)
    conversation = Conversation.objects.create(owner=owner, title="rivers")
    for role, text in [("user", "Hi"), ("assistant", "Hello! Ask me about rivers.")]:
        Message.objects.create(conversation=conversation, role=role, content=text)
    Message.objects.create(conversation=conversation, role="user", content="Where does it flow?")
    answer = Message.objects.create(
        conversation=conversation, role="assistant", status="pending", mode="blend"
    )
    for rank, chunk in enumerate(document.chunks.all(), start=1):
        Citation.objects.create(
            message=answer,
            rank=rank,
            chunk=chunk,
            document=document,
            document_title=document.title,
            text=chunk.text,
        )
    return answer


def _take_inference_requests() -> list[GenerateRequest]:
    client = redis_client()
    raw = client.lrange(INFERENCE_QUEUE, 0, -1)[::-1]
    client.delete(INFERENCE_QUEUE)
    requests = []
    for item in raw:
        envelope = json.loads(item)
        assert envelope["headers"]["task"] == GENERATE_TASK
        requests.append(
            GenerateRequest.from_dict(json.loads(base64.b64decode(envelope["body"]))[0][0])
        )
    return requests


def _set_rate(rate: float) -> None:
    DashboardSettings.objects.update_or_create(pk=1, defaults={"audit_sample_rate": rate})


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        ("The Danube, in Vienna.", "danube in vienna", 1.0),
        ("one two", "three four", 0.0),
        ("red blue green", "red blue", 0.8),
        ("", "", 1.0),
        ("words", "", 0.0),
    ],
)
def test_token_f1(prediction, reference, expected) -> None:
    assert fidelity.token_f1(prediction, reference) == pytest.approx(expected)


def test_a_sampled_blend_answer_is_re_run_in_full_with_the_same_context(
    alice, django_capture_on_commit_callbacks
) -> None:
    answer = _pending_blend_answer(alice)
    _set_rate(1.0)
    redis_client().delete(INFERENCE_QUEUE)
    with django_capture_on_commit_callbacks(execute=True):
        chat.record_outcome(message_id=answer.id, outcome=AnswerOutcome.from_dict(BLEND_RESULT))
        chat.record_outcome(
            message_id=answer.id, outcome=AnswerOutcome.from_dict(BLEND_RESULT)
        )  # a repeated report
    [request] = _take_inference_requests()
    assert (request.mode, request.audit_of, request.message_id) == ("full", answer.id, None)
    assert request.question == "Where does it flow?"
    # The history the original read: earlier questions, and answers only if marked helpful
    # (this one was not), as chat sends it (webapp.chat.requests.conversation_history).
    assert [(t.role, t.content) for t in request.history] == [("user", "Hi")]
    cited = [c.chunk for c in answer.citations.order_by("rank")]
    assert [(c.chunk_id, c.token_ids) for c in request.chunks] == [
        (chunk.id, chunk.token_ids) for chunk in cited
    ]
    audit = FidelityAudit.objects.get(message=answer)
    assert (audit.status, audit.blend_text, audit.blend_recompute_ratio) == (
        "pending",
        BLEND_RESULT["text"],
        0.15,
    )
    answer.refresh_from_db()
    assert answer.status == "done" and answer.content == BLEND_RESULT["text"]


def test_the_workers_report_of_the_re_run_is_scored_and_not_stored_as_an_answer(
    alice, django_capture_on_commit_callbacks
) -> None:
    answer = _pending_blend_answer(alice)
    _set_rate(1.0)
    with django_capture_on_commit_callbacks(execute=True):
        chat.record_outcome(message_id=answer.id, outcome=AnswerOutcome.from_dict(BLEND_RESULT))
    _take_inference_requests()
    messages_before = Message.objects.count()
    full = {
        "status": "done",
        "text": "The Danube flows through Vienna, Budapest and Belgrade.",
        "audit_of": answer.id,
        "metrics": {"mode": "full", "ttft_s": 0.4},
    }
    chat.record_outcome(message_id=None, outcome=AnswerOutcome.from_dict(full))
    audit = FidelityAudit.objects.get(message=answer)
    expected = fidelity.token_f1(BLEND_RESULT["text"], full["text"])
    assert 0 < expected < 1
    assert (audit.status, audit.token_f1, audit.full_ttft_s) == ("done", expected, 0.4)
    assert Message.objects.count() == messages_before
    chat.record_outcome(
        message_id=None, outcome=AnswerOutcome.from_dict({**full, "text": "other"})
    )  # repeated
    audit.refresh_from_db()
    assert audit.token_f1 == expected


def test_no_audit_at_rate_zero_nor_for_other_modes_nor_failures(
    alice, django_capture_on_commit_callbacks
) -> None:
    redis_client().delete(INFERENCE_QUEUE)
    answer = _pending_blend_answer(alice)
    with django_capture_on_commit_callbacks(execute=True):
        chat.record_outcome(
            message_id=answer.id, outcome=AnswerOutcome.from_dict(BLEND_RESULT)
        )  # default rate 0
    _set_rate(1.0)
    full_mode = _pending_blend_answer(alice)
    Message.objects.filter(pk=full_mode.pk).update(mode="full")
    failed = Message.objects.create(
        conversation=full_mode.conversation, role="assistant", status="pending", mode="blend"
    )
    with django_capture_on_commit_callbacks(execute=True):
        chat.record_outcome(
            message_id=full_mode.id,
            outcome=AnswerOutcome.from_dict({**BLEND_RESULT, "metrics": {"mode": "full"}}),
        )
        chat.record_outcome(
            message_id=failed.id, outcome=AnswerOutcome.from_dict({"status": "error", "error": "x"})
        )
    assert FidelityAudit.objects.count() == 0
    assert _take_inference_requests() == []


def test_the_sample_rate_draws(alice) -> None:
    answer = _pending_blend_answer(alice)
    _set_rate(0.3)
    outcome = AnswerOutcome.from_dict(BLEND_RESULT)
    audit = services.fidelity_maybe_audit
    assert audit(message_id=answer.id, outcome=outcome, draw=lambda: 0.31) is None
    assert audit(message_id=answer.id, outcome=outcome, draw=lambda: 0.29) is not None
    redis_client().delete(INFERENCE_QUEUE)


def test_audits_show_on_the_dashboard(staff_client, alice) -> None:
    answer = _pending_blend_answer(alice)
    FidelityAudit.objects.create(
        message=answer, blend_text="a b", full_text="a c", token_f1=0.5, status="done"
    )
    page = staff_client.get(reverse("dashboard:index")).content.decode()
    section = page.split('id="fidelity"')[1]
    assert "1 answer scored" in section and "mean token F1 0.500 (words shared" in section
    assert f"#{answer.id}" in section
