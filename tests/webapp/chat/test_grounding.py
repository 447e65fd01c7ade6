"""Answers grounded or honest, without the model: the relevance threshold and the "not found"
answer, conversations carrying questions (not answers), follow-up retrieval, and which
passages an answer cites (sources, also retrieved, the highlighted sentence)."""

from __future__ import annotations

import pytest
import redis
from django.conf import settings
from django.test import TestCase

from kvservice.protocol import (
    INFERENCE_QUEUE,
    AnswerOutcome,
    Done,
    answer_stream,
    decode_events,
)
from kvservice.serve.citing import passage_uses
from tests.webapp.chat.test_chat import PASSAGES, make_document
from webapp.chat import services
from webapp.chat.models import Citation, Message
from webapp.chat.requests import conversation_history
from webapp.chat.retrieval import relevance, retrieve_chunks
from webapp.documents.embeddings import embed_texts
from webapp.redis import redis_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user(username="alice", password="alice-passphrase")


@pytest.fixture
def queue():
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(INFERENCE_QUEUE)
    yield client
    client.delete(INFERENCE_QUEUE)  # no inference worker in these tests


def _ask(user, conversation, question: str) -> Message:
    with TestCase.captureOnCommitCallbacks(execute=True):
        return services.chat_ask(user=user, conversation=conversation, question=question)


def test_retrieval_scores_each_chunk_and_drops_those_under_the_threshold(alice) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))

    def found(question: str, min_score: float):
        vector = embed_texts([question])[0]
        return retrieve_chunks(
            user=alice, question=question, query_embedding=vector, top_k=6, min_score=min_score
        )

    bar = settings.RETRIEVAL_MIN_SCORE
    everything = found("Which moon has an ocean under its ice?", 0.0)
    assert len(everything) == len(PASSAGES)
    best = everything[0]
    assert best.text == PASSAGES["space"] and best.score > bar > everything[-1].score
    assert best.score == pytest.approx(relevance(best.similarity, best.text_rank))
    assert [c.text for c in found("Which moon has an ocean under its ice?", bar)] == [
        PASSAGES["space"]
    ]
    assert found("What is the dress code at the office?", bar) == []


def test_a_question_nothing_relevant_answers_gets_not_found_without_the_model(alice, queue) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    conversation = services.conversation_create(owner=alice)
    answer = _ask(alice, conversation, "What is the dress code at the office?")
    answer.refresh_from_db()
    assert answer.status == Message.Status.DONE and answer.content == services.NOT_IN_DOCUMENTS
    assert answer.citations.count() == 0 and queue.llen(INFERENCE_QUEUE) == 0
    stream = answer_stream(str(answer.request_id))
    events = list(decode_events([(stream, redis_client().xrange(stream))]))
    end = events[-1][1]
    assert isinstance(end, Done) and end.outcome.metrics.nothing_retrieved is True


def test_a_user_without_documents_is_told_to_upload_some(django_user_model, queue) -> None:
    bob = django_user_model.objects.create_user(username="bob", password="bob-passphrase")
    answer = _ask(bob, services.conversation_create(owner=bob), "What is our leave policy?")
    answer.refresh_from_db()
    assert answer.content == services.NOTHING_FOUND and queue.llen(INFERENCE_QUEUE) == 0


def test_citations_record_their_retrieval_scores(alice, queue) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    answer = _ask(alice, services.conversation_create(owner=alice), "Which rice for a risotto?")
    citation = answer.citations.get(rank=1)
    assert citation.text == PASSAGES["cooking"]
    assert citation.score >= settings.RETRIEVAL_MIN_SCORE and citation.similarity > 0


def test_history_is_a_follow_ups_earlier_questions_and_only_helpful_answers(alice, queue) -> None:
    conversation = services.conversation_create(owner=alice)
    for question, answer, feedback in [
        ("Which moon hides an ocean?", "A1 looping", 0),
        ("And how big is it?", "A2 good", 1),
    ]:
        Message.objects.create(conversation=conversation, role="user", content=question)
        Message.objects.create(
            conversation=conversation, role="assistant", content=answer, feedback=feedback
        )

    def history(question: str) -> list[tuple[str, str]]:
        asked = Message.objects.create(conversation=conversation, role="user", content=question)
        turns = conversation_history(conversation, before=asked)
        asked.delete()
        return [(t.role, t.content) for t in turns]

    assert history("What is its crust made of?") == [
        ("user", "Which moon hides an ocean?"),
        ("user", "And how big is it?"),
        ("assistant", "A2 good"),
    ]
    assert history("Which rice goes into a risotto?") == []  # a new topic reads no history


def test_a_follow_up_is_retrieved_with_the_previous_question(alice, queue) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    conversation = services.conversation_create(owner=alice)
    first = _ask(alice, conversation, "Which moon of Jupiter hides a salty ocean?")
    services.record_outcome(
        message_id=first.id,
        outcome=AnswerOutcome.from_dict({"status": "done", "text": "Europa [1].", "metrics": {}}),
    )
    alone = _ask(alice, services.conversation_create(owner=alice), "And how big is it?")
    assert alone.citations.count() == 0  # on its own the follow-up matches nothing
    follow = _ask(alice, conversation, "And how big is it?")
    assert [c.text for c in follow.citations.all()] == [PASSAGES["space"]]


def test_recording_marks_cited_passages_and_highlights_the_cited_sentence(alice, client) -> None:
    """What the worker made of each passage (``citing.passage_uses``, in its outcome) is
    what the record keeps and the page shows."""
    conversation = services.conversation_create(owner=alice)
    answer = Message.objects.create(
        conversation=conversation, role="assistant", status="pending", mode="blend"
    )
    passage = "Intro sentence here. A risotto needs arborio rice. Stir it constantly."
    Citation.objects.create(message=answer, rank=1, document_title="Danube", text="Rivers.")
    Citation.objects.create(message=answer, rank=2, document_title="Cooking", text=passage)
    text = "Use arborio rice [2]."
    uses = passage_uses(text, ["Rivers.", passage], [7, 8], {"7": "cpu", "8": "s3"})
    outcome = AnswerOutcome.answered("done", text=text, passages=uses)
    services.record_outcome(
        message_id=answer.id, outcome=AnswerOutcome.from_dict(outcome.to_dict())
    )
    rivers, cooking = answer.citations.order_by("rank")
    assert (rivers.cited, cooking.cited) == (False, True)
    assert (rivers.tier, cooking.tier) == ("cpu", "s3")
    assert cooking.text[cooking.highlight_start : cooking.highlight_end] == (
        "A risotto needs arborio rice."
    )
    client.force_login(alice)
    page = client.get(f"/chat/{conversation.id}/").content.decode()
    sources, also = page.split("Also retrieved")
    assert "[2] Cooking" in sources and "[1] Danube" not in sources and "[1] Danube" in also
    panel = client.get(f"/chat/citations/{cooking.id}/").content.decode()
    assert '<mark class="cited-sentence">A risotto needs arborio rice.</mark>' in panel
