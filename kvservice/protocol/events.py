"""An answer's events, from the worker to whoever reads them: a Redis stream per request
(``answer_stream``) of ``token`` entries (text deltas), then exactly one ``done`` (the
outcome, ``kvservice.protocol.outcome``) or ``error``. Before the first token, ``queue``
entries may tell the question's place while it waits for the engine (``{"ahead": n}``,
questions ahead of it; ``{"ahead": null}`` once it starts). A stream, not pub/sub: a reader that
connects late (or reconnects) still gets every event. And the stop flag a reader sets for
the worker to see between tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

STREAM_TTL_S = 600  # a finished answer's events stay readable this long
STREAM_MAXLEN = 20_000
# Read to find the first token: the ``queue`` entries before it are one per place the
# question moved up, fewer than a worker's line is long.
FIRST_ENTRIES = 256


@dataclass(frozen=True)
class TokenEvent:
    """One step of an answer as an engine streams it (before the stream's text guard)."""

    token_id: int
    text: str  # the text this token adds (may be "" while a multi-byte character is open)
    index: int
    ttft_s: float | None = None  # on the first event only
    # "stop", "length" or "stopped" on the last event (the native engine's carries no token)
    finish_reason: str | None = None


def answer_stream(request_id: str) -> str:
    return f"ragblend:answer:{request_id}"


def stop_key(request_id: str) -> str:
    return f"ragblend:stop:{request_id}"


def publish_event(client: Any, request_id: str, kind: str, **payload: Any) -> None:
    name = answer_stream(request_id)
    client.xadd(name, {"type": kind, "data": json.dumps(payload)}, maxlen=STREAM_MAXLEN)
    client.expire(name, STREAM_TTL_S)


def first_token_time_s(client: Any, request_id: str) -> float | None:
    """When the answer's first token entered its stream (Unix seconds, from the entry id's
    milliseconds: the stream server's clock), or None when the stream does not begin with a
    token after its ``queue`` entries (an answer with no words, or a stream expired after
    ``STREAM_TTL_S``)."""
    entries = client.xrange(answer_stream(request_id), count=FIRST_ENTRIES)
    for entry_id, kind, _payload in decode_events([(None, entries)]):
        if kind != "queue":
            return int(entry_id.split("-")[0]) / 1000 if kind == "token" else None
    return None


def last_token_time_s(client: Any, request_id: str) -> float | None:
    """When the answer's last token entered its stream (Unix seconds, the stream server's
    clock, as ``first_token_time_s``), or None when it holds no token among its last
    entries (only ``done`` or ``error`` follow the last token)."""
    entries = client.xrevrange(answer_stream(request_id), count=FIRST_ENTRIES)
    for entry_id, kind, _payload in decode_events([(None, entries)]):
        if kind == "token":
            return int(entry_id.split("-")[0]) / 1000
    return None


def decode_events(reply: Any):
    for _name, entries in reply or []:
        for entry_id, fields in entries:
            entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            kind = fields.get(b"type", fields.get("type"))
            data = fields.get(b"data", fields.get("data"))
            kind = kind.decode() if isinstance(kind, bytes) else kind
            yield entry_id, kind, json.loads(data)


def request_stop(client: Any, request_id: str) -> None:
    client.set(stop_key(request_id), "1", ex=STREAM_TTL_S)


def stop_requested(client: Any, request_id: str) -> bool:
    return bool(client.exists(stop_key(request_id)))
