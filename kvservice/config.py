"""The inference worker's configuration, read from the environment once, at its start
(``WorkerConfig.from_env``): a bad value stops the worker with a message naming the variable,
before the model loads. Nothing else in the worker reads the environment for these.

| variable | what |
|---|---|
| ``REDIS_URL`` | the broker and the answer streams (required) |
| ``MODEL_PATH`` | a model directory or ``.gguf`` file (default: the bundled SmolLM2-135M) |
| ``ENGINE`` | ``native`` (default) or ``vllm`` |
| ``ENGINE_PRECISION``, ``ENGINE_KERNEL`` | the native engine's products (kvservice.model.kernels) |
| ``ENGINE_COMPILE`` | ``on`` (default), ``off``: CUDA graphs of passes (kvservice.blend.graphs) |
| ``ENGINE_BUFFER_BYTES`` | CPU buffers kept for the next request (kvservice.model.buffers; 1 GiB) |
| ``INFERENCE_CONCURRENCY`` | answers written at once (8); as many more wait in the worker's line |
| ``INFERENCE_QUEUE``, ``INFERENCE_NODE_NAME`` | serving |
| ``ENGINE_STEP_BUDGET`` | prefill work per batch step beside the open answers (``auto``) |
| ``KV_SOURCE``, ``KDN_URL`` | chunk KV from S3 (default) or the knowledge delivery API |
| ``BLEND_REFRESH_RATIO`` | progressive blend's ratio after the first token (unset: off) |
| ``PREFIX_CACHE_BYTES`` | the prefix cache's capacity (default 1 GiB) |
| ``KV_PREAMBLE`` | chunk KV stored after the retrieval preamble (kvservice.prompt) |
| ``HEARTBEAT_KEY`` | the Redis key of the worker's heartbeat (kvservice.serve.heartbeat) |
| ``VLLM_*`` | ``ENGINE=vllm``'s settings (kvservice.vllm.engine.VllmSettings) |
| the store's | kvservice/store/config.py (``StoreConfig``) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvservice.blend.graphs import graphs_from_env
from kvservice.kdn.client import KvSource
from kvservice.model.buffers import DEFAULT_LIMIT_BYTES
from kvservice.model.bundled import default_cache_dir
from kvservice.model.kernels import DEFAULT_PRECISION, KERNELS, PRECISIONS
from kvservice.prompt import preamble_from_env
from kvservice.protocol import INFERENCE_QUEUE
from kvservice.serve.batcher import StepBudget
from kvservice.serve.engine import refresh_ratio_from_env
from kvservice.serve.heartbeat import HEARTBEAT_KEY
from kvservice.serve.prefix import DEFAULT_CAPACITY_BYTES
from kvservice.store import StoreConfig
from kvservice.store.config import parse_size

ENGINES = ("native", "vllm")


@dataclass(frozen=True)
class WorkerConfig:
    redis_url: str
    model_path: str | None
    model_cache_dir: Path
    concurrency: int  # the batch's rows: answers written at once
    queue: str  # the shared queue; this worker also serves routing.worker_queue(WORKER_ID)
    engine: str  # "native" (kvservice's engine) or "vllm" (kvservice.vllm)
    node_name: str  # Celery's name for this worker; several on one host need their own
    precision: str = DEFAULT_PRECISION  # the native engine's products (kvservice.model.kernels)
    kernel: str | None = None  # ENGINE_KERNEL: one kernel instead of the fastest measured
    graphs: bool = True  # ENGINE_COMPILE: the passes recorded as CUDA graphs on a GPU
    buffer_bytes: int = DEFAULT_LIMIT_BYTES  # ENGINE_BUFFER_BYTES: KV_BUFFERS' limit
    kv_source: KvSource = KvSource()
    refresh_ratio: float | None = None
    step_budget: StepBudget = StepBudget()  # ENGINE_STEP_BUDGET: prefill work per batch step
    prefix_cache_bytes: int = 1 << 30
    store: StoreConfig | None = None  # None: StoreConfig.from_env() where it is needed
    kv_preamble: bool = False
    heartbeat_key: str = HEARTBEAT_KEY
    vllm: Any = None  # VllmSettings with ENGINE=vllm

    @property
    def task_threads(self) -> int:
        """Celery's threads: one per row of the batch, and as many for questions waiting in
        the engine's line, which are told their place and have their KV loading meanwhile
        (beyond these, questions wait in the broker, where the web app's backlog limit
        counts them)."""
        return 2 * self.concurrency

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerConfig:
        """The configuration; a ``ValueError`` saying what to set for a bad or missing one
        (the worker then exits with status 2, as when its model cannot load)."""
        env = os.environ if environ is None else environ
        redis_url = env.get("REDIS_URL", "")
        if not redis_url:
            raise ValueError(
                "REDIS_URL is not set (make dev sets it, and the other service addresses, for "
                "the workers it starts; by hand, export what DATA_DIR/stack.json lists)."
            )
        engine = env.get("ENGINE", "native").strip().lower() or "native"
        if engine not in ENGINES:
            raise ValueError(f"ENGINE must be 'native' or 'vllm', not {engine!r}")
        if engine == "vllm" and (env.get("KV_SOURCE") or "s3").strip().lower() != "s3":
            raise ValueError(
                "KV_SOURCE=kdn works with ENGINE=native only: ENGINE=vllm's KV connector reads "
                "the store itself (unset KV_SOURCE and give the worker S3 credentials)"
            )
        precision = env.get("ENGINE_PRECISION", "").strip() or DEFAULT_PRECISION
        if precision not in PRECISIONS:
            raise ValueError(f"ENGINE_PRECISION must be one of {PRECISIONS}, not {precision!r}")
        kernel = env.get("ENGINE_KERNEL", "").strip() or None
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"ENGINE_KERNEL must be one of {KERNELS}, not {kernel!r}")
        return cls(
            redis_url=redis_url,
            model_path=env.get("MODEL_PATH") or None,
            model_cache_dir=default_cache_dir(),
            concurrency=int(env.get("INFERENCE_CONCURRENCY", "8")),
            queue=env.get("INFERENCE_QUEUE", INFERENCE_QUEUE),
            engine=engine,
            node_name=env.get("INFERENCE_NODE_NAME", "inference@%h"),
            precision=precision,
            kernel=kernel,
            graphs=graphs_from_env(env),
            buffer_bytes=_size(env, "ENGINE_BUFFER_BYTES", DEFAULT_LIMIT_BYTES),
            kv_source=KvSource.from_env(env),
            refresh_ratio=refresh_ratio_from_env(env),
            step_budget=StepBudget.from_env(env),
            prefix_cache_bytes=_size(env, "PREFIX_CACHE_BYTES", DEFAULT_CAPACITY_BYTES),
            store=StoreConfig.from_env(env),
            kv_preamble=preamble_from_env(env),
            heartbeat_key=env.get("HEARTBEAT_KEY") or HEARTBEAT_KEY,
            vllm=_vllm_settings(env) if engine == "vllm" else None,
        )


def _size(env: Mapping[str, str], name: str, default: int) -> int:
    """A size variable (``512MiB``, ``2GiB``, bytes); unset or blank: ``default``."""
    raw = env.get(name, "")
    try:
        return parse_size(raw) if raw.strip() else default
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from err


def _vllm_settings(env: Mapping[str, str]) -> Any:
    from kvservice.vllm.engine import VllmSettings  # vLLM's module only where it runs

    return VllmSettings.from_env(env)
