"""What the inference worker holds for its lifetime with the native engine (model, prompt
format, store and loader, prefix cache, controller, the engine and its batch), and how it
plans one request (``NativePlan``): the context KV a previous prompt left
(``kvservice.serve.prefix``), the other chunks loaded through the store's tiers, the recompute
ratio (the planner's ``RatioPolicy``, asked with the loader's estimate), and the engine's
request. ``kvservice.serve.answer`` drives the plan;
``kvservice.serve.server`` serves it over Celery.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvservice.blend.controller import ChunkLoad, LoadingController
from kvservice.blend.graphs import graphs_report, use_pass_graphs
from kvservice.blend.planning import PlannedRequest, check_ratio_curve
from kvservice.blend.prefill import BlendResult, warm_graphs
from kvservice.protocol import TokenEvent
from kvservice.protocol.prompt import Prompt
from kvservice.protocol.routing import chunk_digest
from kvservice.serve.batcher import PrefillTimes
from kvservice.serve.engine import Engine, Request
from kvservice.serve.prefix import PrefixKV, boundaries
from kvservice.store.buffers import KV_BUFFERS

if TYPE_CHECKING:  # built by kvservice.config, the worker's composition root, and handed in
    from kvservice.config import WorkerConfig

log = logging.getLogger(__name__)


class NativeRuntime:
    def __init__(self) -> None:
        self.model_name: str | None = None
        self.model = None
        self.tokenizer = None
        self.kdn = None  # the KdnTier when KV_SOURCE=kdn

    def load(self, cfg: WorkerConfig) -> None:
        """Load the model and warm up in a thread that ends, so that the engine's batcher
        thread is left the one thread with an OpenMP team; this thread and every thread
        started after it (Celery's, the KV loader's) then run torch on one core
        (``kvservice.store.compute_threads``)."""
        from kvservice.store.compute_threads import run_in_passing_thread, single_threaded

        run_in_passing_thread(lambda: self._load(cfg), name="model-load")
        single_threaded()

    def _load(self, cfg: WorkerConfig) -> None:
        import torch
        from transformers import AutoTokenizer

        from kvservice.kdn.client import KdnTier, kdn_store
        from kvservice.model.bundled import resolve_llm_path
        from kvservice.model.transformer import Transformer
        from kvservice.protocol.prompt import PromptFormat
        from kvservice.serve.engine import Engine
        from kvservice.serve.prefix import PrefixCache
        from kvservice.store import KVLoader, StoreConfig, TieredStore

        kv_source, refresh_ratio = cfg.kv_source, cfg.refresh_ratio
        path = resolve_llm_path(cfg.model_path, cfg.model_cache_dir)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        KV_BUFFERS.limit_bytes = cfg.buffer_bytes
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = Transformer.from_pretrained(
            path, device=device, precision=cfg.precision, kernel=cfg.kernel
        )
        if device == "cuda" and cfg.graphs:
            _record_passes_of(self.model)
        self.prompt = PromptFormat.for_tokenizer(self.tokenizer, preamble=cfg.kv_preamble)
        self.engine = Engine(
            self.model,
            self.tokenizer,
            self.prompt,
            max_batch=cfg.concurrency,
            step_budget=cfg.step_budget,
        )
        # progressive blend where a request sets none: the planner resolves a request's
        # refresh ratio once (RatioPolicy) and the engine's request carries it
        self.refresh_ratio = refresh_ratio
        self.engine.head_kv  # computed now, not on the first question  # noqa: B018
        store_config = cfg.store or StoreConfig.from_env()
        if kv_source.kind == "kdn":  # the API in S3's place, behind the worker's own tiers
            self.store = kdn_store(store_config, kv_source)
            self.kdn = next(t for t in self.store.tiers if isinstance(t, KdnTier))
        else:
            self.store = TieredStore.from_config(store_config)
        self.ratio_curve = check_ratio_curve(self.model.fingerprint, store_config.codec)
        # decoded where it runs, as what its cache holds
        self.loader = KVLoader(self.store, device=self.model.device, dtype=self.model.cache_dtype)
        self.prefix_cache = PrefixCache(cfg.prefix_cache_bytes)
        self.controller = LoadingController()
        calibrate(self.engine, self.controller)
        hf_config = json.loads((path / "config.json").read_text())
        declared = int(hf_config.get("max_position_embeddings", 4096))
        self.context_len = self.model.config.served_context(declared)
        self.model_name = path.name

    def status(self) -> dict[str, object]:
        """The live state the heartbeat carries to /healthz and the dashboard."""
        state: dict[str, object] = {
            "pid": os.getpid(),
            "model": self.model_name,
            "model_loaded": self.model is not None,
        }
        if self.model is not None:
            state["store"] = self.store.stats().to_dict()
            state["controller"] = self.controller.snapshot()
            state["kernels"] = self.model.kernel_choice.to_dict()
            config = self.model.config  # K and V, every layer, at the model's dtype
            element = self.model.embed_tokens.weight.element_size()
            state["kv_bytes_per_token"] = (
                2 * config.n_layers * config.n_kv_heads * config.head_dim * element
            )
            # the dashboard's per-token figures are the running model's, not a constant's
            state["model_shape"] = {
                "layers": config.n_layers,
                "kv_heads": config.n_kv_heads,
                "head_dim": config.head_dim,
            }
            state["model_fingerprint"] = self.model.fingerprint  # its chunk keys' first part
            state["ratio_curve"] = self.ratio_curve  # whether target mode's curve is this model's
            state["batch"] = self.engine.batcher.stats()
            state["prefix_cache"] = self.prefix_cache.stats()
            state["buffers"] = KV_BUFFERS.stats()
            state["pass_graphs"] = graphs_report(self.model.pass_graphs)
        return state

    def hot_digests(self) -> list[str]:
        """What this worker holds in memory (CPU and GPU tiers), as ``routing`` digests."""
        if self.model is None:
            return []
        return [
            chunk_digest(key.scope, key.tokens_sha256)
            for tier in self.store.tiers
            if tier.name in ("device", "cpu")
            for key in tier.keys()
        ]

    def chunk_key(self, token_ids: list[int], scope: str = ""):
        from kvservice.protocol.keys import ChunkKey

        fingerprint, head = self.model.fingerprint, self.prompt.storage_hash
        return ChunkKey.for_tokens(fingerprint, head, token_ids, scope)

    def recompute_chunk(self, token_ids):
        return self.engine.precompute([list(token_ids)])[0]

    def plan(self, planned: PlannedRequest) -> NativePlan:
        if self.kdn is not None:
            self.kdn.expect(self.kdn_reads(planned))
        return NativePlan(self, planned)

    def kdn_reads(self, planned: PlannedRequest) -> dict:
        """What the KDN tier may fetch for the kept chunks (the keys the planner made): each
        one's key, with its text and the request's token, until the request's timeout (a
        chunk without them is recomputed)."""
        from kvservice.kdn.client import KdnRead

        request = planned.request
        until = time.monotonic() + request.timeout_s
        kept = request.chunks[: len(planned.chunk_keys)]
        return {
            key: KdnRead(ref.text, ref.kdn_token, until)
            for key, ref in zip(planned.chunk_keys, kept, strict=True)
            if ref.text and ref.kdn_token
        }

    def close(self) -> None:
        if self.model is not None:
            self.engine.close()
            self.loader.close()
        if self.kdn is not None:
            self.kdn.close()


def _record_passes_of(model) -> None:
    """The passes of common prompts recorded as CUDA graphs (``kvservice.blend.graphs``),
    timed and logged: the worker's warm-up pays for them, not its first questions."""
    graphs = use_pass_graphs(model)
    if graphs is None:
        return
    started = time.perf_counter()
    shapes = warm_graphs(model, graphs)
    log.info(
        "recorded %d passes as CUDA graphs in %.1f s%s",
        len(shapes),
        time.perf_counter() - started,
        f" (then stopped: {graphs.failed})" if graphs.failed else "",
    )


