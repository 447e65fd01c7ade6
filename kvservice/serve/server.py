"""The inference worker: one process that loads the model once and serves the ``inference``
queue and a queue of its own. Run: ``python -m kvservice.serve.server`` (``make dev`` starts it;
``INFERENCE_WORKERS=2 make dev`` starts two).

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
import sys
import threading
import time
from typing import Any

import redis
from celery import Celery

from kvservice.config import WorkerConfig, check_stored_keys
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

log = logging.getLogger("kvservice.serve.server")


# This process (a restarted worker is another one): names the answers it has in flight.
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"

# Importing this module does nothing else: ``main`` reads the configuration, connects and
# loads the model (``configure``); the tasks below use what it set.
app = Celery("ragblend-inference")
config: WorkerConfig
runtime: Any
_redis: redis.Redis
# Why this worker's chunk keys match none of the stored chunks' (a setting that differs from
# ingest's, by name), or None: said at start, and in every heartbeat for the dashboard.
key_check: str | None = None


def redis_client() -> redis.Redis:
    return _redis


def _make_runtime(engine: str):
    if engine == "vllm":  # every mode through vLLM; the specifics live in kvservice.vllm
        from kvservice.vllm.runtime import VllmRuntime

        return VllmRuntime()
    from kvservice.serve.runtime import NativeRuntime

    return NativeRuntime()


def configure(cfg: WorkerConfig) -> None:
    """Point the Celery app and the Redis client at ``cfg`` and make the runtime (not loaded)."""
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
    runtime = _make_runtime(cfg.engine)
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


def _heartbeat_forever(client: redis.Redis, stop: threading.Event) -> None:
    """Renew this worker's alive key every ``ALIVE_INTERVAL_S`` (and settle the in-flight
    entries Redis missed), and write the status heartbeat every ``HEARTBEAT_INTERVAL_S``."""
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


def main() -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        configure(WorkerConfig.from_env())
    except ValueError as err:
        print(f"inference worker: {err}", file=sys.stderr)
        return 2
    try:
        runtime.load(config)
    except Exception as err:
        print(f"inference worker: cannot load the model: {err}", file=sys.stderr)
        return 2
    log.info("model %s loaded", runtime.model_name)
    global key_check
    key_check = check_stored_keys(runtime, config)
    stop = threading.Event()
    threading.Thread(target=_heartbeat_forever, args=(_redis, stop), daemon=True).start()
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


if __name__ == "__main__":
    sys.exit(main())
