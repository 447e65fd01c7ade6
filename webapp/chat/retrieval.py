"""Hybrid retrieval over one user's own ready chunks: pgvector cosine + PostgreSQL full-text,
fused by reciprocal rank, deduplicated by content."""

from __future__ import annotations

import re
from collections.abc import Sequence

from django.contrib.postgres.search import SearchQuery, SearchRank
from django.db.models import F
from pgvector.django import CosineDistance

from webapp.documents.models import Chunk, Document

RRF_K = 60  # the usual constant of reciprocal-rank fusion
_WORD = re.compile(r"\w{2,}", re.UNICODE)


def _owned_ready_chunks(user) -> "models.QuerySet[Chunk]":  # noqa: F821
    return Chunk.objects.filter(document__owner=user, document__status=Document.Status.READY)


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
    *, user, question: str, query_embedding: Sequence[float], top_k: int
) -> list[Chunk]:
    """The ``top_k`` most relevant of the user's chunks, best first, one per distinct text."""
    candidates = max(top_k * 4, 20)
    chunks = _owned_ready_chunks(user)
    by_vector = list(
        chunks.exclude(embedding=None)
        .order_by(CosineDistance("embedding", list(query_embedding)), "id")
        .values_list("id", flat=True)[:candidates]
    )
    by_text: list[int] = []
    query = _full_text_query(question)
    if query is not None:
        by_text = list(
            chunks.filter(search_vector=query)
            .annotate(rank=SearchRank(F("search_vector"), query))
            .order_by("-rank", "id")
            .values_list("id", flat=True)[:candidates]
        )
    fused = reciprocal_rank_fusion([by_vector, by_text])
    rows = Chunk.objects.select_related("document").in_bulk(fused)
    selected: list[Chunk] = []
    seen: set[str] = set()
    for chunk_id in fused:
        chunk = rows[chunk_id]
        if chunk.token_ids_sha256 in seen:  # the same text in two documents: cite it once
            continue
        seen.add(chunk.token_ids_sha256)
        selected.append(chunk)
        if len(selected) == top_k:
            break
    return selected