def calibrate(
    engine: Engine, controller: LoadingController, *, chunks: int = 2, chunk_tokens: int = 512
) -> None:
    """Measure, at load, what the loading controller weighs loads against: full prefill's
    throughput and blend's cost per read token, on a made-up prompt of ``chunks`` chunks
    (its token ids do not matter for the time). Real requests refine both; the first
    question so also finds every kernel warm."""
    vocab, layers = engine.model.config.vocab_size, engine.model.config.n_layers
    segments = [
        [(101 + 7919 * (c * chunk_tokens + t)) % vocab for t in range(chunk_tokens)]
        for c in range(chunks)
    ]
    prompt = Prompt(list(engine.format.head_ids), segments, segments[0][:16])

    def seconds(request: Request) -> tuple[float, BlendResult]:
        started = time.perf_counter()
        result = engine.prefill(request)
        int(result.logits.argmax())  # waits for the device
        return time.perf_counter() - started, result

    full = Request(prompt, [None] * chunks, mode="full")
    seconds(full)  # untimed: the first run pays for setting kernels up
    full_s, result = seconds(full)
    controller.observe_recompute(tokens=sum(result.recomputed_per_layer), layers=1, seconds=full_s)
    cached = engine.precompute(segments)
    blend = Request(prompt, list(cached), mode="blend", recompute_ratio=controller.target_ratio)
    blend_s, result = seconds(blend)
    controller.observe_blend(
        read_token_layers=chunks * chunk_tokens * layers,
        computed_token_layers=sum(result.recomputed_per_layer),
        compute_s=blend_s,
    )


