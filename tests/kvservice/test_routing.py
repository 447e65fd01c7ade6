"""Cache-aware routing against the real valkey: which queue a question goes to, given what
each live worker holds hot and how busy it is, and what happens to a dead worker's queue."""

from __future__ import annotations

import json
import uuid

import pytest
import redis

from kvservice.protocol import (
    INFLIGHT_KEY,
    WORKERS_KEY,
    ChunkRef,
    mark_alive,
    routing,
    worker_alive_key,
)


@pytest.fixture
def client(redis_service):
    connection = redis.Redis.from_url(redis_service.env["REDIS_URL"])
    yield connection
    connection.close()


@pytest.fixture
def shared() -> str:
    """A shared queue of this test's own (other tests' workers may be alive meanwhile)."""
    return f"inference-routing-{uuid.uuid4().hex[:8]}"


def _chunks(count: int, scope: str | None = None) -> list[ChunkRef]:
    """Chunks no other test's workers hold (their alive keys may not have expired yet)."""
    scope = scope or f"u{uuid.uuid4().hex[:8]}"
    return [ChunkRef(chunk_id=i, token_ids=[1000 + i, i, 7], kv_scope=scope) for i in range(count)]


def _worker(client, holds: list[ChunkRef], shared: str, *, alive: bool = True) -> str:
    worker = f"host-{uuid.uuid4().hex[:6]}:42"
    if alive:
        mark_alive(client, worker)
    routing.advertise_hot(client, worker, [routing.ref_digest(ref) for ref in holds], shared)
    return worker


def _queue(client, name: str, requests: int) -> None:
    for n in range(requests):
        client.lpush(name, json.dumps({"n": n}))


def test_a_question_goes_to_the_worker_holding_most_of_its_chunks(client, shared) -> None:
    chunks = _chunks(4)
    some = _worker(client, chunks[:2], shared)
    most = _worker(client, chunks[1:], shared)
    route = routing.choose_queue(client, chunks, shared)
    assert route.worker == most and route.queue == routing.worker_queue(most, shared)
    assert route.hot_share == 0.75
    assert routing.choose_queue(client, chunks[:1], shared).worker == some


def test_a_busy_worker_loses_to_an_idle_one_holding_less(client, shared) -> None:
    chunks = _chunks(4)
    idle = _worker(client, chunks[:2], shared)
    busy = _worker(client, chunks, shared)
    _queue(client, routing.worker_queue(busy, shared), 2)
    client.hset(INFLIGHT_KEY, f"req-{uuid.uuid4()}", json.dumps({"worker": busy}))
    # busy: 1.0 - 3 x 0.25 = 0.25 < idle: 0.5 - 0
    route = routing.choose_queue(client, chunks, shared)
    assert (route.worker, route.load) == (idle, 0)
    assert routing.backlog(client, shared) == 2  # the shared queue is empty


def test_chunks_nobody_live_holds_go_to_their_owners_home(client, shared) -> None:
    chunks = _chunks(3, scope="u7")
    other = _worker(client, _chunks(3, scope="u8"), shared)  # the same text, another owner
    _worker(client, chunks, shared, alive=False)  # holds them, but is gone
    assert routing.choose_queue(client, chunks, shared) == routing.Route(
        routing.worker_queue(other, shared), other, 0.0, 0
    )  # the only live worker is everyone's home
    assert routing.choose_queue(client, [], shared).queue == shared


def test_a_home_is_stable_per_owner_spreads_owners_and_gives_way_when_busy(client, shared) -> None:
    workers = [_worker(client, [], shared) for _ in range(3)]
    homes = {}
    for owner in range(30):
        first, second = _chunks(2, f"o{owner}"), _chunks(4, f"o{owner}")[2:]  # other chunks
        homes[owner] = routing.choose_queue(client, first, shared).worker
        assert routing.choose_queue(client, second, shared).worker == homes[owner]
    assert set(homes.values()) == set(workers)  # 30 owners over 3 workers: all get some
    busy = homes[0]
    _queue(client, routing.worker_queue(busy, shared), routing.HOME_MAX_LOAD)
    assert routing.choose_queue(client, _chunks(2, "o0"), shared).queue == shared


def test_only_a_very_busy_holder_sends_the_question_to_the_shared_queue(client, shared) -> None:
    chunks = _chunks(2)
    holder = _worker(client, chunks, shared)
    _queue(client, routing.worker_queue(holder, shared), 8)  # 1.0 - 8 x 0.25 = -1.0
    assert routing.choose_queue(client, chunks, shared).worker is None


def test_advertising_replaces_the_set_and_says_which_queue_it_serves(client, shared) -> None:
    worker = _worker(client, _chunks(3), shared)
    routing.advertise_hot(client, worker, ["u1/abc"], shared)
    assert client.smembers(routing.hot_key(worker, shared)) == {b"-", b"u1/abc"}
    assert 0 < client.ttl(routing.hot_key(worker, shared)) <= routing.HOT_TTL_S
    routing.advertise_hot(client, worker, [], shared)  # holds nothing, still serves
    assert client.smembers(routing.hot_key(worker, shared)) == {b"-"}
    assert routing.serving_workers(client, shared) == [worker]
    assert routing.serving_workers(client, f"{shared}-other") == []


def test_a_worker_of_another_shared_queue_is_never_chosen(client, shared) -> None:
    chunks = _chunks(2)
    _worker(client, chunks, f"{shared}-other")
    assert routing.choose_queue(client, chunks, shared).queue == shared


def test_a_dead_workers_queue_goes_back_to_the_shared_queue_oldest_first(client, shared) -> None:
    dead, live = _worker(client, [], shared), _worker(client, [], shared)
    dead_queue = routing.worker_queue(dead, shared)
    client.lpush(dead_queue, "first", "second", "third")  # a consumer pops from the right
    _queue(client, routing.worker_queue(live, shared), 1)
    client.delete(worker_alive_key(dead))
    assert routing.live_workers(client).count(dead) == 0
    assert routing.requeue_orphans(client, shared) == 3
    assert not client.exists(dead_queue)
    assert client.llen(routing.worker_queue(live, shared)) == 1  # a live worker's: kept
    assert [client.rpop(shared) for _ in range(3)] == [b"first", b"second", b"third"]
    # Routed in the instant it died: still moved by the next run, while its hot set lasts.
    client.lpush(dead_queue, "late")
    assert routing.requeue_orphans(client, shared) == 1 and client.rpop(shared) == b"late"
    client.delete(routing.hot_key(dead, shared))  # its hot set expired: forgotten
    routing.requeue_orphans(client, shared)
    assert dead_queue.encode() not in client.hkeys(routing.queues_key(shared))
    assert dead.encode() not in client.smembers(WORKERS_KEY)  # left the registry of workers
