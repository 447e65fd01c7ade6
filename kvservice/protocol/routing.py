"""Cache-aware routing: a question goes to the inference worker that already holds its chunks.

Several inference workers share the durable S3 tier of the KV cache; each keeps its own hot
tiers (CPU memory, GPU memory). A question whose chunks are hot on one worker starts sooner
there than on a worker that must fetch them from S3, so:

* **Each worker advertises what it holds hot**: a Redis set ``hot_key(worker, queue)`` of
  ``chunk_digest``s (scope and token hash: no model or tokenizer needed to compute one),
  rewritten every few seconds with a TTL, so a dead worker's set goes with it.
* **Each worker consumes two queues**: the shared ``inference`` queue and its own
  ``worker_queue(worker)``.
* **The web side picks a queue per question** (``choose_queue``): among the live workers,
  the one whose hot set holds the largest share of the question's chunks, less
  ``QUEUE_WEIGHT`` per request it already has queued or in flight. When no worker holds any
  of them, the chunks' *home* (rendezvous hashing of their scope, i.e. their owner, over the
  live workers): a user's documents gather on one worker instead of on whichever was free
  (measured: two sets sent "to whoever is free" all went to one worker at first and evicted
  each other). A home with ``HOME_MAX_LOAD`` requests already waiting gives way to the
  shared queue: whichever worker is free first takes it.
* **A worker that dies leaves nothing behind**: its own queue is moved back to the shared one
  by ``requeue_orphans`` (the web side's reaper runs it), and the answers it had in flight end
  through the reaper as before (``kvservice.protocol``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvservice.protocol import (
    INFERENCE_QUEUE,
    WORKERS_KEY,
    ChunkRef,
    inflight_entries,
    worker_alive_key,
)
from kvservice.protocol.keys import token_ids_sha256

HOT_PREFIX = "ragblend:inference:hot:"
HOT_TTL_S = 15  # a worker rewrites its set every few seconds; a dead one's set expires
SERVING = "-"  # in every hot set, chunks or none: the worker serves that shared queue
# One request queued or in flight on a worker counts as much as this share of the question's
# chunks being hot there: with 6 chunks, a worker holding all of them but already busy with
# two requests is still preferred over an idle one holding two (1 - 0.5 > 1/3).
QUEUE_WEIGHT = 0.25
HOME_MAX_LOAD = 2  # a cold question's home busier than this: the shared queue instead


def chunk_digest(scope: str, tokens_sha256: str) -> str:
    """What a worker advertises for a chunk it holds: the KV's scope and its tokens' hash."""
    return f"{scope}/{tokens_sha256[:16]}"


def ref_digest(ref: ChunkRef) -> str:
    return chunk_digest(ref.kv_scope, token_ids_sha256(ref.token_ids))


def hot_key(worker_id: str, shared: str = INFERENCE_QUEUE) -> str:
    """The worker's hot set, as seen by the questions of the shared queue it serves (a worker
    of another queue is never chosen for them)."""
    return f"{HOT_PREFIX}{shared}:{worker_id}"


def worker_queue(worker_id: str, shared: str = INFERENCE_QUEUE) -> str:
    """The queue only this worker consumes (besides the shared one)."""
    return f"{shared}.{re.sub(r'[^A-Za-z0-9_.-]', '-', worker_id)}"


def queues_key(shared: str = INFERENCE_QUEUE) -> str:
    """Hash: the own queue of every worker that served ``shared`` -> that worker's id."""
    return f"ragblend:inference:queues:{shared}"


def advertise_hot(
    client: Any, worker_id: str, digests: Iterable[str], shared: str = INFERENCE_QUEUE
) -> None:
    """Replace this worker's hot set with ``digests`` (atomically: readers never see half)."""
    key = hot_key(worker_id, shared)
    staging = f"{key}:staging"
    members = [SERVING, *sorted(set(digests))]
    pipe = client.pipeline(transaction=True)
    pipe.delete(staging)
    pipe.sadd(staging, *members)
    pipe.expire(staging, HOT_TTL_S)
    pipe.rename(staging, key)
    pipe.hset(queues_key(shared), worker_queue(worker_id, shared), worker_id)
    pipe.execute()


def live_workers(client: Any) -> list[str]:
    """Every inference worker whose alive key is current, whatever queue it serves (from the
    registry ``mark_alive`` keeps: a few keys read per question, never a scan of the
    keyspace). Workers found dead leave the registry; a live one is back in 2 s."""
    members = sorted(
        m.decode() if isinstance(m, bytes) else m for m in client.smembers(WORKERS_KEY)
    )
    pipe = client.pipeline(transaction=False)
    for worker in members:
        pipe.exists(worker_alive_key(worker))
    alive = pipe.execute() if members else []
    dead = [worker for worker, up in zip(members, alive, strict=True) if not up]
    if dead:
        client.srem(WORKERS_KEY, *dead)
    return [worker for worker, up in zip(members, alive, strict=True) if up]


