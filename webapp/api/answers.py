"""Waiting for an answer: the inference worker's token stream in Redis, read with a deadline.

Programs get the answer either event by event (``answer_events``, an async iterator, so that a
streamed response under ASGI sends each token as it comes) or whole (``wait_for_answer``).
Nothing waits forever: past ``API_ANSWER_TIMEOUT_S`` the caller gets a timeout."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from asgiref.sync import async_to_sync
from django.conf import settings

from kvservice.protocol import AnswerMetrics, AnswerOutcome, End, StreamEvent, outcome_of
from webapp.answer_stream import AnswerTimeout, stream_events, ttft_seen_s
from webapp.chat.models import Message

# Ratios are reported to 3 decimals: 0.20041213932375773 says no more than 0.2.
RATIO_DECIMALS = 3


async def answer_events(
    request_id: str, *, timeout_s: float | None = None
) -> AsyncIterator[StreamEvent]:
    """Each event until the end (``Done`` or ``Error``, included: the answer is recorded by
    then); raises ``AnswerTimeout`` when the end has not come within ``timeout_s`` (default
    ``API_ANSWER_TIMEOUT_S``)."""
    timeout_s = settings.API_ANSWER_TIMEOUT_S if timeout_s is None else timeout_s
    async for event in stream_events(request_id, timeout_s=timeout_s):
        if event is not None:
            yield event[1]


async def _wait(request_id: str, timeout_s: float | None) -> AnswerOutcome:
    async for event in answer_events(request_id, timeout_s=timeout_s):
        if isinstance(event, End):
            return outcome_of(event)
    raise AnswerTimeout("The answer stream ended without a result.")  # pragma: no cover


def wait_for_answer(answer: Message, *, timeout_s: float | None = None) -> AnswerOutcome:
    """The whole answer (a sync view's wait; it blocks only its own thread)."""
    return async_to_sync(_wait)(str(answer.request_id), timeout_s)


def tier_counts(metrics: AnswerMetrics) -> dict[str, int]:
    """{"cpu": 4, "s3": 2}: how many cited chunks each tier served."""
    return dict(Counter(str(tier) for tier in metrics.chunk_tiers.values()))


def retrieval_of(answer: Message) -> list[dict[str, Any]]:
    """Every passage given to the model for ``answer``, with retrieval's scores."""
    return [
        {
            "rank": c.rank,
            "chunk_id": c.chunk_id,
            "score": c.score,
            "similarity": c.similarity,
            "text_rank": c.text_rank,
        }
        for c in answer.citations.all()
    ]


def rounded_ratio(ratio: float | None) -> float | None:
    return None if ratio is None else round(ratio, RATIO_DECIMALS)


def metrics_of(answer: Message, metrics: AnswerMetrics) -> dict[str, Any]:
    """The API's metrics object, from the worker's outcome: its time to first token beside
    the user's (``ttft_seen_s``), as the chat records them."""
    ttft_seen = ttft_seen_s(
        asked_at=answer.asked_at,
        request_id=str(answer.request_id),
        worker_ttft_s=metrics.ttft_s,
    )
    return {
        "ttft_s": metrics.ttft_s,
        "ttft_seen_s": ttft_seen,
        "total_s": metrics.total_s,
        "mode": metrics.mode or answer.mode,
        "recompute_ratio": rounded_ratio(metrics.recompute_ratio),
        "from_prefix_cache": metrics.prefix_cache,
        "tiers": tier_counts(metrics),
        "prompt_tokens": metrics.prompt_tokens,
        "completion_tokens": metrics.completion_tokens,
        "retrieval": retrieval_of(answer),
        "not_found": metrics.nothing_retrieved,
        "citation": metrics.citation,
    }


def citations_of(answer: Message, outcome: AnswerOutcome | None = None) -> list[dict[str, Any]]:
    """Every passage given to the model: which ones the answer cites and the sentence of
    each that supports it, from the worker's ``outcome`` (else as recorded with the answer)."""
    citations = list(answer.citations.all())
    if outcome is None:
        cited = {c.rank for c in citations if c.cited}
        spans = {
            c.rank: (c.highlight_start, c.highlight_end)
            for c in citations
            if c.highlight_start is not None
        }
    else:
        cited = {use.rank for use in outcome.passages if use.cited}
        spans = {use.rank: use.highlight for use in outcome.passages if use.highlight}
    out = []
    for c in citations:
        span = spans.get(c.rank)
        out.append(
            {
                "rank": c.rank,
                "document_id": c.document_id,
                "chunk_id": c.chunk_id,
                "document_title": c.document_title,
                "text": c.text,
                "cited": c.rank in cited,
                "score": c.score,
                "highlight": c.text[span[0] : span[1]] if span else None,
            }
        )
    return out


def sources_of(
    answer: Message, outcome: AnswerOutcome | None = None
) -> dict[str, list[dict[str, Any]]]:
    """``citations`` (the passages the answer cites) and ``also_retrieved`` (the rest)."""
    every = citations_of(answer, outcome)
    return {
        "citations": [c for c in every if c["cited"]],
        "also_retrieved": [c for c in every if not c["cited"]],
    }
