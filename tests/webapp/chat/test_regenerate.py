"""Regenerate answers the same question again in the old answer's place: one question, the
new answer where the old one was (also for an answer before the last), the old one kept out
of sight for the dashboard's measures, each answer asked again only once, and as another
attempt: sampled with a seed of its own, recorded with it."""

from __future__ import annotations

import base64
import json

import pytest
import redis
from django.conf import settings
from django.test import TestCase
from django.urls import reverse

from kvservice.protocol import INFERENCE_QUEUE, AnswerOutcome
from tests.webapp.chat.test_chat import PASSAGES, make_document
from webapp.chat import services
from webapp.chat.models import Message
from webapp.chat.requests import REGENERATE_TEMPERATURE, REGENERATE_TOP_P, conversation_history

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def no_worker():
    """Nothing takes the requests these tests queue: drop them afterwards."""
    yield
    redis.Redis.from_url(settings.REDIS_URL).delete(INFERENCE_QUEUE)


def _ask_and_answer(user, conversation, question: str) -> Message:
    with TestCase.captureOnCommitCallbacks(execute=True):
        answer = services.chat_ask(user=user, conversation=conversation, question=question)
    result = {"status": "done", "text": f"An answer to {question} [1].", "metrics": {}}
    services.record_outcome(message_id=answer.id, outcome=AnswerOutcome.from_dict(result))
    answer.refresh_from_db()
    return answer


def _shown(conversation) -> list[tuple[str, str, str]]:
    return [(m.role, m.status, m.content) for m in conversation.messages.shown()]


def _regenerate(user, answer: Message) -> Message:
    with TestCase.captureOnCommitCallbacks(execute=True):
        return services.chat_regenerate(user=user, answer=answer)


def test_regenerate_replaces_the_answer_in_place(alice) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    conversation = services.conversation_create(owner=alice)
    first = _ask_and_answer(alice, conversation, "Risotto rice?")
    second = _ask_and_answer(alice, conversation, "And the stock?")

    again = _regenerate(alice, first)  # not the last answer: it stays before the next question
    assert again.status == Message.Status.PENDING and again.citations.exists()
    assert _shown(conversation) == [
        ("user", "done", "Risotto rice?"),
        ("assistant", "pending", ""),
        ("user", "done", "And the stock?"),
        ("assistant", "done", second.content),
    ]
    first.refresh_from_db()
    assert first.replaced_by == again and first.content  # kept for the dashboard, unseen
    assert conversation.messages.filter(role="user").count() == 2  # the question is not repeated


def test_an_answer_is_asked_again_once_and_only_when_finished(alice) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    conversation = services.conversation_create(owner=alice)
    answer = _ask_and_answer(alice, conversation, "Risotto rice?")
    again = _regenerate(alice, answer)
    with pytest.raises(services.ChatError, match="asked again already"):
        _regenerate(alice, answer)  # a double click
    with pytest.raises(services.ChatError, match="Wait for this answer"):
        _regenerate(alice, again)  # still pending
    assert Message.objects.filter(conversation=conversation, role="assistant").count() == 2


def test_a_follow_up_history_leaves_out_a_replaced_answer(alice) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    conversation = services.conversation_create(owner=alice)
    answer = _ask_and_answer(alice, conversation, "Risotto rice?")
    services.chat_feedback(answer=answer, value=1)  # a helpful answer goes into the history
    again = _regenerate(alice, answer)
    services.record_outcome(
        message_id=again.id, outcome=AnswerOutcome.from_dict({"status": "done", "text": "Arborio."})
    )
    services.chat_feedback(answer=Message.objects.get(pk=again.pk), value=1)
    follow_up = Message.objects.create(conversation=conversation, role="user", content="And why?")
    history = conversation_history(conversation, before=follow_up)
    assert [(turn.role, turn.content) for turn in history] == [
        ("user", "Risotto rice?"),
        ("assistant", "Arborio."),
    ]


