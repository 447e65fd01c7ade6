"""``RagblendConnector``: a vLLM V1 KV connector that writes the context's KV (prompt head +
retrieved chunks) into vLLM's paged cache, so vLLM only prefills the question.

vLLM loads it by name (``KVTransferConfig(kv_connector="RagblendConnector",
kv_connector_module_path="kvservice.vllm.connector", kv_role="kv_consumer")``) and makes
two instances: one in the scheduler (engine-core process), one in each worker.

A request asks for it with a *blend plan* in ``SamplingParams.extra_args["kv_transfer_params"]``
(``BlendPlan.to_params``): the mode (``reuse`` or ``blend``), the recompute ratio, the prompt
head's token ids, and each chunk's cache key and token ids. The prompt itself is the usual
``[head][chunk 1]...[chunk n][question]`` token ids. Requests without a plan (``full``,
``prefix``) never touch the connector: it reports 0 external tokens for them.

Scheduler side
  ``get_num_new_matched_tokens`` reports the context as externally provided: the head and
  every chunk up to the first one the store does not hold. Chunks from that one on (and
  the question) are prefilled by vLLM itself, so a missing chunk costs time, never the
  answer. ``update_state_after_alloc`` remembers which tokens to write, and
  ``build_connector_meta`` hands each such request's plan, prompt and block ids to the
  workers for the step that schedules it.

Worker side
  ``start_load_kv`` runs before that step's forward. For each request it loads the chunks'
  KV from the store and runs ``kvservice.blend.prefill.blend_prefill`` over vLLM's own model (see
  ``kvservice.vllm.blender``): ``reuse`` rotates the cached K to the chunks' positions,
  ``blend`` also recomputes the high-deviation tokens. The context's K (rotated) and V are
  written into each attention layer's paged cache through the attention backend's own
  ``do_kv_cache_update`` (so the layout is the backend's business, CPU or GPU). The blend
  of a step completes before the forward starts (``wait_for_layer_load`` has nothing to
  wait for): on this 2-core CPU there is no idle compute a per-layer pipeline could use.

A chunk that fails to load in the worker (it vanished after the scheduler's check) is
computed fresh by the blender, like a cache miss in the native engine.

The blend of a request depends on the whole prompt (the question weights the selection), so
blended blocks must never be shared through vLLM's prefix cache: ``VllmEngine`` gives every
``reuse``/``blend`` request its own ``cache_salt``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvservice.model.producer import HeadKVCache
    from kvservice.store import TieredStore
    from kvservice.vllm.blender import VllmBackedTransformer

log = logging.getLogger(__name__)

PLAN_KEY = "ragblend_plan"
CONNECTED_MODES = ("reuse", "blend")
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


# --------------------------------------------------------------------------------------------
# The plan a request carries, and what the scheduler sends the workers


@dataclass
class BlendPlan:
    mode: str  # "reuse" or "blend"
    recompute_ratio: float
    head_ids: list[int]
    chunk_keys: list[str]  # ChunkKey.to_string() of each chunk, in prompt order
    chunk_ids: list[list[int]]  # each chunk's token ids, in prompt order

    def __post_init__(self) -> None:
        if self.mode not in CONNECTED_MODES:
            raise ValueError(f"mode {self.mode!r} is not served by the connector")
        if len(self.chunk_keys) != len(self.chunk_ids):
            raise ValueError("one cache key per chunk is needed")

    def chunk_starts(self) -> list[int]:
        """Prompt position of each chunk's first token, then the context's end."""
        starts = [len(self.head_ids)]
        for ids in self.chunk_ids:
            starts.append(starts[-1] + len(ids))
        return starts

    @property
    def context_len(self) -> int:
        return self.chunk_starts()[-1]

    def to_params(self) -> dict[str, Any]:
        """``kv_transfer_params`` for ``SamplingParams.extra_args``."""
        return {
            PLAN_KEY: {
                "mode": self.mode,
                "recompute_ratio": float(self.recompute_ratio),
                "head_ids": list(self.head_ids),
                "chunk_keys": list(self.chunk_keys),
                "chunk_ids": [list(ids) for ids in self.chunk_ids],
            }
        }

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> BlendPlan | None:
        plan = (params or {}).get(PLAN_KEY)
        return None if plan is None else cls(**plan)


@dataclass
class LoadSpec:
    """One request's context write for a step: tokens ``[start, end)`` of the prompt."""

    request_id: str
    plan: BlendPlan
    prompt_ids: list[int]
    block_ids: list[int]
    start: int  # first token to write (tokens before it are vLLM's own prefix-cache hits)
    end: int  # context tokens provided: the head and the chunks the store holds


