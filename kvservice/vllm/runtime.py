"""The inference worker's runtime with ``ENGINE=vllm``: what ``kvservice.serve.server`` holds for
its lifetime when vLLM serves every mode (see ``kvservice.vllm.engine``).

It offers what the server and the answer path use from the native ``Runtime``: the prompt
format, the context length, chunk keys, the store (for tier reports, evict and warm), the
controller and the heartbeat status. There is no ``Transformer`` here: the model lives in
vLLM's worker process, and the blender runs there on vLLM's own layers.

The store opened here is this process's view (tier reports, evict/warm of this process's
tiers); the connector opens its own in vLLM's processes, from the same ``StoreConfig``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kvservice.blend.planning import PlannedRequest, check_ratio_curve
from kvservice.protocol import TokenEvent
from kvservice.protocol.prompt import Prompt, PromptFormat
from kvservice.vllm.engine import VllmEngine, VllmRequest, VllmSettings

if TYPE_CHECKING:  # built by kvservice.config, the worker's composition root, and handed in
    from kvservice.config import WorkerConfig


class VllmRuntime:
    def __init__(self) -> None:
        self.model_name: str | None = None
        self.engine: VllmEngine | None = None
        self.refresh_ratio: float | None = None  # no progressive blend through vLLM
        self.active = 0  # requests in flight (the heartbeat's batch size)
        self._active_lock = threading.Lock()

    @contextmanager
    def request_in_flight(self) -> Iterator[None]:
        with self._active_lock:
            self.active += 1
        try:
            yield
        finally:
            with self._active_lock:
                self.active -= 1

    def load(self, cfg: WorkerConfig) -> None:
        from transformers import AutoTokenizer

        from kvservice.blend.controller import LoadingController
        from kvservice.model.bundled import resolve_llm_path
        from kvservice.model.checkpoint import checkpoint_config
        from kvservice.store import StoreConfig, TieredStore

        path = resolve_llm_path(cfg.model_path, cfg.model_cache_dir)
        store_config = cfg.store or StoreConfig.from_env()
        self.store = TieredStore.from_config(store_config)
        self.controller = LoadingController()
        self.config = checkpoint_config(path)  # refuses what the blender cannot run
        tokenizer = AutoTokenizer.from_pretrained(path)
        fmt = PromptFormat.for_tokenizer(tokenizer, preamble=cfg.kv_preamble)
        self.engine = VllmEngine(
            path,
            store_config=store_config,
            settings=cfg.vllm or VllmSettings.from_env(),
            prompt_format=fmt,
        )
        self.tokenizer = self.engine.tokenizer
        self.prompt = self.engine.format
        self.ratio_curve = check_ratio_curve(self.fingerprint, store_config.codec)
        hf_config = json.loads((path / "config.json").read_text())
        declared = int(hf_config.get("max_position_embeddings", 4096))
        self.context_len = min(
            self.config.served_context(declared), self.engine.settings.max_model_len
        )
        self.model_name = path.name

    @property
    def fingerprint(self) -> str:
        return self.engine.fingerprint if self.engine else ""

    def chunk_key(self, token_ids: list[int], scope: str = ""):
        from kvservice.protocol.keys import ChunkKey

        return ChunkKey.for_tokens(self.fingerprint, self.prompt.storage_hash, token_ids, scope)

    def kv_bytes_per_token(self, element_size: int = 4) -> int:
        config = self.config
        return 2 * config.n_layers * config.n_kv_heads * config.head_dim * element_size

    def plan(self, planned: PlannedRequest) -> VllmPlan:
        return VllmPlan(self, planned)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def status(self) -> dict[str, object]:
        state: dict[str, object] = {
            "pid": os.getpid(),
            "model": self.model_name,
            "model_loaded": self.engine is not None,
            "engine": "vllm",
        }
        if self.engine is not None:
            state["store"] = self.store.stats().to_dict()
            state["controller"] = self.controller.snapshot()
            state["kv_bytes_per_token"] = self.kv_bytes_per_token()
            state["model_fingerprint"] = self.fingerprint  # its chunk keys' first part
            state["ratio_curve"] = self.ratio_curve  # whether target mode's curve is this model's
            # No connector stats here: they are an RPC into vLLM's worker, which waits while a
            # long prefill runs, and the heartbeat must not.
            state["batch"] = {"active": self.active, "steps": None}
        return state


class VllmPlan:
    """One request through vLLM: ``reuse``/``blend`` carry their chunk keys to the KV
    connector, which loads and blends in vLLM's processes. Each passage is behind its number
    ("[1]"), a marker in no store: vLLM prefills it itself."""

    def __init__(self, runtime: VllmRuntime, planned: PlannedRequest):
        request, fitted, keys = planned.request, planned.fitted, planned.chunk_keys
        self.runtime, self.fitted = runtime, fitted
        self.tiers = [runtime.store.where(key) or "missing" for key in keys]
        per_token = runtime.kv_bytes_per_token(element_size=2)  # stored as 16-bit
        load_bytes: dict[str, int] = {}
        for tier, ids in zip(self.tiers, fitted.chunks_tokens, strict=True):
            if tier != "missing":
                load_bytes[tier] = load_bytes.get(tier, 0) + per_token * len(ids)
        self.ratio, self.decision = planned.ratio.choose(
            num_tokens=sum(map(len, fitted.chunks_tokens)),
            num_layers=runtime.config.n_layers,
            load_bytes=load_bytes,
        )
        segment_keys = [
            part
            for key, marker in zip(keys, fitted.segments[::2], strict=True)
            for part in (runtime.chunk_key(marker).to_string(), key.to_string())
        ]
        self.request = VllmRequest(
            Prompt(list(runtime.prompt.head_ids), fitted.segments, fitted.suffix_ids),
            mode=request.mode,
            chunk_keys=segment_keys,
            recompute_ratio=self.ratio,
            sampling=planned.sampling,
        )
        self.prompt_tokens = len(self.request.prompt.token_ids)

    def events(self, on_queue: Callable[[int | None], None] | None = None) -> Iterator[TokenEvent]:
        """The answer's tokens (vLLM schedules its own queue: no place is told)."""
        with self.runtime.request_in_flight():
            yield from self.runtime.engine.stream(self.request)

    def finish(self) -> dict[str, Any]:
        tiers = zip(self.fitted.chunk_ids, self.tiers, strict=True)
        return {
            "engine": "vllm",
            "prefill_s": None,
            "chunk_tiers": {str(cid): tier for cid, tier in tiers},
        }
