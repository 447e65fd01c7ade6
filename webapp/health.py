"""Health endpoints for people, load balancers and orchestrators.

- ``GET /healthz``: one entry per component and an overall status (200 all up, 503 otherwise).
  Ready means warm: the web process's embedding model and an ingest worker's models are
  loaded, and the inference worker holds its model.
- ``GET /livez``: 200 whenever this process serves requests (a liveness probe: restarting
  the web server cannot fix a database that is down).
- ``GET /readyz``: 200 when what the web server itself needs answers, the database, Redis and
  S3 (a readiness probe: take this replica out of the load balancer otherwise). The workers
  are not part of it: pages work without them, and questions get a clear error.

Anyone gets the statuses of ``/healthz``; only staff get the details
(endpoints, worker names and PIDs, the model, error messages, latencies).

Every "up" comes from a check still under way when the request came: a finished check's
"up" is never reused (a 5 s cache of whole results said "all up" for a valkey frozen since).
What keeps a probe storm cheap: a request joins each check already under way instead of
starting another (one Celery broadcast ping at a time per process, one thread per check on a
frozen service), and a check's failure is reused for ``HEALTH_CACHE_S``, so an outage's
probes do not each wait out a dead service's timeouts; a "down" is at most that old.

The checks run at once, each in a thread of its own, and both endpoints answer within
``HEALTH_TIMEOUT_S`` (3 s): a check with no answer by then is reported down ("no answer
within 3 s"), so a frozen valkey or S3 gateway is a 503 naming it, not a probe that hangs
(it took 40 s to minutes before; docs/reliability.md, "Frozen services")."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from django.conf import settings
from django.db import connection, connections
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from kvservice.protocol.heartbeat import read_heartbeat
from webapp import dispatch
from webapp.documents.embeddings import embedder_loaded
from webapp.redis import redis_client
from webapp.storage import object_store


def _database() -> dict[str, Any]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return {}


def _pgvector() -> dict[str, Any]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        row = cursor.fetchone()
        if row is None:
            raise RuntimeError("the vector extension is not installed in this database")
        if tuple(int(part) for part in row[0].split(".")[:2]) < (0, 8):
            # retrieval's iterative index scan (webapp/chat/retrieval.py)
            raise RuntimeError(f"pgvector {row[0]} is installed; 0.8 or later is needed")
        cursor.execute("SELECT '[1,0]'::vector <=> '[0,1]'::vector")
    return {"version": row[0]}


def _object_store() -> dict[str, Any]:
    client = object_store()
    missing = [
        bucket
        for bucket in (settings.S3_DOCUMENTS_BUCKET, settings.S3_KV_BUCKET)
        if not client.bucket_exists(bucket)
    ]
    if missing:
        raise RuntimeError(f"missing buckets: {', '.join(missing)}")
    return {"endpoint": settings.S3_ENDPOINT}


def _broker() -> dict[str, Any]:
    redis_client().ping()
    return {}


def warm_key(node_name: str) -> str:
    """Set in Redis by Celery worker ``node_name`` once a pool process of it has its models
    loaded (worker/celery.py); /healthz reports an ingest worker up only then."""
    return f"ragblend:ingest:warm:{node_name}"


def _celery_worker() -> dict[str, Any]:
    replies = dispatch.celery_app.control.ping(timeout=settings.HEALTH_PING_TIMEOUT_S)
    names = sorted(name for reply in replies for name in reply)
    # The inference workers answer pings too (inference@host, inference2@host, ...); this
    # entry is about the ingest/kv workers.
    ingest = [name for name in names if not name.startswith("inference")]
    if not ingest:
        raise RuntimeError("no ingest/kv Celery worker answered the ping")
    client = redis_client()
    warm = [name for name in ingest if client.exists(warm_key(name))]
    if not warm:  # it answers, but a document would wait for its models (worker/celery.py)
        raise RuntimeError(f"warming up: {', '.join(ingest)} still loading models")
    return {"workers": names, "warm": warm}


def _web_models() -> dict[str, Any]:
    """This web process's embedding model, which every question needs: loaded in the
    background at start (``WEB_WARM_UP``), else on the first question."""
    if embedder_loaded():
        return {"embedder": "loaded"}
    if not settings.WEB_WARM_UP:
        return {"embedder": "loads on the first question (WEB_WARM_UP=0)"}
    raise RuntimeError("warming up: the embedding model is still loading")


def _inference_worker() -> dict[str, Any]:
    beat = read_heartbeat(redis_client())
    if beat is None:
        raise RuntimeError("no heartbeat from the inference worker")
    return {"age_s": round(time.time() - beat["ts"], 1), "pid": beat.get("pid")}


def _model_loaded() -> dict[str, Any]:
    beat = read_heartbeat(redis_client()) or {}
    if not beat.get("model_loaded"):
        raise RuntimeError(beat.get("model_error") or "the inference worker has no model loaded")
    return {"model": beat.get("model")}


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    "database": _database,
    "pgvector": _pgvector,
    "object_store": _object_store,
    "broker": _broker,
    "web_models": _web_models,
    "celery_worker": _celery_worker,
    "inference_worker": _inference_worker,
    "model": _model_loaded,
}


def _run_one(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        result = {"status": "up", **check()}
    except Exception as err:  # any failure of a component is reported, never raised
        result = {"status": "down", "error": f"{type(err).__name__}: {err}"}
    finally:
        connections.close_all()  # this thread's own: a pool thread keeps none open
    result["latency_ms"] = round((time.perf_counter() - started) * 1000, 1)
    return result


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    """The checks' threads. A check past the deadline keeps its thread until its client's own
    timeout ends it (kvservice.protocol.deadlines, webapp.storage): a few seconds, so a pool of
    a few rounds' worth of threads is never all taken by a service that hangs."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=4 * len(CHECKS), thread_name_prefix="health")
        return _pool


