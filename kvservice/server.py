"""The inference worker: one process that loads the model once and serves the ``inference``
queue. Run: ``python -m kvservice.server`` (``make dev`` starts it).

It is a Celery worker with a thread pool: each task thread hands its request to the shared
runtime and streams the result; a heartbeat thread tells /healthz and the dashboard that the
worker is alive and which model it holds. No Django here: configuration comes from the
environment (and, in dev, the running stack's DATA_DIR/stack.json).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import redis
from celery import Celery

from deploy.stack import apply_stack_env
from kvservice.heartbeat import HEARTBEAT_INTERVAL_S, write_heartbeat

log = logging.getLogger("kvservice.server")

apply_stack_env()


@dataclass(frozen=True)
class ServerConfig:
    redis_url: str
    model_path: str | None
    model_cache_dir: Path
    concurrency: int

    @classmethod
    def from_env(cls) -> ServerConfig:
        redis_url = os.environ.get("REDIS_URL", "")
        if not redis_url:
            raise SystemExit("REDIS_URL is not set (and DATA_DIR has no running stack).")
        cache = os.environ.get("RAGBLEND_MODEL_CACHE") or str(
            Path.home() / ".cache" / "ragblend" / "models"
        )
        return cls(
            redis_url=redis_url,
            model_path=os.environ.get("MODEL_PATH") or None,
            model_cache_dir=Path(cache),
            concurrency=int(os.environ.get("INFERENCE_CONCURRENCY", "8")),
        )


config = ServerConfig.from_env()
app = Celery("ragblend-inference", broker=config.redis_url, backend=config.redis_url)
app.conf.update(
    task_default_queue="inference",
    task_acks_late=False,  # a request is answered at most once; a lost one errors to its user
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


class Runtime:
    """What the worker holds for its lifetime: the loaded model and its name."""

    def __init__(self) -> None:
        self.model_name: str | None = None
        self.model = None
        self.tokenizer = None

    def load(self, cfg: ServerConfig) -> None:
        from transformers import AutoTokenizer

        from kvservice.bundled import resolve_llm_path
        from kvservice.model import Transformer

        path = resolve_llm_path(cfg.model_path, cfg.model_cache_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = Transformer.from_pretrained(path)
        self.model_name = path.name


runtime = Runtime()


@app.task(name="kvservice.ping")
def ping() -> dict[str, object]:
    return {"pid": os.getpid(), "model": runtime.model_name}


def _heartbeat_forever(client: redis.Redis, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            write_heartbeat(
                client, pid=os.getpid(), model=runtime.model_name, model_loaded=runtime.model is not None
            )
        except redis.RedisError as err:
            log.warning("heartbeat not written: %s", err)
        stop.wait(HEARTBEAT_INTERVAL_S)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        runtime.load(config)
    except Exception as err:
        print(f"inference worker: cannot load the model: {err}", file=sys.stderr)
        return 2
    log.info("model %s loaded", runtime.model_name)
    stop = threading.Event()
    client = redis.Redis.from_url(config.redis_url, socket_timeout=5)
    threading.Thread(target=_heartbeat_forever, args=(client, stop), daemon=True).start()
    try:
        app.worker_main(
            ["worker", "-Q", "inference", "-P", "threads", "-c", str(config.concurrency),
             "--hostname", "inference@%h", "--loglevel", "INFO"]
        )  # fmt: skip
    finally:
        stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
