"""The web side of an answer's stream: the events the inference worker publishes to the
answer's Redis stream (``kvservice.protocol``), read without blocking the event loop, and
server-sent events for the browser (``webapp.chat.views``) and for programs
(``webapp.api``), and when an answer's first words reached its stream (``ttft_seen_s``)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from kvservice.protocol import answer_stream, decode_events, first_token_time_s
from webapp import outages
from webapp.redis import STREAM_BLOCK_MS, async_redis_client, redis_client

Event = tuple[str, str, dict[str, Any]]  # (stream entry id, type, payload)


class AnswerTimeout(Exception):
    """No complete answer within the deadline."""


async def stream_events(
    request_id: str, last_id: str = "0", *, timeout_s: float | None = None
) -> AsyncIterator[Event | None]:
    """Each event after ``last_id`` until ``done``/``error`` (included), and None after each
    wait of up to ``STREAM_BLOCK_MS`` that brought nothing (the caller's moment to keep its
    connection alive). With ``timeout_s``, raises ``AnswerTimeout`` once it has passed."""
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
            for entry_id, kind, payload in decode_events(reply):
                last_id = entry_id
                yield entry_id, kind, payload
                if kind in ("done", "error"):
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
    so never less than that one (the two clocks, web and stream server, may differ by a few
    milliseconds). None when unknown: no submit time, no token, or Redis not answering."""
    if asked_at is None:
        return None
    try:
        first = first_token_time_s(redis_client(), request_id)
    except outages.SERVICE_ERRORS:
        return None
    if first is None:
        return None
    return round(max(first - asked_at.timestamp(), worker_ttft_s or 0.0), 3)
