"""Which answers are being written, by which worker, and whether that worker still lives.

While a worker answers a request, the request is an entry of ``INFLIGHT_KEY`` naming the
worker, and the worker keeps ``worker_alive_key(worker)`` alive (a short TTL). An entry
whose worker's key has expired belongs to a worker that died (killed, out of memory, machine
lost): the web side's reaper (webapp/chat/reaper.py) ends that answer. So does an entry its
worker abandoned (it could not finish or report the answer: Redis stopped answering under
it) and one still there ``INFLIGHT_GRACE_S`` past its request's timeout (a worker alive but
stuck)."""

from __future__ import annotations

import json
import time
from typing import Any

from kvservice.protocol.requests import GenerateRequest

INFLIGHT_KEY = "ragblend:inference:inflight"  # hash: request id -> JSON (inflight_entries)
ALIVE_INTERVAL_S = 2.0  # how often a worker renews its alive key
ALIVE_TTL_S = 6  # a worker silent this long is dead: its answers in flight are ended
# An entry still in flight this long past its request's ``timeout_s`` is ended, worker alive
# or not: the worker checks its deadline between tokens, then has this long to report.
INFLIGHT_GRACE_S = 30.0


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
    entry = {
        "worker": worker_id,
        "message_id": request.message_id,
        "audit_of": request.audit_of,
        "since": time.time(),
        "timeout_s": request.timeout_s,
        **extra,
    }
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
