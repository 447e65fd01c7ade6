"""In one conversation, each question is answered from its own retrieval: a new topic is
searched on its own (an earlier turn never takes over), a question no document answers is
"not found" however long the conversation, and a real follow-up ("And what about the
Osprey?") is still searched and asked with the turns it refers to. Without the model: the
passages each question is given (tests/data/station, the conversations of
conversations.json, each paragraph a chunk). The model's answers:
tests/e2e/test_conversation_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.webapp.chat.test_chat import make_document
from webapp.chat import services
from webapp.chat.follow_ups import is_follow_up
from webapp.chat.models import Message
from webapp.chat.requests import conversation_history
from webapp.documents.parsing import detect_type, parse

pytestmark = pytest.mark.django_db

STATION = Path(__file__).resolve().parents[2] / "data" / "station"
CONVERSATIONS = json.loads((STATION / "conversations.json").read_text())["conversations"]


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user(username="alice", password="alice-passphrase")


def station_documents(owner) -> None:
    for path in sorted(STATION.iterdir()):
        if path.suffix == ".json":
            continue
        data = path.read_bytes()
        text = parse(data, detect_type(data, path.name)).text
        paragraphs = [p.strip() for p in text.split("\n\n") if "." in p]  # no title lines
        make_document(owner, path.name, paragraphs)


def conversation_report(user) -> list[dict]:
    """Each turn of each conversation asked in order in one conversation (nothing is sent:
    no worker runs), with what it was given: the passages and the history."""
    report = []
    for spec in CONVERSATIONS:
        conversation = services.conversation_create(owner=user)
        for turn in spec["turns"]:
            answer = services.chat_ask(
                user=user, conversation=conversation, question=turn["question"]
            )
            question = conversation.messages.filter(role=Message.Role.USER).order_by("-id")[0]
            citations = list(answer.citations.order_by("rank"))
            fresh = services.chat_ask(
                user=user,
                conversation=services.conversation_create(owner=user),
                question=turn["question"],
            )
            history = conversation_history(conversation, before=question)
            report.append(
                {
                    "conversation": spec["name"],
                    "question": turn["question"],
                    "expected": turn["document"],
                    "follow_up": turn["follow_up"],
                    "cited": [c.document_title for c in citations],
                    "cited_fresh": [c.document_title for c in fresh.citations.order_by("rank")],
                    "fact_given": bool(turn["fact"])
                    and any(turn["fact"] in c.text for c in citations),
                    "history": [t.content for t in history if t.role == Message.Role.USER],
                }
            )
    return report


def summary(report: list[dict]) -> dict[str, str]:
    answerable = [r for r in report if r["expected"] and not r["follow_up"]]
    follow_ups = [r for r in report if r["follow_up"]]
    absent = [r for r in report if not r["expected"]]

    def share(rows: list[dict], test) -> str:
        return f"{sum(map(test, rows))}/{len(rows)}"

    return {
        "new topic: first passage from its document": share(
            answerable, lambda r: r["cited"][:1] == [r["expected"]]
        ),
        "new topic: only its own document's passages": share(
            answerable, lambda r: set(r["cited"]) == {r["expected"]}
        ),
        "new topic: no earlier question in the prompt": share(
            answerable, lambda r: not r["history"]
        ),
        "not found when no document answers": share(absent, lambda r: not r["cited"]),
        "the same, each in a fresh conversation": share(absent, lambda r: not r["cited_fresh"]),
        "not a follow-up: the passages of a fresh conversation": share(
            [r for r in report if not r["follow_up"]], lambda r: r["cited"] == r["cited_fresh"]
        ),
        "follow-up: given the passage that answers it": share(
            follow_ups, lambda r: r["fact_given"]
        ),
        "follow-up: first passage from its document": share(
            follow_ups, lambda r: r["cited"][:1] == [r["expected"]]
        ),
        "follow-up: the earlier question in the prompt": share(
            follow_ups, lambda r: bool(r["history"])
        ),
    }


def test_each_question_of_a_conversation_is_searched_on_its_own_first(alice) -> None:
    station_documents(alice)
    report = conversation_report(alice)
    print(json.dumps(report, indent=1, ensure_ascii=False))
    measured = summary(report)
    print(json.dumps(measured, indent=1))
    # Whether a passage is close enough is the relevance threshold's call (RETRIEVAL_MIN_SCORE),
    # the same as in a fresh conversation; the conversation never changes it.
    as_fresh = (
        "not found when no document answers",
        "the same, each in a fresh conversation",
        "new topic: only its own document's passages",
    )
    assert measured[as_fresh[0]] == measured[as_fresh[1]]
    for name, value in measured.items():
        done, total = value.split("/")
        assert name in as_fresh or done == total, (name, value)


@pytest.mark.parametrize(
    "question",
    [
        "And what about the Osprey?",
        "What about the Skua?",
        "Who built it?",
        "And in winter?",
        "What is her extension?",
        "Why?",
        "How far ahead must it be booked?",
        "On which day does it go?",
        "And the minus eighty freezers?",
        "What if mine breaks?",
    ],
)
def test_a_short_question_that_refers_back_is_a_follow_up(question) -> None:
    assert is_follow_up(question)


@pytest.mark.parametrize(
    "question",
    [
        "Who must divers log every dive with?",
        "What is the wifi password at the station?",
        "Which room holds the flow cytometer?",
        "Is there a swimming pool at the station?",
        "Which boat makes the weekly trip to the mainland?",
        "How long is parental leave?",
        "From how far away can the lamp of the Tessel lighthouse be seen, and who built it?",
    ],
)
def test_a_question_with_its_own_subject_is_not_a_follow_up(question) -> None:
    assert not is_follow_up(question)


HARWICK = STATION.parent / "follow_ups"  # bench/follow_ups.py's documents, a paragraph a chunk


def test_a_follow_up_is_given_the_passage_of_the_person_asked_about_first(alice) -> None:
    """ "And what is her e-mail?" after "Who is the safety officer?": every person's passage
    holds an e-mail, the safety officer's comes first only with the conversation."""
    text = (HARWICK / "contacts.md").read_text()
    contacts = [p.strip() for p in text.split("\n\n") if not p.startswith("#")]
    make_document(alice, "contacts.md", contacts)
    officer = next(text for text in contacts if "safety officer" in text)
    conversation = services.conversation_create(owner=alice)
    services.chat_ask(user=alice, conversation=conversation, question="Who is the safety officer?")
    answer = services.chat_ask(
        user=alice, conversation=conversation, question="And what is her e-mail?"
    )
    assert answer.citations.order_by("rank").first().text == officer
    fresh = services.chat_ask(
        user=alice,
        conversation=services.conversation_create(owner=alice),
        question="And what is her e-mail?",
    )
    assert fresh.citations.order_by("rank").first().text != officer
