"""The Celery app for the web side's background work (queues ``answers``, ``ingest``, ``kv``).

Run: ``celery -A worker worker -Q answers,ingest,kv`` (``answers``: the inference worker's
reports of finished answers, ``kvservice.protocol.RECORD_QUEUE``). The inference worker is a
separate process with its own app on the ``inference`` queue (kvservice/serve/server.py), so the
model is loaded once, away from Django.
"""

from __future__ import annotations

import logging
import os
import threading

from celery import Celery
from celery.signals import celeryd_init, worker_process_init

from kvservice.protocol import environment

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
# The pool processes run at a lower priority than inference (``yield_to_inference``), so on a
# busy machine their OpenMP threads are often not scheduled; spinning threads then wait on a
# sleeping one. Waiting passively instead, measured on 2 cores with a busy-loop beside it at
# normal priority: 4 chunks' KV at nice 10 in 9.9 s instead of 23.4 s (idle: 4.9 s either
# way). Set before torch starts OpenMP; the environment can still say otherwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

app = Celery("ragblend")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.imports = ("worker.tasks", "worker.chat")


_pool_size = 1  # set in the main process before the pool forks; children inherit it
_node_name = ""  # this worker's Celery name (what a ping answers with), likewise

WARM_KEY_TTL_S = 7 * 24 * 3600  # a stale mark of a worker gone for a week is forgotten


@celeryd_init.connect
def remember_pool_size(sender: str = "", options: dict | None = None, **_kwargs) -> None:
    global _pool_size, _node_name
    _pool_size = max(1, int((options or {}).get("concurrency") or os.cpu_count() or 1))
    _node_name = sender or ""
    _mark_warm(False)  # a restarted worker is cold until a pool process has loaded again


def _mark_warm(warm: bool) -> None:
    if not _node_name:
        return
    try:
        from webapp.health import warm_key
        from webapp.redis import redis_client

        if warm:
            redis_client().set(warm_key(_node_name), "1", ex=WARM_KEY_TTL_S)
        else:
            redis_client().delete(warm_key(_node_name))
    except Exception:  # Redis down: /healthz says so through its broker check
        logging.getLogger(__name__).warning("could not record the warm-up state", exc_info=True)


def share_cores() -> int:
    """Give this pool process its share of the cores for torch (``WORKER_TORCH_THREADS``
    overrides). With every process running all-core kernels, their OpenMP threads spin
    against each other: measured on 2 cores with two pool processes of two threads each,
    20 one-passage documents were not all ready after two minutes (31 s with one thread
    each), and a 160-token chunk's KV took 12 s beside them (about 0.4 s alone)."""
    import torch

    share = max(1, (os.cpu_count() or 1) // _pool_size)
    threads = environment.read("WORKER_TORCH_THREADS") or share
    torch.set_num_threads(threads)
    return threads


def yield_to_inference() -> int:
    """Lower this pool process's CPU priority by ``WORKER_NICE`` (default 10; 0 keeps it), so
    that background ingest gives way to the inference worker, whose TTFT someone is waiting
    on, when both run on the same cores. Measured on 2 cores: a blended 3.7k-token prefill
    took 2.27 s alone, 7.01 s beside two busy KV-precompute processes at the same priority,
    and 2.69 s beside the same two at nice 10. Returns the new niceness."""
    return os.nice(environment.read("WORKER_NICE"))


# Set while no warm-up is loading models. Tasks wait for it: a task importing transformers
# while the warm-up thread does saw half-initialized modules ("cannot import name
# 'AutoTokenizer'", two of ten first uploads on a fresh stack failed so).
_warm_up_done = threading.Event()
_warm_up_done.set()


def wait_for_warm_up(timeout: float = 600.0) -> bool:
    return _warm_up_done.wait(timeout)


@worker_process_init.connect
def warm_up(**_kwargs) -> None:
    """Share the cores out and give way to inference, then load the LLM and the embedder as
    each pool process starts, in the background (the process must report ready within
    seconds), so the first document does not wait for them; /healthz reports the worker up
    once they are loaded (``warm_key``). ``WORKER_WARM_UP=0`` turns the loading off."""
    share_cores()
    yield_to_inference()
    if not environment.read("WORKER_WARM_UP"):
        _mark_warm(True)  # nothing to wait for: the first task loads the models
        return
    _warm_up_done.clear()
    threading.Thread(target=_load_models, name="warm-up", daemon=True).start()


def _load_models() -> None:
    try:
        from webapp.documents.embeddings import embedder
        from worker.kv import kv_producer

        kv_producer()
        embedder()
        _mark_warm(True)
    except Exception:  # the first task loads (and reports) it again
        logging.getLogger(__name__).exception("warm-up failed")
    finally:
        _warm_up_done.set()