def test_the_page_and_the_api_show_only_the_new_answer(client, alice) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    conversation = services.conversation_create(owner=alice)
    answer = _ask_and_answer(alice, conversation, "Risotto rice?")
    client.force_login(alice)
    with TestCase.captureOnCommitCallbacks(execute=True):
        response = client.post(f"/chat/messages/{answer.id}/regenerate", HTTP_HX_REQUEST="true")
    new_id = Message.objects.get(replaces=answer).id
    assert response.status_code == 200 and f'id="message-{new_id}"' in response.content.decode()
    page = client.get(f"/chat/{conversation.id}/").content.decode()
    assert f'id="message-{new_id}"' in page and f'id="message-{answer.id}"' not in page
    from webapp.accounts.services import api_key_create

    _, key = api_key_create(user=alice, name="t")
    detail = client.get(
        f"/api/v1/conversations/{conversation.id}", HTTP_AUTHORIZATION=f"Bearer {key}"
    ).json()
    assert [m["id"] for m in detail["messages"]] == [answer.id - 1, new_id]


def test_export_and_search_leave_out_a_replaced_answer(client, alice) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    conversation = services.conversation_create(owner=alice)
    answer = _ask_and_answer(alice, conversation, "Risotto rice?")
    again = _regenerate(alice, answer)
    services.record_outcome(
        message_id=again.id, outcome=AnswerOutcome.from_dict({"status": "done", "text": "Arborio."})
    )
    client.force_login(alice)
    exported = client.get(reverse("chat:export", args=[conversation.id, "json"])).json()
    assert [m["content"] for m in exported["messages"]] == ["Risotto rice?", "Arborio."]
    markdown = client.get(reverse("chat:export", args=[conversation.id, "md"])).content.decode()
    assert "Arborio." in markdown and answer.content not in markdown
    found = client.get(reverse("chat:index"), {"q": "An answer to"}).content.decode()
    assert f'href="/chat/{conversation.id}/"' not in found  # only the replaced answer said it


def _sent_requests() -> list[dict]:
    """The generate requests queued for the inference worker, oldest first."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    messages = [json.loads(raw) for raw in client.lrange(INFERENCE_QUEUE, 0, -1)]
    return [json.loads(base64.b64decode(m["body"]))[0][0] for m in messages][::-1]


def test_an_answer_asked_again_is_sampled_with_a_seed_of_its_own(client, alice) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    conversation = services.conversation_create(owner=alice)
    first = _ask_and_answer(alice, conversation, "Risotto rice?")
    again = _regenerate(alice, first)
    services.record_outcome(
        message_id=again.id,
        outcome=AnswerOutcome.from_dict({"status": "done", "text": "Arborio, or carnaroli [1]."}),
    )
    third = _regenerate(alice, Message.objects.get(pk=again.pk))

    greedy, *sampled = _sent_requests()
    assert (greedy["temperature"], greedy["top_p"], greedy["seed"]) == (0.0, 1.0, None)
    assert first.temperature == 0 and first.seed is None
    for request, answer in zip(sampled, (again, third), strict=True):
        answer.refresh_from_db()
        assert request["temperature"] == answer.temperature == REGENERATE_TEMPERATURE
        assert request["top_p"] == REGENERATE_TOP_P and request["seed"] == answer.seed
    assert again.seed != third.seed  # each attempt its own draw
    services.record_outcome(
        message_id=third.id, outcome=AnswerOutcome.from_dict({"status": "done", "text": "Rice."})
    )
    client.force_login(alice)
    page = client.get(f"/chat/{conversation.id}/").content.decode()
    assert "another attempt" in page and "a different attempt" in page  # and the button says so


def test_a_sampled_attempt_is_not_audited_against_full_prefill(alice, monkeypatch) -> None:
    from webapp.dashboard import services as dashboard

    monkeypatch.setattr(dashboard.selectors, "audit_sample_rate", lambda: 1.0)
    make_document(alice, "notes", list(PASSAGES.values()))
    conversation = services.conversation_create(owner=alice)
    first = _ask_and_answer(alice, conversation, "Risotto rice?")
    again = _regenerate(alice, first)
    metrics = {"mode": "blend", "temperature": REGENERATE_TEMPERATURE, "seed": again.seed}
    with TestCase.captureOnCommitCallbacks(execute=True):
        services.record_outcome(
            message_id=again.id,
            outcome=AnswerOutcome.from_dict(
                {"status": "done", "text": "Arborio.", "metrics": metrics}
            ),
        )
    assert not dashboard.FidelityAudit.objects.filter(message_id=again.id).exists()
    assert dashboard.FidelityAudit.objects.filter(message_id=first.id).exists()  # greedy: audited
