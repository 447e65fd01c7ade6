"""Hybrid retrieval over the ready chunks a user may read (their own, or a conversation's
scope): pgvector cosine + PostgreSQL full-text, fused by reciprocal rank, deduplicated by
content, and kept only from a relevance score on.

Reciprocal-rank fusion orders chunks but says nothing of how relevant the best one is (the
first of five unrelated chunks is still first), so each chunk also gets an absolute score:
its cosine similarity to the question plus ``FULL_TEXT_WEIGHT`` times its full-text rank
(``ts_rank`` normalized to 0..1). Measured with MiniLM on the handbook questions
(tests/data/handbook): the best chunk scored 0.34-0.67 for the 14 questions the handbook
answers and 0.10-0.23 for the 5 it does not, hence ``RETRIEVAL_MIN_SCORE`` = 0.3."""

from __future__ import annotations

import re
from collections.abc import Sequence

from django.contrib.postgres.search import SearchQuery, SearchRank
from django.db.models import F, QuerySet
from pgvector.django import CosineDistance

from webapp.documents.models import Chunk, Document
from webapp.documents.selectors import EVERYTHING, Scope, documents_searchable

RRF_K = 60  # the usual constant of reciprocal-rank fusion
FULL_TEXT_WEIGHT = 0.5  # an exact word match lifts a borderline chunk a little
_WORD = re.compile(r"\w{2,}", re.UNICODE)


def _ready_chunks(user, scope: Scope) -> QuerySet[Chunk]:
    return Chunk.objects.filter(
        document__in=documents_searchable(user=user, scope=scope),
        document__status=Document.Status.READY,
    )


def has_ready_chunks(user, scope: Scope = EVERYTHING) -> bool:
    return _ready_chunks(user, scope).exists()


def _full_text_query(question: str) -> SearchQuery | None:
    """Any of the question's words (websearch syntax: ``a or b``), ranked by ts_rank; an
    AND of every word of a natural-language question would rarely match anything."""
    words = _WORD.findall(question)
    if not words:
        return None
    return SearchQuery(" or ".join(words), search_type="websearch", config="english")


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], k: int = RRF_K) -> list[int]:
    """Ids ordered by sum over rankings of 1/(k + rank); ties keep first-seen order."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k + rank)
    return sorted(scores, key=lambda item: -scores[item])


def retrieve_chunks(
    *,
    user,
    question: str,
    query_embedding: Sequence[float],
    top_k: int,
    min_score: float = 0.0,
    scope: Scope = EVERYTHING,
) -> list[Chunk]:
    """The ``top_k`` most relevant chunks the user may read within ``scope`` (by default all
    of their own), best first, one per distinct text, whose score reaches ``min_score``. Each
    carries ``similarity`` (cosine), ``text_rank`` (normalized ``ts_rank``, 0 without a word
    in common) and ``score``."""
    candidates = max(top_k * 4, 20)
    chunks = _ready_chunks(user, scope)
    by_vector = list(
        chunks.exclude(embedding=None)
        .order_by(CosineDistance("embedding", list(query_embedding)), "id")
        .values_list("id", flat=True)[:candidates]
    )
    by_text: dict[int, float] = {}
    query = _full_text_query(question)
    if query is not None:
        by_text = dict(
            chunks.filter(search_vector=query)
            # normalization 32: rank / (rank + 1), so 0..1 whatever the chunk's length
            .annotate(rank=SearchRank(F("search_vector"), query, normalization=32))
            .order_by("-rank", "id")
            .values_list("id", "rank")[:candidates]
        )
    fused = reciprocal_rank_fusion([by_vector, list(by_text)])
    rows = (
        Chunk.objects.select_related("document")
        .annotate(distance=CosineDistance("embedding", list(query_embedding)))
        .in_bulk(fused)
    )
    selected: list[Chunk] = []
    seen: set[str] = set()
    for chunk_id in fused:
        chunk = rows[chunk_id]
        if chunk.token_ids_sha256 in seen:  # the same text in two documents: cite it once
            continue
        chunk.similarity = 0.0 if chunk.distance is None else 1.0 - float(chunk.distance)
        chunk.text_rank = float(by_text.get(chunk_id, 0.0))
        chunk.score = chunk.similarity + FULL_TEXT_WEIGHT * chunk.text_rank
        if chunk.score < min_score:
            continue
        seen.add(chunk.token_ids_sha256)
        selected.append(chunk)
        if len(selected) == top_k:
            break
    return selected
