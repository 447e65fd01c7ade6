"""The web side of an answer's stream: the events the inference worker publishes to the
answer's Redis stream (``kvservice.protocol``), read without blocking the event loop, and
server-sent events for the browser (``webapp.chat.views``) and for programs
(``webapp.api``), and when an answer's first and last words reached its stream
(``ttft_seen_s``, ``total_seen_s``)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Any

from kvservice.protocol import (
    End,
    StreamEvent,
    answer_stream,
    decode_events,
    first_token_time_s,
    last_token_time_s,
)
from webapp import outages
from webapp.redis import STREAM_BLOCK_MS, async_redis_client, redis_client


class AnswerTimeout(Exception):
    """No complete answer within the deadline."""


async def stream_events(
    request_id: str, last_id: str = "0", *, timeout_s: float | None = None
) -> AsyncIterator[tuple[str, StreamEvent] | None]:
    """(stream entry id, event) of each event after ``last_id`` until the end (``Done`` or
    ``Error``, included: appended once the answer is recorded, so the caller may read the
    record at once), and None after each wait of up to ``STREAM_BLOCK_MS`` that brought
    nothing (the caller's moment to keep its connection alive). With ``timeout_s``, raises
    ``AnswerTimeout`` once it has passed."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    client = async_redis_client()
    try:
        while True:
            block_ms = STREAM_BLOCK_MS
            if deadline is not None:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0:
                    raise AnswerTimeout(f"The model did not answer within {timeout_s:g} s.")
                block_ms = max(1, min(remaining_ms, STREAM_BLOCK_MS))
            reply = await client.xread(
                {answer_stream(request_id): last_id}, block=block_ms, count=256
            )
            if not reply:
                yield None
                continue
            for entry_id, event in decode_events(reply):
                last_id = entry_id
                yield entry_id, event
                if isinstance(event, End):
                    return
    finally:
        await client.aclose()


def sse(event: str | None, data: Any, event_id: str = "") -> str:
    """One server-sent event: ``data`` as text, or as JSON when it is not text; each line of
    it a ``data:`` line (JSON has none)."""
    body = data if isinstance(data, str) else json.dumps(data)
    head = (f"id: {event_id}\n" if event_id else "") + (f"event: {event}\n" if event else "")
    return head + "".join(f"data: {line}\n" for line in body.split("\n")) + "\n"


def ttft_seen_s(
    *, asked_at: datetime | None, request_id: str, worker_ttft_s: float | None
) -> float | None:
    """Seconds from the question's submit (``asked_at``) to the answer's first token on its
    stream, where the web server sends it on: the first words as the user sees them, with
    retrieval, the queue and the worker's own time to first token (``worker_ttft_s``) in it,
    so never less than that one, nor otherwise more than the time passed since the submit
    (the two clocks, web and stream server, may differ). None when unknown: no submit time,
    no token, or Redis not answering."""
    return _seen_since(asked_at, request_id, first_token_time_s, floor=worker_ttft_s or 0.0)


def total_seen_s(
    *, asked_at: datetime | None, request_id: str, ttft_seen: float | None
) -> float | None:
    """Seconds from the question's submit (``asked_at``) to the answer's last words on its
    stream: the whole wait as the user saw it, on the clocks ``ttft_seen_s`` reads, never
    less than the first words' ``ttft_seen``, nor otherwise more than the time passed since
    the submit on this server's clock (it is read once the answer has ended). None when
    unknown.

    It was the first words as seen plus the worker's time from its first token to its last:
    the worker holds back an answer's last words while it writes them (``AnswerText``), so
    its first token comes before the first words on the stream, and the time between the two
    was counted twice (3.9 s shown 3.85 s after Enter with the bundled model, 26.8 s shown at
    17.5 s with a slower one)."""
    if ttft_seen is None:
        return None
    return _seen_since(asked_at, request_id, last_token_time_s, floor=ttft_seen)


def _seen_since(
    asked_at: datetime | None, request_id: str, token_time: Callable, *, floor: float
) -> float | None:
    """Seconds from ``asked_at`` to the stream's time of a token (``token_time(client,
    request_id)``: the first's or the last's), at most the time passed since ``asked_at``
    (to the millisecond below) and at least ``floor``; None when unknown."""
    if asked_at is None:
        return None
    try:
        at = token_time(redis_client(), request_id)
    except outages.SERVICE_ERRORS:
        return None
    if at is None:
        return None
    asked = asked_at.timestamp()
    passed = min(at - asked, time.time() - asked)
    return max(math.floor(passed * 1000) / 1000, floor)