def serving_workers(client: Any, shared: str = INFERENCE_QUEUE) -> list[str]:
    """The live workers that serve ``shared`` (and so advertise a hot set for it)."""
    workers = live_workers(client)
    pipe = client.pipeline(transaction=False)
    for worker in workers:
        pipe.exists(hot_key(worker, shared))
    return [worker for worker, exists in zip(workers, pipe.execute(), strict=True) if exists]


@dataclass(frozen=True)
class Route:
    queue: str
    worker: str | None  # None: the shared queue
    hot_share: float  # share of the question's chunks hot on that worker
    load: int  # requests queued or in flight there when chosen


def choose_queue(client: Any, chunks: Sequence[ChunkRef], shared: str = INFERENCE_QUEUE) -> Route:
    """The queue for a question over ``chunks``; see the module doc."""
    workers = serving_workers(client, shared)
    if not chunks or not workers:
        return Route(shared, None, 0.0, 0)
    digests = [ref_digest(ref) for ref in chunks]
    in_flight: dict[str, int] = {}
    for entry in inflight_entries(client).values():
        in_flight[entry["worker"]] = in_flight.get(entry["worker"], 0) + 1
    pipe = client.pipeline(transaction=False)
    for worker in workers:
        pipe.smismember(hot_key(worker, shared), digests)
        pipe.llen(worker_queue(worker, shared))
    replies = pipe.execute()
    best: Route | None = None
    best_score = 0.0
    loads = {}
    for index, worker in enumerate(workers):
        share = sum(map(bool, replies[2 * index])) / len(digests)
        loads[worker] = load = int(replies[2 * index + 1]) + in_flight.get(worker, 0)
        score = share - QUEUE_WEIGHT * load
        if share > 0 and (best is None or score > best_score):
            best, best_score = Route(worker_queue(worker, shared), worker, share, load), score
    if best is not None and best_score > -QUEUE_WEIGHT:
        return best
    if best is None:  # nobody holds them: their home, unless it is busy
        home = home_worker(workers, digests)
        if loads[home] < HOME_MAX_LOAD:
            return Route(worker_queue(home, shared), home, 0.0, loads[home])
    return Route(shared, None, 0.0, 0)


def home_worker(workers: Sequence[str], digests: Sequence[str]) -> str:
    """Where chunks nobody holds go: each chunk's highest-weight worker by rendezvous hashing
    of its scope (of the chunk itself when unscoped, i.e. shared by everyone), the question
    going where most of its chunks do. While the workers stay the same, the same owner's
    chunks go to the same worker; when one goes, only its share moves."""
    votes: dict[str, int] = {}
    for digest in digests:
        scope = digest.split("/", 1)[0]
        anchor = scope or digest
        home = max(workers, key=lambda w: hashlib.blake2b(f"{w}|{anchor}".encode()).digest())
        votes[home] = votes.get(home, 0) + 1
    return max(sorted(votes), key=votes.__getitem__)


def every_worker_queue(client: Any, shared: str = INFERENCE_QUEUE) -> list[str]:
    """Each serving worker's own queue (what every worker must do, e.g. evict a document),
    or the shared queue when none is up."""
    return [worker_queue(w, shared) for w in serving_workers(client, shared)] or [shared]


def home_queue(client: Any, digests: Sequence[str], shared: str = INFERENCE_QUEUE) -> str:
    """The queue of the chunks' home worker (where questions over them will go), or the
    shared queue when none is up."""
    workers = serving_workers(client, shared)
    return worker_queue(home_worker(workers, digests), shared) if workers else shared


def backlog(client: Any, shared: str = INFERENCE_QUEUE) -> int:
    """Requests waiting for a worker: the shared queue and every worker's own queue."""
    names = [shared, *(worker_queue(w, shared) for w in serving_workers(client, shared))]
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.llen(name)
    return sum(int(n) for n in pipe.execute())


def requeue_orphans(client: Any, shared: str = INFERENCE_QUEUE) -> int:
    """Move the requests waiting in the queue of a worker that is gone to the shared queue,
    oldest first in line; returns how many moved. A gone worker's queue is forgotten once its
    hot set has expired too (15 s against the alive key's 6): a question routed in the instant
    the worker died is still moved by a later run."""
    live = set(live_workers(client))
    moved = 0
    for raw_queue, raw_worker in client.hgetall(queues_key(shared)).items():
        queue = raw_queue.decode() if isinstance(raw_queue, bytes) else raw_queue
        worker = raw_worker.decode() if isinstance(raw_worker, bytes) else raw_worker
        if worker in live:
            continue
        while client.lmove(queue, shared, "LEFT", "RIGHT") is not None:
            moved += 1
        if not client.exists(hot_key(worker, shared)):
            client.hdel(queues_key(shared), queue)
    return moved