class _Run:
    """One run of a check, shared by the requests that come while it is under way."""

    def __init__(self, check: Callable[[], dict[str, Any]]) -> None:
        self.ended_at: float | None = None
        self.future: Future = _threads().submit(self._run, check)

    def _run(self, check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        try:
            return _run_one(check)
        finally:  # before the future is done
            self.ended_at = time.monotonic()

    def answers_now(self, now: float) -> bool:
        """Under way (it ends after ``now``), or a failure under ``HEALTH_CACHE_S`` old;
        never a finished "up"."""
        if not self.future.done():
            return True
        failed = self.future.result()["status"] != "up"
        return failed and now - (self.ended_at or 0.0) < settings.HEALTH_CACHE_S


_runs: dict[str, _Run] = {}
_runs_lock = threading.Lock()


def _run_for(name: str, now: float) -> _Run:
    with _runs_lock:
        run = _runs.get(name)
        if run is None or not run.answers_now(now):
            run = _runs[name] = _Run(CHECKS[name])
        return run


def run_checks(names: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
    """The named checks (all by default), at once, within ``HEALTH_TIMEOUT_S`` in all: each
    one's run under way, its failure of the last ``HEALTH_CACHE_S``, or a new run."""
    timeout_s, now = settings.HEALTH_TIMEOUT_S, time.monotonic()
    futures = {name: _run_for(name, now).future for name in (names or CHECKS)}
    done, _late = wait(futures.values(), timeout=timeout_s)
    late = {
        "status": "down",
        "error": f"no answer within {timeout_s:g} s",
        "latency_ms": round(timeout_s * 1000, 1),
    }
    return {name: dict(f.result() if f in done else late) for name, f in futures.items()}


@never_cache
@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    components = run_checks()
    healthy = all(c["status"] == "up" for c in components.values())
    if not request.user.is_staff:
        components = {name: {"status": c["status"]} for name, c in components.items()}
    body = {"status": "ok" if healthy else "degraded", "components": components}
    return JsonResponse(body, status=200 if healthy else 503)


@never_cache
@require_GET
def livez(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


READY_CHECKS = ("database", "broker", "object_store")


@never_cache
@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    results = run_checks(READY_CHECKS)  # why one failed: /healthz (staff)
    failed = [name for name in READY_CHECKS if results[name]["status"] != "up"]
    if failed:
        return JsonResponse({"status": "unavailable", "failed": failed}, status=503)
    return JsonResponse({"status": "ok"})