class NativePlan:
    """One request on the native engine. A follow-up whose prompt starts like an earlier one
    reads that prompt's context KV as it stands (``kvservice.serve.prefix``; not in ``full``, the
    reference) and loads only the passages after it; ``finish`` keeps this prompt's context
    KV for the next one."""

    def __init__(self, runtime: NativeRuntime, planned: PlannedRequest):
        request, fitted = planned.request, planned.fitted
        self.runtime, self.fitted, self.policy = runtime, fitted, planned.ratio
        self._deadline_s = request.timeout_s
        self.prefix, reused = None, 0
        kept = request.chunks[: len(fitted.chunks_tokens)]
        scopes = [scope for ref in kept for scope in ("", ref.kv_scope)]  # marker, passage
        self._keys, self._lengths = boundaries(runtime.prompt.head_ids, fitted.segments, scopes)
        if request.mode != "full" and runtime.prefix_cache.capacity_bytes > 0:
            found = runtime.prefix_cache.match(self._keys, self._lengths)
            if found is not None:
                self.prefix, covered = found
                reused = covered // 2  # whole passages: marker and text
        self.reused = reused
        self.batch, self.load_plan = None, None
        head = list(runtime.prompt.head_ids)
        prompt = Prompt(head, fitted.segments, fitted.suffix_ids)
        sources: list = [None] * len(fitted.chunks_tokens)  # full: every chunk computed
        if request.mode != "full":
            self.batch = runtime.loader.open(
                planned.chunk_keys[reused:],
                token_ids=fitted.chunks_tokens[reused:],
                recompute_fn=runtime.recompute_chunk,
                choose=lambda located: self._choose_loads(prompt, located),
            )
            sources = [None] * reused + [None if s.skipped else s for s in self.batch]
        self.ratio, self.decision = planned.ratio.choose(
            num_tokens=sum(map(len, fitted.chunks_tokens[reused:])),
            num_layers=runtime.model.config.n_layers,
            load_bytes=self.batch.tier_bytes() if self.batch is not None else {},
        )
        self.request = Request(
            prompt,
            [part for source in sources for part in (None, source)],  # markers: computed
            mode=request.mode,
            recompute_ratio=self.ratio,
            sampling=planned.sampling,
            cached_prefix=self.prefix,
            refresh_ratio=planned.ratio.refresh_ratio,
        )
        self.prompt_tokens = len(self.request.prompt.token_ids)
        self._result: BlendResult | None = None
        self._prefill_s: float | None = None  # the prefill's compute (its slices)
        self._times: PrefillTimes | None = None
        # progressive blend: (ratio, its upgrade's compute seconds, or why there was none)
        self._refreshed: tuple[float, float | str] | None = None

    def _choose_loads(self, prompt: Prompt, located) -> list[bool]:
        """The loading controller's per-chunk choice over the located chunks: a chunk whose
        KV would take longer to arrive than to recompute is recomputed whole
        (``kvservice.blend.controller.choose_loads``)."""
        runtime = self.runtime
        tokens = self.fitted.chunks_tokens[self.reused :]
        chunks = [
            ChunkLoad(len(ids), source.loaded_bytes(), source.tier)
            for ids, source in zip(tokens, located, strict=True)
        ]
        covered = self.prefix.num_tokens if self.prefix is not None else len(prompt.head_ids)
        self.load_plan = runtime.controller.choose_loads(
            chunks=chunks,
            question_tokens=len(prompt.token_ids) - covered - sum(map(len, tokens)),
            num_layers=runtime.model.config.n_layers,
            recompute_ratio=self.policy.expected(),  # reuse recomputes none of a read chunk
        )
        return list(self.load_plan.load)

    def events(self, on_queue: Callable[[int | None], None] | None = None) -> Iterator[TokenEvent]:
        return self.runtime.engine.stream(
            self.request,
            deadline=time.monotonic() + self._deadline_s,
            on_prefill=self._prefilled,
            on_refresh=self._upgraded,
            on_queue=on_queue,
        )

    def _prefilled(self, result: BlendResult, times: PrefillTimes) -> None:
        self._result, self._prefill_s, self._times = result, times.compute_s, times

    def _upgraded(self, ratio: float, outcome: float | str) -> None:
        self._refreshed = ratio, outcome

    def finish(self) -> dict[str, Any]:
        runtime, result = self.runtime, self._result
        chunk_ids = self.fitted.chunk_ids
        metrics: dict[str, Any] = {
            "prefill_s": None if self._prefill_s is None else round(self._prefill_s, 4),
            "chunk_tiers": {str(cid): "prefix" for cid in chunk_ids[: self.reused]},
            "prefix_tokens": 0 if self.prefix is None else self.prefix.num_tokens,
        }
        if self._times is not None:  # in the queue, and the prefill's slices with the steps
            metrics["queue_s"] = round(self._times.queued_s, 4)
            metrics["prefill_wall_s"] = round(self._times.wall_s, 4)
        load = self.batch.stats() if self.batch is not None else None
        if self._refreshed is not None and isinstance(self._refreshed[1], str):
            metrics["refresh_skipped"] = self._refreshed[1]
        elif self._refreshed is not None:  # progressive blend upgraded the cache
            metrics["refresh_ratio"] = self._refreshed[0]
            metrics["refresh_s"] = round(self._refreshed[1], 4)
        if result is not None:
            metrics["recompute_ratio_effective"] = round(result.recompute_ratio_effective, 4)
            self._observe(result, wait_s=load.wait_s if load is not None else 0.0)
            self._keep_prefix(result)
        if self.load_plan is not None:
            metrics["recomputed_chunks"] = self.load_plan.recomputed
            if self._prefill_s:  # what the plan's estimate missed, for the next one
                runtime.controller.observe_plan(self.load_plan, self._prefill_s)
        if load is not None:
            metrics["chunk_tiers"].update(
                (str(cid), tier)
                for cid, tier in zip(chunk_ids[self.reused :], load.tiers, strict=True)
            )
            metrics["load_s"] = round(load.load_s, 4)
            metrics["hidden_load_fraction"] = round(load.hidden_load_fraction, 3)
            runtime.controller.observe_store_stats(runtime.store.stats().tiers)
        return metrics

    def _observe(self, result: BlendResult, wait_s: float) -> None:
        """What the prefill took, for the loading controller: a prefill that read no cached
        KV measures the recompute throughput; one that did, blend's cost per read token
        (``wait_s``, its time waiting for loads, left out)."""
        if not self._prefill_s:
            return
        controller, computed = self.runtime.controller, sum(result.recomputed_per_layer)
        read = (
            []
            if self.batch is None
            else [
                len(ids)
                for ids, loaded in zip(
                    self.fitted.chunks_tokens[self.reused :], self.batch.read, strict=True
                )
                if loaded
            ]
        )
        if not read and self.prefix is None:
            controller.observe_recompute(tokens=computed, layers=1, seconds=self._prefill_s)
            return
        read_tokens = sum(read) + (self.prefix.num_tokens if self.prefix is not None else 0)
        controller.observe_blend(
            read_token_layers=read_tokens * self.runtime.model.config.n_layers,
            computed_token_layers=computed,
            compute_s=self._prefill_s - wait_s,
        )

    def _keep_prefix(self, result: BlendResult) -> None:
        """This prompt's context KV (before the question part) for a follow-up, in the
        store's 16-bit type; after the answer, off the first token's path."""
        cache = self.runtime.prefix_cache
        if not self._keys or cache.capacity_bytes <= 0:
            return
        dtype = self.runtime.store.config.narrow_to or result.cache.k.dtype
        kv = PrefixKV.from_cache(result.cache, self._lengths[-1], dtype)
        cache.put(self._keys, self._lengths, kv)
