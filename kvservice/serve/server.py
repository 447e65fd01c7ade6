"""The inference worker's serving: one process that loads the model once and serves the
``inference`` queue and a queue of its own. It is started as ``python -m kvservice.worker``
(the composition root: it reads the configuration, makes and loads the runtime, then calls
``configure`` and ``serve`` here).

It is a Celery worker with a thread pool: each task thread hands its request to the shared
runtime and streams the result; a heartbeat thread tells /healthz and the dashboard that the
worker is alive and which model it holds, and tells the web side which chunks it holds hot
(``kvservice.protocol.routing``: questions over them are sent to this worker's own queue). No
Django here: configuration comes from the environment only (``make dev`` passes the dev stack's
addresses to the workers it starts).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import redis
from celery import Celery

from kvservice.protocol import (
    ALIVE_INTERVAL_S,
    EVICT_TASK,
    GENERATE_TASK,
    RECORD_QUEUE,
    RECORD_TASK,
    WARM_TASK,
    GenerateRequest,
    inflight_abandon,
    inflight_add,
    inflight_remove,
    mark_alive,
)
from kvservice.protocol.deadlines import celery_options, redis_from_url
from kvservice.protocol.heartbeat import HEARTBEAT_INTERVAL_S, write_heartbeat
from kvservice.protocol.routing import advertise_hot, worker_queue

if TYPE_CHECKING:
    from kvservice.config import WorkerConfig

log = logging.getLogger("kvservice.serve.server")


# This process (a restarted worker is another one): names the answers it has in flight.
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"

# Importing this module does nothing else: ``kvservice.worker.main`` reads the configuration
# and hands it and the runtime to ``configure``; the tasks below use what it set.
app = Celery("ragblend-inference")
config: WorkerConfig
runtime: Any
_redis: redis.Redis


def redis_client() -> redis.Redis:
    return _redis


def configure(cfg: WorkerConfig, engine_runtime: Any) -> None:
    """Point the Celery app and the Redis client at ``cfg``, and serve with ``engine_runtime``
    (either engine's, loaded before ``serve``)."""
    global config, runtime, _redis
    config = cfg
    _redis = redis_from_url(cfg.redis_url)
    app.conf.update(
        # deadlines on the broker, results and reports (kvservice.protocol.deadlines)
        **celery_options(),
        broker_url=cfg.redis_url,
        result_backend=cfg.redis_url,
        task_default_queue=cfg.queue,
        task_acks_late=False,  # a request is answered at most once; a lost one errors to its user
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
    )
    runtime = engine_runtime
    runtime.worker_id = WORKER_ID  # named in each answer's metrics


@app.task(name="kvservice.ping")
def ping() -> dict[str, object]:
    return {"pid": os.getpid(), "model": runtime.model_name}


@app.task(name=GENERATE_TASK)
def generate(request_data: dict) -> dict:
    """Answer one request: load its chunks' KV, blend, stream tokens, report the answer."""
    from kvservice.serve.answer import answer_request

    request = GenerateRequest.from_dict(request_data)
    inflight_add(redis_client(), WORKER_ID, request)
    reported = False
    try:
        outcome = answer_request(runtime, request, redis_client())
        # Reported while still in flight: an answer out of flight is one whose report is
        # queued, so the reaper never takes a finished answer for one nobody took. The report
        # is the outcome's one journey: the record task stores it, then ends the stream with
        # it (readers then find the answer recorded; nobody polls for the record).
        report = outcome.to_dict()
        app.send_task(
            RECORD_TASK, args=[request.message_id, report, request.request_id], queue=RECORD_QUEUE
        )
        reported = True
    finally:
        _leave_flight(redis_client(), request, reported=reported)
    _advertise_hot(redis_client())  # the chunks just loaded: routable to here at once
    return {"status": outcome.status, "request_id": request.request_id}


# In-flight entries Redis did not take when their request ended (it stopped answering): the
# request and whether its answer was reported. The heartbeat thread settles them once Redis
# answers again, so an outage never leaves an answer in flight with nobody to end it.
_unsettled: dict[str, tuple[GenerateRequest, bool]] = {}
_unsettled_lock = threading.Lock()


def _settle(client: redis.Redis, request: GenerateRequest, reported: bool) -> None:
    """A reported answer leaves flight; an unreported one is abandoned to the reaper, which
    fails it with the words its stream holds."""
    if reported:
        inflight_remove(client, request.request_id)
    else:
        inflight_abandon(client, WORKER_ID, request)


def _leave_flight(client: redis.Redis, request: GenerateRequest, *, reported: bool) -> None:
    try:
        _settle(client, request, reported)
    except redis.RedisError as err:
        log.warning(
            "request %s left in flight (%s): retried with the heartbeat", request.request_id, err
        )
        with _unsettled_lock:
            _unsettled[request.request_id] = (request, reported)


def _settle_left_in_flight(client: redis.Redis) -> None:
    """Settle what ``_leave_flight`` could not; raises ``RedisError`` while Redis is out."""
    with _unsettled_lock:
        waiting = list(_unsettled.values())
    for request, reported in waiting:
        _settle(client, request, reported)
        with _unsettled_lock:
            _unsettled.pop(request.request_id, None)


@app.task(name=EVICT_TASK)
def evict(keys: list[str]) -> int:
    """Drop these chunks from every local tier (S3 keeps the durable copy)."""
    from kvservice.protocol.keys import ChunkKey

    for key in keys:
        runtime.store.drop_local(ChunkKey.from_string(key))
    return len(keys)


@app.task(name=WARM_TASK)
def warm(keys: list[str], tier: str) -> int:
    from kvservice.protocol.keys import ChunkKey

    return sum(bool(runtime.store.warm(ChunkKey.from_string(key), tier)) for key in keys)


def _advertise_hot(client: redis.Redis) -> None:
    """Tell the web side which chunks this worker holds in memory
    (``kvservice.protocol.routing``)."""
    hot = getattr(runtime, "hot_digests", None)  # the vLLM runtime has no store of its own
    try:
        advertise_hot(client, WORKER_ID, hot() if hot else [], config.queue)
    except redis.RedisError as err:
        log.warning("hot chunks not advertised: %s", err)


def _heartbeat_forever(client: redis.Redis, stop: threading.Event, key_check: str | None) -> None:
    """Renew this worker's alive key every ``ALIVE_INTERVAL_S`` (and settle the in-flight
    entries Redis missed), and write the status heartbeat every ``HEARTBEAT_INTERVAL_S``
    (with ``key_check``, for the dashboard)."""
    last_status = 0.0
    while not stop.is_set():
        try:
            mark_alive(client, WORKER_ID)
            _settle_left_in_flight(client)
            if time.monotonic() - last_status >= HEARTBEAT_INTERVAL_S:
                status = {"key_check": key_check, **runtime.status()}
                write_heartbeat(client, config.heartbeat_key, worker=WORKER_ID, **status)
                _advertise_hot(client)
                last_status = time.monotonic()
        except redis.RedisError as err:
            log.warning("heartbeat not written: %s", err)
        stop.wait(ALIVE_INTERVAL_S)


def serve(*, key_check: str | None) -> int:
    """Serve the queues until the worker is stopped, with the heartbeat thread beside.
    ``key_check``: why this worker's chunk keys match none of the stored chunks' (a setting
    that differs from ingest's, by name), or None (``kvservice.config.check_stored_keys``),
    said in every heartbeat."""
    stop = threading.Event()
    beating = threading.Thread(
        target=_heartbeat_forever, args=(_redis, stop, key_check), daemon=True
    )
    beating.start()
    try:
        app.worker_main(
            [
                "worker",
                "-Q",
                f"{config.queue},{worker_queue(WORKER_ID, config.queue)}",
                "-P",
                "threads",
                "-c",
                str(config.task_threads),
                "--hostname",
                config.node_name,
                "--loglevel",
                "INFO",
            ]
        )
    finally:
        stop.set()
        close = getattr(runtime, "close", None)
        if close is not None:
            close()  # ENGINE=vllm: vLLM's processes end with the worker
    return 0