@dataclass
class RagblendConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# The connector


class RagblendConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self._store_fields: dict[str, Any] = dict(
            self._kv_transfer_config.get_from_extra_config("store", {}) or {}
        )
        self._store: TieredStore | None = None
        self._store_lock = threading.Lock()
        # Scheduler side. _matched: request id -> (plan, context tokens provided);
        # _pending: request id -> (plan, start, end, request) to write in the next step.
        self._matched: dict[str, tuple[BlendPlan, int]] = {}
        self._pending: dict[str, tuple[BlendPlan, int, int, Request]] = {}
        # Worker side
        self.blender_model: VllmBackedTransformer | None = None
        self._heads: HeadKVCache | None = None  # the blender model's, once it is set
        self.stats: dict[str, Any] = {
            "requests": 0,
            "tokens_written": 0,
            "missing_chunks": 0,
            "max_loads_per_step": 0,
            "connector_s": 0.0,
            "load_s": 0.0,
            "write_s": 0.0,  # connector_s: all of it
        }

    # -- shared ------------------------------------------------------------------------------

    @property
    def store(self) -> TieredStore:
        """The KV store, opened on first use in whichever process needs it."""
        with self._store_lock:
            if self._store is None:
                from kvservice.store import StoreConfig, TieredStore

                config = StoreConfig(**self._store_fields) if self._store_fields else None
                self._store = TieredStore.from_config(config or StoreConfig.from_env())
            return self._store

    # -- scheduler side ----------------------------------------------------------------------

    def _provided_context(self, request: Request, plan: BlendPlan) -> int:
        """Tokens of the context the connector can provide: the head, then chunks up to the
        first one the store does not hold. Asked once per request (store look-ups)."""
        from kvservice.protocol.keys import ChunkKey

        cached = self._matched.get(request.request_id)
        if cached is not None:
            return cached[1]
        starts = plan.chunk_starts()
        provided = starts[0]
        for index, key in enumerate(plan.chunk_keys):
            try:
                held = self.store.contains(ChunkKey.from_string(key))
            except Exception:  # noqa: BLE001 (a store fault is a miss, never a failed request)
                log.exception("store look-up of %s failed", key)
                held = False
            if not held:
                log.info(
                    "request %s: chunk %d not in the store; vLLM prefills from token %d",
                    request.request_id,
                    index,
                    provided,
                )
                break
            provided = starts[index + 1]
        # vLLM must compute at least the last prompt token itself (it samples from it).
        provided = min(provided, len(request.prompt_token_ids or []) - 1)
        self._matched[request.request_id] = (plan, provided)
        return provided

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        plan = BlendPlan.from_params(request.kv_transfer_params)
        if plan is None:
            return 0, False
        provided = self._provided_context(request, plan)
        return max(0, provided - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        plan, provided = self._matched[request.request_id]
        self._pending[request.request_id] = (
            plan,
            provided - num_external_tokens,
            provided,
            request,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RagblendConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            pending = self._pending.pop(new.req_id, None)
            if pending is not None:
                plan, start, end, request = pending
                meta.loads.append(
                    LoadSpec(
                        new.req_id,
                        plan,
                        list(request.prompt_token_ids or []),
                        list(new.block_ids[0]),
                        start,
                        end,
                    )
                )
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            # A request resumed after preemption got new blocks: write its context again.
            pending = self._pending.pop(req_id, None)
            if pending is None or cached.new_block_ids[index] is None:
                continue
            plan, start, end, request = pending
            meta.loads.append(
                LoadSpec(
                    req_id,
                    plan,
                    list(request.prompt_token_ids or []),
                    list(cached.new_block_ids[index][0]),
                    start,
                    end,
                )
            )
        return meta

    def request_finished(self, request: Request, block_ids: list[int]):
        self._matched.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        return False, None

    # -- worker side -------------------------------------------------------------------------

    def attach_model(self, model: VllmBackedTransformer) -> None:
        self.blender_model = model

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RagblendConnectorMetadata) or not meta.loads:
            return
        if self.blender_model is None:
            raise RuntimeError(
                "RagblendConnector has no model: the engine must call the worker extension's "
                "ragblend_attach_blender after start (VllmEngine does)"
            )
        layers = _attention_layers(forward_context)
        self.stats["max_loads_per_step"] = max(
            self.stats["max_loads_per_step"], len(meta.loads)
        )  # > 1: requests that arrived together were prefilled in one vLLM step
        for spec in meta.loads:
            started = time.perf_counter()
            keys, values = self._context_kv(spec)  # [L, H_kv, N, D] each
            computed = time.perf_counter()
            positions = torch.arange(spec.start, spec.end)
            blocks = torch.tensor(spec.block_ids)
            slots = blocks[positions // self.block_size] * self.block_size + (
                positions % self.block_size
            )  # [N]
            for index, layer in layers:
                device = layer.kv_cache.device
                key = keys[index].transpose(0, 1).to(device, layer.kv_cache.dtype).contiguous()
                value = values[index].transpose(0, 1).to(device, layer.kv_cache.dtype)
                # key, value: [N, H_kv, D], the layout vLLM's attention writes itself
                layer.impl.do_kv_cache_update(
                    layer, key, value.contiguous(), layer.kv_cache, slots.to(device)
                )
            done = time.perf_counter()
            self.stats["requests"] += 1
            self.stats["tokens_written"] += spec.end - spec.start
            self.stats["connector_s"] += done - started
            self.stats["write_s"] += done - computed
            by_mode = self.stats.setdefault("by_mode", {}).setdefault(
                spec.plan.mode, {"requests": 0, "seconds": 0.0}
            )
            by_mode["requests"] += 1
            by_mode["seconds"] += done - started

    @torch.no_grad()
    def _context_kv(self, spec: LoadSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated) and V ``[L, H_kv, end - start, D]`` of the context, by ``blend_prefill``
        over the provided chunks; the rest of the prompt plays the question."""
        from kvservice.blend.prefill import blend_prefill
        from kvservice.model.producer import HeadKVCache
        from kvservice.protocol.keys import ChunkKey

        plan, model = spec.plan, self.blender_model
        assert model is not None
        starts = plan.chunk_starts()
        n_chunks = sum(1 for stop in starts[1:] if stop <= spec.end)
        context_end = starts[n_chunks]  # == spec.end unless the prompt's last token cut it
        load_started = time.perf_counter()
        sources: list[Any] = []
        for key in plan.chunk_keys[:n_chunks]:
            try:
                sources.append(self.store.get(ChunkKey.from_string(key)))
            except Exception as err:  # noqa: BLE001 (computed fresh instead)
                log.warning("chunk %s could not be loaded (%s): computed fresh", key, err)
                self.stats["missing_chunks"] += 1
                sources.append(None)
        self.stats["load_s"] += time.perf_counter() - load_started
        head = list(plan.head_ids)
        if self._heads is None:
            self._heads = HeadKVCache(model)
        result = blend_prefill(
            model,
            head,
            sources,
            spec.prompt_ids[context_end:],
            mode=plan.mode,  # type: ignore[arg-type]
            recompute_ratio=plan.recompute_ratio,
            chunk_ids=plan.chunk_ids[:n_chunks],
            head_kv=self._heads.get(head) if head else None,
        )
        span = slice(spec.start, spec.end)
        return result.cache.k[:, 0, :, span], result.cache.v[:, 0, :, span]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv wrote every layer before the forward began

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs):
        return  # chunk KV is precomputed by Ragblend's own pipeline, never saved from vLLM

    def wait_for_save(self) -> None:
        return


def _attention_layers(forward_context: ForwardContext) -> list[tuple[int, Any]]:
    """(decoder layer index, attention module) for every layer that owns a KV cache."""
    layers = []
    for name, layer in forward_context.no_compile_layers.items():
        match = _LAYER_INDEX.search(name)
        if match is None or getattr(layer, "kv_cache", None) is None:
            continue
        if not hasattr(layer, "impl"):
            continue
        layers.append((int(match.group(1)), layer))
    return sorted(layers, key=lambda item: item[0])


# --------------------------------------------------------------------------------------------
# The worker extension: hands the worker-side connector vLLM's loaded model


class BlenderWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); the engine calls
    ``collective_rpc("ragblend_attach_blender")`` once after start."""

    def ragblend_attach_blender(self) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvservice.vllm.blender import parameter_bytes, wrap_vllm_model

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        path = self.vllm_config.model_config.model  # type: ignore[attr-defined]
        blender = wrap_vllm_model(model, path)
        connector = get_kv_transfer_group()
        if not isinstance(connector, RagblendConnector):
            raise TypeError(f"the KV connector is {type(connector).__name__}, not Ragblend's")
        connector.attach_model(blender)
        return {
            "fingerprint": blender.fingerprint,
            # What the blender added: no parameters of its own (0), vs. vLLM's model.
            "blender_own_parameter_bytes": sum(
                p.numel() * p.element_size() for p in blender.parameters(recurse=False)
            ),
            "vllm_parameter_bytes": parameter_bytes(model),
            "torch_threads": torch.get_num_threads(),
        }

    def ragblend_connector_stats(self) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return dict(get_kv_transfer_group().stats)
