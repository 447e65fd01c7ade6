"""One conversation as a user has it, end to end through the real ingest worker, retrieval,
the inference worker and the bundled SmolLM2, over a research station's five documents
(tests/data/station): a question on another document is answered from that document, a
question no document answers is "not found" after several turns, and a real follow-up ("And
what about the Osprey?") still gets the question it follows. Prints each answer, and the
shares over the conversations of tests/data/station/conversations.json. Regenerate gives
another attempt, recorded as such."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from django.test import TestCase

from kvservice.serve.citing import cited_ranks, says_not_found
from tests.e2e.test_chat_e2e import collect_stream, upload_ready, wait_recorded
from tests.e2e.test_handbook import ask
from webapp.chat import services as chat
from webapp.chat.models import Message
from webapp.chat.requests import REGENERATE_TEMPERATURE, conversation_history

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

STATION = Path(__file__).resolve().parents[1] / "data" / "station"
CONVERSATIONS = json.loads((STATION / "conversations.json").read_text())["conversations"]


def turn_report(answer: Message, text: str, turn: dict) -> dict:
    citations = list(answer.citations.order_by("rank"))
    cited = [citations[rank - 1] for rank in cited_ranks(text, len(citations))]
    fact = turn["fact"]
    question = answer.conversation.messages.filter(role="user", id__lt=answer.id).last()
    return {
        "question": turn["question"],
        "expected": turn["document"],
        "answer": text,
        "follow_up": turn["follow_up"],
        "given": [c.document_title for c in citations],
        "cited": [c.document_title for c in cited],
        "on_topic": fact is not None
        and (fact.lower() in text.lower() or any(fact in c.text for c in cited)),
        "not_found": says_not_found(text),
        "cut": answer.was_cut,
        "history": [t.content for t in conversation_history(answer.conversation, before=question)],
    }


def upload_station(django_user_model):
    user = django_user_model.objects.create_user(username="visitor", password="visitor-pass")
    for path in sorted(STATION.iterdir()):
        if path.suffix != ".json":
            upload_ready(user, path.read_text(), path.name)
    return user


def test_one_conversation_answers_each_question_asked(
    celery_worker_process, inference_worker_process, django_user_model
) -> None:
    user = upload_station(django_user_model)
    report = []
    for spec in CONVERSATIONS:
        conversation = chat.conversation_create(owner=user)
        for turn in spec["turns"]:
            answer, text = ask(user, conversation, turn["question"])
            report.append(turn_report(answer, text, turn) | {"conversation": spec["name"]})
    print(json.dumps(report, indent=1, ensure_ascii=False))
    answerable = [r for r in report if r["expected"]]
    shares = {
        "answered from its document": [r["on_topic"] for r in answerable if not r["follow_up"]],
        "follow-ups answered": [r["on_topic"] for r in answerable if r["follow_up"]],
        "not found": [r["not_found"] for r in report if not r["expected"]],
        "answerable said not found": [r["not_found"] for r in answerable],
        "cut at the token cap": [r["cut"] for r in report],
    }
    print(json.dumps({name: f"{sum(v)}/{len(v)}" for name, v in shares.items()}))

    by_question = {(r["conversation"], r["question"]): r for r in report}
    # A question on a second document, asked after one on the boats, is answered from it.
    divers = by_question[("topic switches", "Who must divers log every dive with?")]
    assert divers["given"] == ["safety_contacts.txt"] and divers["history"] == []
    assert divers["on_topic"], divers
    # No answer is left cut inside a word: a cut one ends at a sentence or with "…".
    for r in report:
        text = re.sub(r"(\s*\[\d+\])+\s*$", "", r["answer"])  # the citation markers after it
        assert not r["cut"] or text.endswith((".", "!", "?", "…")), r
    # A question no document answers, after ten turns on others, is "not found".
    cup = by_question[("not found mid-conversation", "Who won the football world cup in 1998?")]
    assert cup["answer"] == chat.NOT_IN_DOCUMENTS, cup
    # A real follow-up is searched and asked with the question it follows.
    osprey = by_question[("real follow-ups", "And what about the Osprey?")]
    assert osprey["history"] == ["How many people does the Gannet seat?"], osprey
    assert osprey["given"][:1] == ["boats.md"] and not osprey["not_found"], osprey


def regenerate(user, answer: Message) -> tuple[Message, str]:
    with TestCase.captureOnCommitCallbacks(execute=True):
        again = chat.chat_regenerate(user=user, answer=answer)
    _tokens, kind, payload = collect_stream(str(again.request_id))
    assert kind == "done", payload
    wait_recorded(again)
    again.refresh_from_db()
    return again, payload["text"]


def test_regenerate_gives_another_attempt_recorded_as_such(
    celery_worker_process, inference_worker_process, django_user_model
) -> None:
    user = upload_station(django_user_model)
    conversation = chat.conversation_create(owner=user)
    answer, first = ask(user, conversation, "What must divers do before they enter the water?")
    assert answer.temperature == 0 and answer.seed is None  # a first answer is greedy
    attempts = [first]
    for _ in range(3):
        answer, text = regenerate(user, answer)
        assert answer.temperature == REGENERATE_TEMPERATURE and answer.seed is not None
        assert answer.content == text and answer.citations.exists()
        attempts.append(text)
    print(json.dumps(attempts, indent=1, ensure_ascii=False))
    assert len(set(attempts)) > 1, attempts  # sampled: not the same text every time
    shown = conversation.messages.shown().filter(role="assistant")
    assert list(shown) == [answer]  # each attempt took the last one's place
