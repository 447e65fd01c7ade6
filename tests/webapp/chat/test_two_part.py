"""A question that asks two things ("When does the office open and who do I call for keys?")
is given the passage answering each part, each part's first; a part that no passage answers
is named with the answer (on the page and in the API), whatever the model writes.
Without the model: the passages each question is given and the request queued for the
worker (the model's answer to such a request: kvservice's prompt tests)."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import TestCase

from tests.webapp.chat.test_chat import make_document
from tests.webapp.chat.test_scope import _queued_requests
from webapp.chat import services
from webapp.chat.retrieval import question_parts, retrieve_question

pytestmark = pytest.mark.django_db

# An office handbook with many passages on when the office opens, and a few on keys: the
# whole question's search fills its places with the first part's passages.
OPENING = [
    "The office opens at 8:00 on weekdays and closes at 18:00.",
    "On public holidays the office opens at 10:00 and closes at noon.",
    "In August the office opens at 9:00 and closes at 15:00.",
    "On the first Monday of the month the office opens at 11:00, after the staff meeting.",
    "The office opens at 9:00 on Saturdays and is closed on Sundays.",
    "During the Christmas week the office opens only on the 27th and the 28th, from 10:00.",
    "The office's front door opens with a staff badge from 7:00; visitors wait until the "
    "office opens.",
]
KEYS = [
    "For keys, call the caretaker, Sam Booth, on extension 300.",
    "Spare keys to the bike shed hang in the kitchen.",
    "Keys to the meeting rooms must be returned by 18:00.",
]


def _office(owner) -> None:
    make_document(owner, "office.md", OPENING + KEYS)


def test_a_question_is_split_where_it_asks_a_second_thing() -> None:
    assert question_parts("When does the office open and who do I call for keys?") == [
        "When does the office open",
        "who do I call for keys?",
    ]
    assert question_parts("Who is the HR advisor? And when is the library open?") == [
        "Who is the HR advisor",
        "And when is the library open?",
    ]
    assert question_parts("Which boat seats twelve and sails on Thursdays?") == [
        "Which boat seats twelve and sails on Thursdays?"
    ]
    # a second yes/no question, by its verb and subject
    assert question_parts("When does the pool open on Mondays and does it have a sauna?") == [
        "When does the pool open on Mondays",
        "does it have a sauna?",
    ]
    assert question_parts("Who runs the pottery class and can I bring my own clay?") == [
        "Who runs the pottery class",
        "can I bring my own clay?",
    ]
    for one in (
        "Are cats and dogs allowed in the garden?",
        "What do the kiln and the wheel cost to rent?",
    ):
        assert question_parts(one) == [one]


def test_each_part_of_a_two_part_question_gets_its_passage_first(alice, queue) -> None:
    """Searched whole, this question was given six passages on opening hours and none on
    keys (each part scores alike, and the first part has six close passages)."""
    _office(alice)
    conversation = services.conversation_create(owner=alice)
    question = "When does the office open and who do I call for keys?"
    with TestCase.captureOnCommitCallbacks(execute=True):
        answer = services.chat_ask(user=alice, conversation=conversation, question=question)
    given = [c.text for c in answer.citations.order_by("rank")]
    assert given[0] in OPENING and given[1] == KEYS[0]  # each part's best passage, first
    assert len(given) == settings.RETRIEVAL_TOP_K and OPENING[0] in given
    (request,) = _queued_requests(queue)
    assert request["question"] == question  # every part found: asked as the user wrote it


def test_a_part_no_passage_answers_is_said_with_the_answer(alice, queue, client) -> None:
    """The model is asked the question as written (told of the missing part, the bundled
    model left out the part it could answer); the page and the API name the part nothing
    answers beside whatever the model writes."""
    from django.urls import reverse

    from kvservice.protocol import AnswerOutcome

    _office(alice)
    conversation = services.conversation_create(owner=alice)
    question = "When does the office open on weekdays, and where can I park my bike?"
    with TestCase.captureOnCommitCallbacks(execute=True):
        answer = services.chat_ask(user=alice, conversation=conversation, question=question)
    assert answer.citations.order_by("rank").first().text == OPENING[0]
    (request,) = _queued_requests(queue)
    assert request["question"] == question
    answer.refresh_from_db()
    assert answer.parts_not_found == ["where can I park my bike"]
    outcome = AnswerOutcome.answered("done", text="It opens at 8:00 [1].")
    services.record_outcome(message_id=answer.id, outcome=outcome)
    client.force_login(alice)
    html = client.get(reverse("chat:message", args=[answer.id])).content.decode()
    assert "Not found in your documents: “where can I park my bike”." in html
    assert "It opens at 8:00" in html
    detail = client.get(
        f"/api/v1/conversations/{conversation.pk}", HTTP_AUTHORIZATION=_bearer(alice)
    ).json()
    said = [m for m in detail["messages"] if m["id"] == answer.id]
    assert said[0]["parts_not_found"] == ["where can I park my bike"]


def _bearer(user) -> str:
    from tests.webapp.api.conftest import bearer

    return bearer(user)["HTTP_AUTHORIZATION"]


def test_a_question_in_one_part_is_searched_as_before(alice) -> None:
    _office(alice)
    retrieved = retrieve_question(
        user=alice,
        question="Who do I call for keys?",
        top_k=6,
        min_score=settings.RETRIEVAL_MIN_SCORE,
    )
    assert retrieved.chunks[0].text == KEYS[0]
    assert retrieved.parts_not_found == []
