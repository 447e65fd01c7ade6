"""What the web app and the inference worker say to each other, in one place.

- A request goes to the ``inference`` Celery queue as ``GenerateRequest.to_dict()``.
- The worker appends events to a Redis stream named ``answer_stream(request_id)``: ``token``
  (a text delta), then exactly one of ``done`` / ``error`` (with metrics). A stream, not
  plain pub/sub: a reader that connects late (or reconnects) still gets every event.
  ``done`` carries the answer's ``text`` as recorded: the tokens' text, except for an answer
  no passage supports, whose words are ``withheld`` and whose text is "not found"
  (``kvservice.citing.verdict``). The first token's entry id dates the first words.
- The worker then reports the complete answer with the ``RECORD_TASK`` Celery task, so the
  answer is stored even if nobody is watching the stream.
- The heartbeat (kvservice/heartbeat.py) carries the worker's live state for the dashboard:
  ``store`` (TieredStore.stats().to_dict()) and ``controller`` (LoadingController.snapshot()).
- Stop: the web app sets ``stop_key(request_id)``; the worker checks it between tokens.
- In flight: while a worker answers a request, the request is an entry of ``INFLIGHT_KEY``
  naming the worker, and the worker keeps ``worker_alive_key(worker)`` alive (a short TTL).
  An entry whose worker's key has expired belongs to a worker that died (killed, out of
  memory, machine lost): the web side's reaper (webapp/chat/reaper.py) ends that answer. So
  does an entry its worker abandoned (it could not finish or report the answer: Redis stopped
  answering under it) and one still there ``INFLIGHT_GRACE_S`` past its request's timeout
  (a worker alive but stuck).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

INFERENCE_QUEUE = "inference"
GENERATE_TASK = "kvservice.generate"
RECORD_TASK = "worker.chat.record_answer"
# Cache actions the dashboard sends to the inference worker (it owns the tiers):
EVICT_TASK = "kvservice.evict"  # args: [list of ChunkKey strings] -> dropped from every tier
WARM_TASK = "kvservice.warm"  # args: [list of ChunkKey strings, tier name] -> loaded into it
RECORD_QUEUE = "ingest"

STREAM_TTL_S = 600  # a finished answer's events stay readable this long
STREAM_MAXLEN = 20_000

INFLIGHT_KEY = "ragblend:inference:inflight"  # hash: request id -> JSON (inflight_entries)
ALIVE_INTERVAL_S = 2.0  # how often a worker renews its alive key
ALIVE_TTL_S = 6  # a worker silent this long is dead: its answers in flight are ended
# An entry still in flight this long past its request's ``timeout_s`` is ended, worker alive
# or not: the worker checks its deadline between tokens, then has this long to report.
INFLIGHT_GRACE_S = 30.0


def answer_stream(request_id: str) -> str:
    return f"ragblend:answer:{request_id}"


def stop_key(request_id: str) -> str:
    return f"ragblend:stop:{request_id}"


@dataclass(frozen=True)
class ChunkRef:
    chunk_id: int
    token_ids: list[int]
    kv_scope: str = ""  # whose KV objects to read and write (kvservice.store.keys.ChunkKey)
    # What a worker reading KV through the knowledge delivery API (KV_SOURCE=kdn) asks for:
    # the chunk's text (the API finds KV by text), and a token the web app signed for this
    # request's user, valid until the request's timeout (the worker holds no key of its own).
    # "" in both (a job queued before they existed): the chunk is recomputed, never fetched.
    text: str = ""
    kdn_token: str = ""


@dataclass(frozen=True)
class Turn:
    role: str  # "user" | "assistant"
    content: str


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    question: str
    chunks: list[ChunkRef]
    mode: str = "blend"
    history: list[Turn] = field(default_factory=list)
    message_id: int | None = None
    recompute_ratio: float | None = None  # None: the controller (or the admin's fixed value)
    # The least ratio the measured curve says reaches the operator's fidelity target: the
    # controller's floor for this request in r_min's place (loading may raise it).
    target_ratio: float | None = None
    # Progressive blend: the ratio a blend's cache is upgraded to after the first token
    # (kvservice.blend.refresh); None: the worker's BLEND_REFRESH_RATIO, 0: not upgraded.
    refresh_ratio: float | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy (a first answer); above: sampled (an answer again)
    top_p: float = 1.0
    seed: int | None = None  # the sampling's seed, recorded with the answer
    timeout_s: float = 300.0
    # Set on a fidelity-audit re-run (mode "full") of the blend answer with this message id:
    # the worker reports the result with it instead of a message of its own.
    audit_of: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerateRequest:
        """The request ``to_dict`` wrote. Fields this version does not know (a newer web app
        during a rolling upgrade) are left out, not refused."""
        known = {f.name for f in dataclasses.fields(cls)}
        data = {name: value for name, value in data.items() if name in known}
        data["chunks"] = [ChunkRef(**c) for c in data.get("chunks", [])]
        data["history"] = [Turn(**t) for t in data.get("history", [])]
        return cls(**data)


def publish_event(client: Any, request_id: str, kind: str, **payload: Any) -> None:
    name = answer_stream(request_id)
    client.xadd(name, {"type": kind, "data": json.dumps(payload)}, maxlen=STREAM_MAXLEN)
    client.expire(name, STREAM_TTL_S)


def read_events(client: Any, request_id: str, last_id: str = "0", block_ms: int = 15000):
    """Events after ``last_id`` as (id, type, payload); waits up to ``block_ms`` for the next.
    (An asyncio client: ``decode_events(await client.xread(...))`` with the same arguments.)"""
    reply = client.xread({answer_stream(request_id): last_id}, block=block_ms, count=256)
    return decode_events(reply)


def first_token_time_s(client: Any, request_id: str) -> float | None:
    """When the answer's first token entered its stream (Unix seconds, from the entry id's
    milliseconds: the stream server's clock), or None when the stream does not begin with a
    token (an answer with no words, or a stream expired after ``STREAM_TTL_S``)."""
    entries = client.xrange(answer_stream(request_id), count=1)
    for entry_id, kind, _payload in decode_events([(None, entries)]):
        return int(entry_id.split("-")[0]) / 1000 if kind == "token" else None
    return None


def decode_events(reply: Any):
    for _name, entries in reply or []:
        for entry_id, fields in entries:
            entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            kind = fields.get(b"type", fields.get("type"))
            data = fields.get(b"data", fields.get("data"))
            kind = kind.decode() if isinstance(kind, bytes) else kind
            yield entry_id, kind, json.loads(data)


def worker_alive_key(worker_id: str) -> str:
    return f"ragblend:inference:alive:{worker_id}"


WORKERS_KEY = "ragblend:inference:workers"  # set: every worker id with an alive key, or once


def mark_alive(client: Any, worker_id: str) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.set(worker_alive_key(worker_id), "1", ex=ALIVE_TTL_S)
    pipe.sadd(WORKERS_KEY, worker_id)  # so live workers are listed without scanning keys
    pipe.execute()


def worker_alive(client: Any, worker_id: str) -> bool:
    return bool(client.exists(worker_alive_key(worker_id)))


def _inflight_entry(worker_id: str, request: GenerateRequest, **extra: Any) -> str:
    entry = {"worker": worker_id, "message_id": request.message_id, "audit_of": request.audit_of,
             "since": time.time(), "timeout_s": request.timeout_s, **extra}  # fmt: skip
    return json.dumps(entry)


def inflight_add(client: Any, worker_id: str, request: GenerateRequest) -> None:
    client.hset(INFLIGHT_KEY, request.request_id, _inflight_entry(worker_id, request))


def inflight_abandon(client: Any, worker_id: str, request: GenerateRequest) -> None:
    """The worker gives ``request`` up unfinished or unreported, for the reaper to end now."""
    entry = _inflight_entry(worker_id, request, abandoned=True)
    client.hset(INFLIGHT_KEY, request.request_id, entry)


def inflight_overdue(entry: dict[str, Any], now: float) -> bool:
    """Whether an entry is past its request's timeout and the grace (False for an entry of a
    worker that did not record when it started)."""
    since = entry.get("since")
    if since is None:
        return False
    timeout_s = entry.get("timeout_s") or GenerateRequest.timeout_s
    return now > since + timeout_s + INFLIGHT_GRACE_S


def inflight_has(client: Any, request_id: str) -> bool:
    return bool(client.hexists(INFLIGHT_KEY, request_id))


def inflight_remove(client: Any, request_id: str) -> None:
    client.hdel(INFLIGHT_KEY, request_id)


def inflight_entries(client: Any) -> dict[str, dict[str, Any]]:
    """Every request in flight on any worker: request id -> {worker, message_id, audit_of,
    since, timeout_s, and abandoned where its worker gave it up}."""
    entries = {}
    for key, raw in client.hgetall(INFLIGHT_KEY).items():
        key = key.decode() if isinstance(key, bytes) else key
        entries[key] = json.loads(raw)
    return entries


def request_stop(client: Any, request_id: str) -> None:
    client.set(stop_key(request_id), "1", ex=STREAM_TTL_S)


def stop_requested(client: Any, request_id: str) -> bool:
    return bool(client.exists(stop_key(request_id)))
