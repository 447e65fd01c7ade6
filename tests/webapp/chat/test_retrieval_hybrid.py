"""Hybrid retrieval: full text finds the passage that states a question's words verbatim when
MiniLM ranks it low, a question whose words no passage holds is "not found", and full text
reads only what the user may read. Over the Kestrel Fell documents (tests/data/kestrel, the
retrieval bench's corpus: bench/retrieval.py), parsed and chunked as on upload."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from pgvector.django import CosineDistance

from kvservice.protocol import INFERENCE_QUEUE
from tests.webapp.chat.test_chat import PASSAGES, make_document
from tests.webapp.chat.test_grounding import _ask
from webapp.chat import services
from webapp.chat.retrieval import question_clauses, ready_chunks, retrieve_chunks, term_weights
from webapp.documents import services as documents
from webapp.documents.chunking import chunk_text, llm_tokenizer
from webapp.documents.embeddings import embed_texts
from webapp.documents.models import Chunk
from webapp.documents.parsing import detect_type, parse
from webapp.documents.selectors import EVERYTHING, Scope

pytestmark = pytest.mark.django_db

KESTREL = Path(__file__).resolve().parents[2] / "data" / "kestrel"
PASSWORDS = "Passwords must be at least 14 characters long."


def kestrel_documents(owner) -> None:
    for path in sorted(KESTREL.iterdir()):
        if path.suffix == ".json":
            continue
        data = path.read_bytes()
        text = parse(data, detect_type(data, path.name)).text
        chunks = chunk_text(text, tokenizer=llm_tokenizer(), max_tokens=settings.CHUNK_TOKENS)
        make_document(owner, path.name, [chunk.text for chunk in chunks])


def _retrieve(user, question: str, *, min_score: float, top_k: int = 6, scope=EVERYTHING):
    vector = embed_texts([question])[0]
    return retrieve_chunks(
        user=user,
        question=question,
        query_embedding=vector,
        top_k=top_k,
        min_score=min_score,
        scope=scope,
    )


def test_a_verbatim_fact_ranked_low_by_vectors_is_found_by_full_text(alice) -> None:
    kestrel_documents(alice)
    question, fact = "When are the open days at the turbines?", "first Sunday of June, July"
    vector = embed_texts([question])[0]
    by_vector = list(Chunk.objects.order_by(CosineDistance("embedding", vector)))
    rank = next(at for at, chunk in enumerate(by_vector, start=1) if fact in chunk.text)
    assert rank > 6  # MiniLM alone would not give it to the model

    found = _retrieve(alice, question, min_score=settings.RETRIEVAL_MIN_SCORE)
    (chunk,) = [chunk for chunk in found if fact in chunk.text]
    assert chunk.text_rank == pytest.approx(1.0)  # "open", "days" and "turbines" are all there
    assert chunk.score >= settings.RETRIEVAL_MIN_SCORE > chunk.similarity


def test_a_question_about_something_no_document_mentions_is_not_found(alice, queue) -> None:
    kestrel_documents(alice)
    question = "Which football team does the cooperative sponsor?"
    candidates = _retrieve(alice, question, min_score=-1.0)
    assert candidates and candidates[0].similarity > 0.2  # "cooperative" is on every page
    assert _retrieve(alice, question, min_score=settings.RETRIEVAL_MIN_SCORE) == []

    answer = _ask(alice, services.conversation_create(owner=alice), question)
    answer.refresh_from_db()
    assert answer.content == services.NOT_IN_DOCUMENTS and answer.citations.count() == 0
    assert queue.llen(INFERENCE_QUEUE) == 0  # nothing sent to the model


def test_a_rare_word_weighs_more_than_a_common_one_and_a_missing_one_no_more(alice) -> None:
    notes = [
        "The cooperative runs three turbines.",
        "The cooperative pays its members.",
        f"The cooperative sponsors the fell race. {PASSWORDS}",
    ]
    make_document(alice, "notes", notes)
    (terms,) = question_clauses("How often does the cooperative change passwords for football?")
    assert set(terms) == {"cooper", "chang", "password", "footbal"}  # no "how often"
    weights = term_weights(ready_chunks(alice, EVERYTHING), terms)
    assert weights["cooper"] < weights["password"] == weights["footbal"]


def test_a_passage_answering_one_part_of_a_two_part_question_is_kept(alice) -> None:
    make_document(alice, "cooking", [PASSAGES["cooking"]])
    question = "Which moon has an ocean, and which rice goes into a risotto?"
    assert len(question_clauses(question)) == 2
    (found,) = _retrieve(alice, question, min_score=settings.RETRIEVAL_MIN_SCORE)
    # "rice" and "risotto" of its part's three words, not two of all five
    assert found.text == PASSAGES["cooking"] and found.text_rank > 0.6


def test_full_text_never_reads_another_users_document(alice, mallory) -> None:
    make_document(alice, "notes", [*PASSAGES.values(), "The cooperative sponsors a race."])
    question = "How long must passwords be at the cooperative?"

    def alices() -> dict[str, float]:
        found = _retrieve(alice, question, min_score=-1.0, top_k=50)
        assert all(chunk.document.owner_id == alice.id for chunk in found)
        return {chunk.text: chunk.text_rank for chunk in found}

    before = alices()
    assert len(before) == len(PASSAGES) + 1 and 0 < before["The cooperative sponsors a race."]
    make_document(
        mallory,
        "mallory's policy",
        [PASSWORDS, "The cooperative's policy.", "The cooperative's passwords."],
    )
    hers = _retrieve(mallory, question, min_score=settings.RETRIEVAL_MIN_SCORE)
    assert PASSWORDS in [chunk.text for chunk in hers]  # found for her
    # For alice: none of mallory's chunks, and the same scores: how rare a word is counts
    # only the chunks she may read.
    assert alices() == before


def test_another_users_nearer_chunks_do_not_crowd_out_the_users_own(alice, mallory) -> None:
    make_document(alice, "notes", [*PASSAGES.values(), "The cooperative sponsors a race."])
    question = "How long must passwords be?"  # none of its words in alice's: vectors only
    make_document(mallory, "mallory's notes", [f"{question} Note {n}." for n in range(60)])
    with connection.cursor() as cursor:
        # What the planner does once the table is large: walk the HNSW index over all users'
        # chunks (whose first 40 here are mallory's) and filter the rows it returns.
        cursor.execute("SET LOCAL enable_sort = off")
        cursor.execute(
            "EXPLAIN SELECT id FROM documents_chunk ORDER BY embedding <=> %s::vector LIMIT 5",
            [str(list(embed_texts([question])[0]))],
        )
        assert "chunk_embedding_hnsw" in " ".join(row for (row,) in cursor)
    found = _retrieve(alice, question, min_score=-1.0)  # 24 wanted: ef_search 40 < 60 + 4
    assert sorted(chunk.text for chunk in found) == sorted(
        [*PASSAGES.values(), "The cooperative sponsors a race."]
    )


def test_full_text_reads_a_shared_collection_only_while_it_is_shared(alice, bob) -> None:
    policy = make_document(alice, "it policy", [PASSWORDS])
    make_document(bob, "bob's notes", list(PASSAGES.values()))
    collection = documents.collection_create(owner=alice, name="IT")
    collection.documents.add(policy)
    scope = Scope.of([collection.pk])
    question = "How long must passwords be?"
    assert _retrieve(bob, question, min_score=-1.0, scope=scope) == []  # not shared yet

    documents.collection_share(collection=collection, usernames=["bob"])
    (found,) = _retrieve(bob, question, min_score=settings.RETRIEVAL_MIN_SCORE, scope=scope)
    assert found.text == PASSWORDS and found.text_rank == pytest.approx(1.0)
    # His own documents, searched by default, never include what alice shares.
    assert _retrieve(bob, question, min_score=settings.RETRIEVAL_MIN_SCORE) == []

    documents.collection_share(collection=collection, usernames=[])
    assert _retrieve(bob, question, min_score=-1.0, scope=scope) == []
