"""``VllmEngine``: every prefill mode through one vLLM engine, with vLLM's own scheduling,
continuous batching and paged attention.

| mode | how | vLLM's prefix cache |
|---|---|---|
| ``full`` | vLLM prefills the whole prompt | own ``cache_salt``: a real full prefill |
| ``prefix`` | vLLM's automatic prefix caching | shared with earlier prompts |
| ``reuse`` | ``RagblendConnector`` writes re-positioned cached chunk KV | own salt |
| ``blend`` | ``RagblendConnector`` writes CacheBlend's blended KV | own salt |

vLLM runs in its own processes (engine core, worker); ``AsyncLLM`` is driven by an event
loop in a background thread, so any number of caller threads (the inference worker's
Celery threads, a test's 8 requests) can stream at once and vLLM batches them.

vLLM spawns processes: a script that starts a ``VllmEngine`` needs the
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvservice.blend.prefill import MODES, Completion
from kvservice.model.sampling import SamplingParams
from kvservice.protocol import TokenEvent, environment
from kvservice.protocol.prompt import Prompt, PromptFormat, stop_token_ids
from kvservice.protocol.ratio import DEFAULT_RECOMPUTE_RATIO
from kvservice.store import StoreConfig

log = logging.getLogger(__name__)

CONNECTOR_MODULE = "kvservice.vllm.connector"


@dataclass(frozen=True)
class VllmSettings:
    """How the vLLM engine is started; ``from_env`` reads ``VLLM_*`` once.

    | variable | default | meaning |
    |---|---|---|
    | ``VLLM_GPU_MEMORY_UTILIZATION`` | ``0.3`` | share of GPU memory (on CPU: of RAM) vLLM takes |
    | ``VLLM_MAX_MODEL_LEN`` | ``4096`` | longest prompt + answer (LongRoPE: see below) |
    | ``VLLM_MAX_NUM_SEQS`` | ``8`` | requests batched together |
    | ``VLLM_DTYPE`` | ``float32`` on CPU, ``auto`` on GPU | weights' dtype |
    | ``VLLM_ENFORCE_EAGER`` | ``true`` on CPU | skip graph compilation (about 45 s start on CPU) |

    A LongRoPE checkpoint's (Phi-3/Phi-4) max_model_len is capped at its original context
    (``_served_model_len``).
    """

    gpu_memory_utilization: float = 0.3
    max_model_len: int = 4096
    max_num_seqs: int = 8
    dtype: str | None = None  # None: float32 on CPU (bf16 is emulated there), else "auto"
    enforce_eager: bool | None = None  # None: True on CPU
    seed: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> VllmSettings:
        """``VLLM_*`` in ``environ`` (default: the process environment), as declared in
        ``kvservice.protocol.environment``."""

        def read(name: str) -> Any:
            return environment.read(name, environ)

        return cls(
            gpu_memory_utilization=read("VLLM_GPU_MEMORY_UTILIZATION"),
            max_model_len=read("VLLM_MAX_MODEL_LEN"),
            max_num_seqs=read("VLLM_MAX_NUM_SEQS"),
            dtype=read("VLLM_DTYPE"),
            enforce_eager=read("VLLM_ENFORCE_EAGER"),
        )


@dataclass
class VllmRequest:
    """One request: the prompt's parts, the mode, and (for reuse/blend) the chunks' keys."""

    prompt: Prompt
    mode: str = "blend"
    chunk_keys: Sequence[str] = ()  # ChunkKey strings of prompt.chunk_ids, same order
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO
    sampling: SamplingParams = field(default_factory=SamplingParams)


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    except Exception:  # noqa: BLE001
        return True


class VllmEngine:
    """One vLLM ``AsyncLLM`` with ``RagblendConnector``, started once per process."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        store_config: StoreConfig | None = None,
        settings: VllmSettings | None = None,
        connector: bool = True,
        prompt_format: PromptFormat | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        self.model_path = str(model_path)
        self.settings = settings or VllmSettings.from_env()
        self.connector = connector
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.format = prompt_format or PromptFormat.for_tokenizer(self.tokenizer)
        self.stop_ids = stop_token_ids(self.tokenizer, self.model_path)
        self.max_model_len = _served_model_len(self.model_path, self.settings.max_model_len)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-engine-loop", daemon=True
        )
        self._thread.start()
        started = time.perf_counter()
        self._llm = self._call(self._start(store_config or StoreConfig.from_env()))
        self.attach_info: dict[str, Any] = {}
        if connector:
            self.attach_info = self._call(self._llm.collective_rpc("ragblend_attach_blender"))[0]
        self.fingerprint = self.attach_info.get("fingerprint") or _fingerprint(self.model_path)
        self.start_s = time.perf_counter() - started
        log.info("vLLM engine up in %.1f s (connector %s)", self.start_s, connector)

    # -- life cycle --------------------------------------------------------------------------

    async def _start(self, store_config: StoreConfig):
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        on_cpu = _on_cpu()
        settings = self.settings
        kv_transfer = None
        extension = ""
        if self.connector:
            kv_transfer = KVTransferConfig(
                kv_connector="RagblendConnector",
                kv_connector_module_path=CONNECTOR_MODULE,
                kv_role="kv_consumer",
                kv_connector_extra_config={"store": asdict(store_config)},
            )
            extension = f"{CONNECTOR_MODULE}.BlenderWorkerExtension"
        args = AsyncEngineArgs(
            model=self.model_path,
            dtype=settings.dtype or ("float32" if on_cpu else "auto"),
            enforce_eager=on_cpu if settings.enforce_eager is None else settings.enforce_eager,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=self.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            enable_prefix_caching=True,  # the `prefix` mode; the other modes salt it away
            seed=settings.seed,
            kv_transfer_config=kv_transfer,
            worker_extension_cls=extension,
            disable_log_stats=True,
        )
        return AsyncLLM.from_engine_args(args)

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        """Shut vLLM's processes down and stop the loop (its pending tasks cancelled)."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:

            async def shutdown() -> None:
                llm.shutdown()
                pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

            self._call(shutdown())
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connector_stats(self) -> dict[str, Any]:
        if not self.connector:
            return {}
        return self._call(self._llm.collective_rpc("ragblend_connector_stats"))[0]

    # -- requests ----------------------------------------------------------------------------

    def chunk_key(self, token_ids: Sequence[int], head_hash: str | None = None) -> str:
        from kvservice.protocol.keys import ChunkKey

        head = self.format.storage_hash if head_hash is None else head_hash
        return ChunkKey.for_tokens(self.fingerprint, head, list(token_ids)).to_string()

    def _vllm_inputs(self, request: VllmRequest):
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        from kvservice.vllm.connector import BlendPlan

        if request.mode not in MODES:
            raise ValueError(f"unknown mode {request.mode!r} (one of {MODES})")
        prompt = request.prompt
        inputs: dict[str, Any] = {"prompt_token_ids": prompt.token_ids}
        extra_args = None
        if request.mode != "prefix":
            # Never read or offer another request's blocks: `full` is a real full prefill,
            # and reused/blended KV depends on the whole prompt.
            inputs["cache_salt"] = f"{request.mode}-{uuid.uuid4().hex}"
        if request.mode in ("reuse", "blend"):
            if not self.connector:
                raise ValueError(f"mode {request.mode!r} needs the engine's KV connector")
            keys = list(request.chunk_keys) or [self.chunk_key(ids) for ids in prompt.chunk_ids]
            plan = BlendPlan(
                mode=request.mode,
                recompute_ratio=request.recompute_ratio,
                head_ids=list(prompt.head_ids),
                chunk_keys=keys,
                chunk_ids=[list(ids) for ids in prompt.chunk_ids],
            )
            extra_args = {"kv_transfer_params": plan.to_params()}
        sampling = request.sampling
        params = VllmSamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop_token_ids=sorted(self.stop_ids | set(sampling.stop_token_ids)),
            # The same decoding as the native engine (kvservice.model.sampling.apply_penalties and
            # StopStrings follow vLLM's definitions).
            repetition_penalty=sampling.repetition_penalty,
            frequency_penalty=sampling.frequency_penalty,
            presence_penalty=sampling.presence_penalty,
            stop=list(sampling.stop) or None,
            skip_special_tokens=True,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra_args,
        )
        return inputs, params

    def stream(self, request: VllmRequest) -> Iterator[TokenEvent]:
        """Token events as vLLM produces them; TTFT is taken at the first token."""
        inputs, params = self._vllm_inputs(request)
        events: queue.Queue = queue.Queue()
        request_id = uuid.uuid4().hex
        start = time.perf_counter()

        async def pump() -> None:
            try:
                async for output in self._llm.generate(inputs, params, request_id):
                    events.put(output)
            except BaseException as err:  # noqa: BLE001 (handed to the caller's thread)
                events.put(err)
            finally:
                events.put(None)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        index = 0
        try:
            while True:
                item = events.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                completion = item.outputs[0]
                finish = completion.finish_reason
                ids = list(completion.token_ids)
                for position, token in enumerate(ids):
                    last = position == len(ids) - 1
                    reason = None
                    if last and finish is not None:
                        reason = "stop" if finish == "stop" else "length"
                    yield TokenEvent(
                        token_id=token,
                        text=completion.text if last else "",
                        index=index,
                        ttft_s=time.perf_counter() - start if index == 0 else None,
                        finish_reason=reason,
                    )
                    index += 1
        finally:
            if not future.done():  # the caller stopped early: abort the request in vLLM
                asyncio.run_coroutine_threadsafe(self._llm.abort(request_id), self._loop)

    def generate(self, request: VllmRequest) -> Completion:
        events = list(self.stream(request))
        stops = self.stop_ids | set(request.sampling.stop_token_ids)
        ids = [e.token_id for e in events if e.token_id not in stops]
        return Completion(
            token_ids=ids,
            text="".join(e.text for e in events),  # vLLM's text leaves a stop string out
            ttft_s=(events[0].ttft_s or 0.0) if events else 0.0,
            finish_reason=(events[-1].finish_reason or "length") if events else "length",
        )


def _served_model_len(model_path: str, requested: int) -> int:
    """``requested``, lowered to the checkpoint's ``max_position_embeddings`` (vLLM refuses
    to start past it) and capped at the context the blender turns as vLLM does: LongRoPE's
    original context (Phi-3/Phi-4). Past it vLLM turns *every* position by the long factors
    (``Phi3LongRoPEScaledRotaryEmbedding``), while the blender and the native engine keep the
    short ones (``kvservice.model.families``): the KV the connector
    wrote would not be the KV vLLM's own layers expect."""
    from kvservice.model.checkpoint import checkpoint_config
    from kvservice.model.families import UnsupportedModelError

    config = json.loads((Path(model_path) / "config.json").read_text())
    declared = config.get("max_position_embeddings") or config.get("text_config", {}).get(
        "max_position_embeddings"
    )
    if declared and requested > int(declared):  # vLLM refuses to start past it
        log.info("max_model_len %d lowered to the checkpoint's %d", requested, int(declared))
        requested = int(declared)
    try:
        limit = checkpoint_config(model_path).max_positions
    except UnsupportedModelError:
        return requested  # no blender for it (an engine without the connector): vLLM's limits
    if limit is not None and requested > limit:
        log.warning(
            "max_model_len %d capped at %d: the checkpoint's LongRoPE original context",
            requested,
            limit,
        )
        return limit
    return requested


def _fingerprint(model_path: str) -> str:
    from kvservice.model.checkpoint import checkpoint_fingerprint

    return checkpoint_fingerprint(model_path)
