"""An answer's events, from the worker to whoever reads them: a Redis stream per request
(``answer_stream``) of ``Token`` entries (text deltas), then exactly one ``Done`` (the
outcome, ``kvservice.protocol.outcome``) or ``Error``. Before the first token, ``Queue``
entries may tell the question's place while it waits for the engine (``ahead``: questions
ahead of it; None once it starts). A stream, not pub/sub: a reader that connects late (or
reconnects) still gets every event. And the stop flag a reader sets for the worker to see
between tokens.

Each event is a typed value here, written by ``publish_event`` and read by ``decode_events``
and nowhere else. The worker writes the tokens; the end (``Done`` or ``Error``) is appended by
whoever records the outcome, once it is stored (the web side: its record task, its reaper),
so a reader that sees the end finds the answer recorded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from kvservice.protocol.outcome import AnswerOutcome

STREAM_TTL_S = 600  # a finished answer's events stay readable this long
STREAM_MAXLEN = 20_000
# Read to find the first token: the ``queue`` entries before it are one per place the
# question moved up, fewer than a worker's line is long.
FIRST_ENTRIES = 256

# Why an answer ended in error: the worker failed writing it (the engine raised, or the
# request ran past its time), or the web side ended it because no worker will finish it.
ErrorCode = Literal["generation_failed", "not_answered"]


@dataclass(frozen=True)
class TokenEvent:
    """One step of an answer as an engine streams it (before the stream's text guard)."""

    token_id: int
    text: str  # the text this token adds (may be "" while a multi-byte character is open)
    index: int
    ttft_s: float | None = None  # on the first event only
    # "stop", "length" or "stopped" on the last event (the native engine's carries no token)
    finish_reason: str | None = None


@dataclass(frozen=True)
class Token:
    """Words of the answer, as the reader shows them."""

    kind: ClassVar[str] = "token"
    text: str

    def data(self) -> dict[str, Any]:
        return {"text": self.text}


@dataclass(frozen=True)
class Queue:
    """The question's place in the engine's line: questions ahead (0: next), None once it
    starts."""

    kind: ClassVar[str] = "queue"
    ahead: int | None

    def data(self) -> dict[str, Any]:
        return {"ahead": self.ahead}


@dataclass(frozen=True)
class Done:
    """The answer ended as recorded (done or stopped): its whole outcome."""

    kind: ClassVar[str] = "done"
    outcome: AnswerOutcome

    def data(self) -> dict[str, Any]:
        return self.outcome.to_dict()


@dataclass(frozen=True)
class Error:
    """The answer failed: why (``code``), the user's words for it (``message``) and the words
    streamed before it (``text``, kept with the failed answer)."""

    kind: ClassVar[str] = "error"
    code: ErrorCode
    message: str
    text: str = ""

    def data(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "text": self.text}


StreamEvent = Token | Queue | Done | Error
End = Done | Error


def end_of(outcome: AnswerOutcome, code: ErrorCode = "generation_failed") -> End:
    """The event that ends a stream with ``outcome``: ``Error`` (with ``code``) when it failed."""
    if outcome.ok:
        return Done(outcome)
    return Error(code=code, message=outcome.error, text=outcome.text)


def outcome_of(event: End) -> AnswerOutcome:
    """How the answer ended, as a stream's last event tells it."""
    if isinstance(event, Done):
        return event.outcome
    return AnswerOutcome.failed(event.message, event.text)


def encode_event(event: StreamEvent) -> dict[str, str]:
    """A stream entry's fields: ``type`` and ``data`` (the event's JSON)."""
    return {"type": event.kind, "data": json.dumps(event.data())}


def decode_event(kind: str, data: dict[str, Any]) -> StreamEvent:
    """The event ``encode_event`` wrote; ``ValueError`` for an unknown type or a bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"a {kind!r} event's data is an object, not {type(data).__name__}")
    if kind == "token":
        return Token(text=_typed(data, "text", str, kind))
    if kind == "queue":
        ahead = data.get("ahead")
        if ahead is not None and (not isinstance(ahead, int) or isinstance(ahead, bool)):
            raise ValueError(f"a queue event's ahead is a count or null, not {ahead!r}")
        return Queue(ahead=ahead)
    if kind == "done":
        return Done(AnswerOutcome.from_dict(data))
    if kind == "error":
        code = data.get("code", "generation_failed")  # an older worker's error has none
        if code not in get_args(ErrorCode):
            raise ValueError(f"an error event's code is one of {get_args(ErrorCode)}: {code!r}")
        return Error(
            code=code, message=_typed(data, "message", str, kind), text=data.get("text") or ""
        )
    raise ValueError(f"unknown answer event type {kind!r}")


def _typed(data: dict[str, Any], name: str, kind: type, event: str) -> Any:
    value = data.get(name)
    if not isinstance(value, kind):
        raise ValueError(f"a {event} event's {name} is {kind.__name__}, not {value!r}")
    return value


def answer_stream(request_id: str) -> str:
    return f"ragblend:answer:{request_id}"


def stop_key(request_id: str) -> str:
    return f"ragblend:stop:{request_id}"


def publish_event(client: Any, request_id: str, event: StreamEvent) -> None:
    name = answer_stream(request_id)
    client.xadd(name, encode_event(event), maxlen=STREAM_MAXLEN)
    client.expire(name, STREAM_TTL_S)


def decode_events(reply: Any):
    """(entry id, event) of each entry of an ``xread`` reply (or ``[(name, xrange(...))]``)."""
    for _name, entries in reply or []:
        for entry_id, fields in entries:
            entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            kind = fields.get(b"type", fields.get("type"))
            data = fields.get(b"data", fields.get("data"))
            kind = kind.decode() if isinstance(kind, bytes) else kind
            yield entry_id, decode_event(kind, json.loads(data))


def stream_ended(client: Any, request_id: str) -> bool:
    """Whether the answer's stream already ends with ``Done`` or ``Error`` (its last entry)."""
    entries = client.xrevrange(answer_stream(request_id), count=1)
    return any(isinstance(event, End) for _, event in decode_events([(None, entries)]))


def first_token_time_s(client: Any, request_id: str) -> float | None:
    """When the answer's first token entered its stream (Unix seconds, from the entry id's
    milliseconds: the stream server's clock), or None when the stream does not begin with a
    token after its ``queue`` entries (an answer with no words, or a stream expired after
    ``STREAM_TTL_S``)."""
    entries = client.xrange(answer_stream(request_id), count=FIRST_ENTRIES)
    for entry_id, event in decode_events([(None, entries)]):
        if not isinstance(event, Queue):
            return _entry_time_s(entry_id) if isinstance(event, Token) else None
    return None


def last_token_time_s(client: Any, request_id: str) -> float | None:
    """When the answer's last token entered its stream (Unix seconds, the stream server's
    clock, as ``first_token_time_s``), or None when it holds no token among its last
    entries (only ``done`` or ``error`` follow the last token)."""
    entries = client.xrevrange(answer_stream(request_id), count=FIRST_ENTRIES)
    for entry_id, event in decode_events([(None, entries)]):
        if isinstance(event, Token):
            return _entry_time_s(entry_id)
    return None


def _entry_time_s(entry_id: str) -> float:
    return int(entry_id.split("-")[0]) / 1000


def request_stop(client: Any, request_id: str) -> None:
    client.set(stop_key(request_id), "1", ex=STREAM_TTL_S)


def stop_requested(client: Any, request_id: str) -> bool:
    return bool(client.exists(stop_key(request_id)))
