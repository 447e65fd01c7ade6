"""The inference worker's configuration, read from the environment once, at its start
(``WorkerConfig.from_env``): a bad value stops the worker with a message naming the variable,
before the model loads. Nothing else in the worker reads the environment for these.

Its variables (``REDIS_URL``, ``MODEL_PATH``, ``ENGINE``, ``ENGINE_*``, ``INFERENCE_*``,
``KV_SOURCE``, ``KV_PREAMBLE``, ``HEARTBEAT_KEY``, the store's and ``VLLM_*``) are declared in
``kvservice.protocol.environment`` with their types, defaults and docs, where the web app reads
the ones it shares with the worker (docs/configuration.md lists them all).

At start the worker also compares its chunk keys with the stored chunks'
(``stored_keys_disagreement``): a worker whose model or ``KV_PREAMBLE`` differs from what
ingest stored chunks with says so, by name, in its log and heartbeat.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvservice.blend.graphs import graphs_from_env
from kvservice.kdn.client import KvSource
from kvservice.model.kernels import DEFAULT_PRECISION
from kvservice.protocol import environment
from kvservice.protocol.heartbeat import HEARTBEAT_KEY
from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.models import default_cache_dir
from kvservice.protocol.prompt import PromptFormat, preamble_from_env
from kvservice.serve.batcher import StepBudget
from kvservice.serve.engine import refresh_ratio_from_env
from kvservice.serve.prefix import DEFAULT_CAPACITY_BYTES
from kvservice.store import StoreConfig
from kvservice.store.buffers import DEFAULT_LIMIT_BYTES

log = logging.getLogger(__name__)


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
    prefix_cache_bytes: int = DEFAULT_CAPACITY_BYTES  # PREFIX_CACHE_BYTES
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
        """The configuration, from ``environ`` (default: the process environment) through
        ``kvservice.protocol.environment``; a ``ValueError`` saying what to set for a bad or
        missing one (the worker then exits with status 2, as when its model cannot load)."""

        def read(name: str) -> Any:
            return environment.read(name, environ)

        redis_url = read("REDIS_URL")
        if not redis_url:
            raise ValueError(
                "REDIS_URL is not set (make dev sets it, and the other service addresses, for "
                "the workers it starts; by hand, export what DATA_DIR/stack.json lists)."
            )
        engine = read("ENGINE")
        if engine == "vllm" and read("KV_SOURCE") != "s3":
            raise ValueError(
                "KV_SOURCE=kdn works with ENGINE=native only: ENGINE=vllm's KV connector reads "
                "the store itself (unset KV_SOURCE and give the worker S3 credentials)"
            )
        return cls(
            redis_url=redis_url,
            model_path=read("MODEL_PATH") or None,
            model_cache_dir=default_cache_dir(),
            concurrency=read("INFERENCE_CONCURRENCY"),
            queue=read("INFERENCE_QUEUE"),
            engine=engine,
            node_name=read("INFERENCE_NODE_NAME"),
            precision=read("ENGINE_PRECISION"),
            kernel=read("ENGINE_KERNEL"),
            graphs=graphs_from_env(environ),
            buffer_bytes=read("ENGINE_BUFFER_BYTES"),
            kv_source=KvSource.from_env(environ),
            refresh_ratio=refresh_ratio_from_env(environ),
            step_budget=StepBudget.from_env(environ),
            prefix_cache_bytes=read("PREFIX_CACHE_BYTES"),
            store=StoreConfig.from_env(environ),
            kv_preamble=preamble_from_env(environ),
            heartbeat_key=read("HEARTBEAT_KEY"),
            vllm=_vllm_settings(environ) if engine == "vllm" else None,
        )


def _vllm_settings(environ: Mapping[str, str] | None) -> Any:
    from kvservice.vllm.engine import VllmSettings  # vLLM's module only where it runs

    return VllmSettings.from_env(environ)


# --- do this worker's chunk keys match the stored chunks'? ------------------------------------


@dataclass(frozen=True)
class KeyInputs:
    """What this worker's chunk keys are made of (``ChunkKey``'s first two parts): the model's
    fingerprint (``MODEL_PATH``) and the hash of what chunk KV is computed after (the prompt
    head, and the retrieval preamble with ``KV_PREAMBLE=on``). ``ENGINE_PRECISION`` and
    ``KV_CODEC`` are not in the key: a chunk made at another precision or stored in another
    codec is read as it is, so they cannot make keys disagree."""

    fingerprint: str
    head_hash: str  # with this worker's KV_PREAMBLE
    other_preamble_head: str  # what the other KV_PREAMBLE setting would give
    kv_preamble: bool
    model_path: str | None


def stored_keys_disagreement(s3: Any, ours: KeyInputs, sample: int = 200) -> str | None:
    """Why this worker's chunk keys would match none of the chunks stored in ``s3`` (an
    ``S3Tier``), naming the variable that differs; None when some stored chunk has this
    worker's model and head, or nothing is stored yet. A few listings, at start only.

    It warns rather than refuses: a stack moving to another model or ``KV_PREAMBLE`` holds
    the old chunks until its documents are ingested again, and meanwhile a worker with the
    new setting answers correctly (each miss is computed); refusing would take the product
    down mid-migration. The warning says what costs the time."""
    key = ChunkKey.for_tokens(ours.fingerprint, ours.head_hash, []).to_string()
    model_prefix = key[: key.index("/") + 1]  # "<fingerprint>/"
    if _stored_under(s3, key[: key.rindex("/") + 1], 1):  # "<fingerprint>/<head>/"
        return None
    same_model = _stored_under(s3, model_prefix, sample)
    stored = same_model or _stored_under(s3, "", sample)
    if not stored:
        return None
    return _disagreement(stored, ours)


def _stored_under(s3: Any, prefix: str, limit: int) -> list[ChunkKey]:
    """Up to ``limit`` keys stored under ``prefix`` (below the store's own prefix)."""
    names = s3.client.list_objects(s3.bucket, prefix=s3.config.s3_prefix + prefix, recursive=True)
    keys = []
    for entry in itertools.islice(names, limit):
        try:
            keys.append(ChunkKey.from_string(entry.object_name[len(s3.config.s3_prefix) :]))
        except ValueError:  # not a chunk object
            continue
    return keys


def _disagreement(stored: list[ChunkKey], ours: KeyInputs) -> str:
    """The message for stored chunks none of which has this worker's model and head."""
    mine = "on" if ours.kv_preamble else "off"
    theirs = "off" if ours.kv_preamble else "on"
    cost = "so every passage's KV is computed again at each question, and none is reused"
    if any(k.model_fingerprint == ours.fingerprint for k in stored):
        if any(k.head_hash == ours.other_preamble_head for k in stored):
            return (
                f"the stored chunks were made with KV_PREAMBLE={theirs}, this worker has "
                f"KV_PREAMBLE={mine}: its chunk keys match none of them, {cost} (give ingest "
                "and the inference worker the same KV_PREAMBLE)"
            )
        return (
            f"the stored chunks of this model were made after another prompt head "
            f"({stored[0].head_hash[:12]}, this worker's is {ours.head_hash[:12]}: another "
            f"system prompt or chat template): its chunk keys match none of them, {cost}"
        )
    model = ours.model_path or "the bundled model"
    return (
        f"the stored chunks were made with another MODEL_PATH (model fingerprint "
        f"{stored[0].model_fingerprint[:12]}), this worker has MODEL_PATH={model} (fingerprint "
        f"{ours.fingerprint[:12]}): its chunk keys match none of them, {cost} (give ingest "
        "and the inference worker the same MODEL_PATH, or ingest the documents again)"
    )


def check_stored_keys(runtime: Any, cfg: WorkerConfig) -> str | None:
    """``stored_keys_disagreement`` for a loaded runtime (either engine's), logged as a
    warning; None also where there is no S3 tier to compare with (``KV_SOURCE=kdn``) or S3
    cannot be listed now (the check is advice, never a reason not to start)."""
    s3 = runtime.store.durable
    if s3 is None:
        return None
    other = PromptFormat.for_tokenizer(runtime.tokenizer, preamble=not cfg.kv_preamble)
    key = runtime.chunk_key([])
    ours = KeyInputs(
        key.model_fingerprint, key.head_hash, other.storage_hash, cfg.kv_preamble, cfg.model_path
    )
    try:
        problem = stored_keys_disagreement(s3, ours)
    except Exception as err:  # noqa: BLE001 - S3 down or refusing: the loader copes later
        log.warning("the stored chunks' keys were not checked: %s", err)
        return None
    if problem:
        log.warning("chunk keys: %s", problem)
    return problem
