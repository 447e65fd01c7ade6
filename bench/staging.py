"""The store side of the prefill bench: where chunk KV starts before timing (``--tier``),
pipelined or not (``--no-pipeline``), and what each mode's loading cost.

Before any timing, :meth:`StoreBench.stage` writes the example's chunks into the chosen tier
only (CPU memory, a local-disk directory, or S3: ``S3_ENDPOINT`` from the environment, else
a SeaweedFS gateway started for the run, ``bench.s3``). Inside the timed prefill,
:meth:`StoreBench.sources` opens the chunks through the pipelined loader, so the blender
reads each layer as it arrives. Promotion is off, so every repeat starts from the same tier.
Store settings (``KV_CODEC``, ``KV_LOAD_WORKERS``, ``KV_PREFETCH_DEPTH``) come from the
environment as everywhere else.

The GPU regime on this machine (``--tier s3 --s3-mbps N|auto``): S3 is read through a
throttling proxy (``bench.throttle``) at N MB/s, or, per example, at the rate that makes the
prompt's fp16 KV take as long to read as the example's full prefill took (``auto``; ``4xauto``
four times that). The loading controller then chooses per chunk whether to read it or to
recompute it whole (``kvservice.blend.controller.choose_loads``), given the link's rate and the
recompute throughput of the example's full prefill; ``--load-all`` reads every chunk.
"""

from __future__ import annotations

import atexit
import logging
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.s3 import gateway_unless_configured
from bench.throttle import ThrottlingProxy
from kvservice.blend.controller import ChunkLoad, LoadingController, LoadPlan, choose_ratio
from kvservice.chunk import ChunkKV, LayeredKV
from kvservice.protocol.keys import ChunkKey
from kvservice.store import KVLoader, LoadBatch, LoadStats
from kvservice.store.config import StoreConfig
from kvservice.store.device import DeviceTier
from kvservice.store.disk import DiskTier
from kvservice.store.memory import MemoryTier
from kvservice.store.s3 import S3Tier
from kvservice.store.tiered import TieredStore

log = logging.getLogger(__name__)

# device: the GPU tier (compressed objects in the model's device memory, decoded at use);
# kdn: through the knowledge delivery API (bench.kdn)
TIERS = ("device", "cpu", "disk", "s3", "kdn")


def on_device(chunk: ChunkKV, device: torch.device) -> ChunkKV:
    """``chunk`` with its KV on ``device`` (itself where it is there already)."""
    if chunk.k.device == device:
        return chunk
    return ChunkKV(
        chunk.token_ids,
        chunk.k.to(device),
        chunk.v.to(device),
        chunk.model_fingerprint,
        chunk.head_hash,
    )


def parse_link_rate(text: str) -> tuple[float | None, float | None]:
    """``--s3-mbps``: ``N`` (MB/s) -> (N, None); ``auto`` -> (None, 1.0); ``4xauto`` ->
    (None, 4.0): a multiple of the per-example rate at which fp16 KV loads as long as full
    prefill takes."""
    text = text.strip().lower()
    if text.endswith("auto"):
        scale = float(text.removesuffix("auto").removesuffix("x") or 1.0)
        if not scale > 0:
            raise ValueError(f"--s3-mbps {text!r}: the multiple of auto must be above 0")
        return None, scale
    mbps = float(text)
    if not mbps > 0:
        raise ValueError(f"--s3-mbps {text!r}: a rate above 0 MB/s, or auto")
    return mbps, None


class StoreBench:
    def __init__(
        self,
        tier: str = "cpu",
        *,
        pipeline: bool = True,
        environ: dict[str, str] | None = None,
        s3_mbps: float | None = None,
        load_all: bool = False,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        """``s3_mbps``: read S3 through a throttling proxy at that rate (see
        :meth:`set_link`); ``load_all``: read every chunk even where recomputing it would be
        faster; ``device`` and ``dtype``: where and as what the loader decodes the chunks'
        layers (the model's device and KV cache dtype, as the inference worker does)."""
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        self.tier = tier
        self.pipeline = pipeline
        self.load_all = load_all
        env = dict(os.environ if environ is None else environ)
        self._tmp = tempfile.TemporaryDirectory(prefix="kv-bench-")
        root = Path(self._tmp.name)
        self._gateway = gateway_unless_configured(env, root) if tier == "s3" else None
        if self._gateway is not None:
            env.update(self._gateway.env)
        self.proxy: ThrottlingProxy | None = None
        if tier == "s3" and s3_mbps is not None:
            self.proxy = ThrottlingProxy(env["S3_ENDPOINT"], mbps=s3_mbps).start()
            env["S3_ENDPOINT"] = self.proxy.endpoint
        env.setdefault("KV_S3_PREFIX", f"bench-{os.getpid()}/")
        self.config = StoreConfig.from_env(env)
        self._device = torch.device(device)
        pinned = self._device.type == "cuda"  # as the inference worker's store is
        tiers: list[Any] = [MemoryTier(1 << 40, pinned=pinned), DiskTier(root / "disk", 1 << 40)]
        if tier == "device":
            tiers.insert(0, DeviceTier(1 << 40, device))
        if tier == "s3":
            tiers.append(S3Tier(self.config))
        self.store = TieredStore(tiers, quantize=self.config.quantize, config=self.config)
        self.loader = KVLoader(
            self.store, pipeline=pipeline, promote=False, device=device, dtype=dtype
        )
        self._keys: dict[int, ChunkKey] = {}
        self._sizes: dict[int, int] = {}  # stored object bytes per chunk
        self._encoded: dict[ChunkKey, bytearray] = {}  # a staged chunk is encoded once
        self._chunk_tokens = 0
        self.fp16_bytes = 0  # the staged chunks' KV at 2 bytes a value
        self._pending: dict[str, list[LoadBatch]] = {}
        self._stats: dict[str, list[LoadStats]] = {}
        self._plans: dict[str, LoadPlan] = {}
        self.controller = LoadingController(smoothing=1.0)  # this example's measurements
        self._question_tokens = 0
        self._num_layers = 0

    def stage(self, chunks: Sequence[ChunkKV], **_texts: Any) -> None:
        """Put the example's chunks into the chosen tier, and nowhere else (not timed); the
        passages' texts (``bench.kdn``'s stage) are not needed here."""
        self._pending, self._stats, self._plans = {}, {}, {}
        # a new example's measurements, but what reading costs beyond the link is the
        # machine's: it carries over (as it does in the inference worker's one controller)
        overhead = self.controller.overhead_s_per_byte
        self.controller = LoadingController(smoothing=1.0)
        self.controller.overhead_s_per_byte = overhead
        for key in self._keys.values():
            self.store.drop_local(key)
        self._keys, self._sizes = {}, {}
        self._chunk_tokens = sum(chunk.num_tokens for chunk in chunks)
        self.fp16_bytes = sum(2 * (chunk.k.numel() + chunk.v.numel()) for chunk in chunks)
        encoded, self._encoded = self._encoded, {}  # re-staging the same chunks reuses them
        for chunk in chunks:
            key = ChunkKey.of(chunk)
            data = encoded.get(key)
            if data is None:  # encoded on the model's device, as the ingest worker does
                data = self.store.encode(on_device(chunk, self._device))
            self._encoded[key] = data
            self.store.put_encoded(
                key,
                data,
                tiers=[] if self.tier == "s3" else [self.tier],
                write_through=self.tier == "s3",
            )
            self._keys[id(chunk)] = key
            self._sizes[id(chunk)] = len(data)
        log.info("staged %d chunks in the %s tier", len(chunks), self.tier)

    @property
    def s3_mbps(self) -> float | None:
        return self.proxy.mbps if self.proxy is not None else None

    def set_link(self, mbps: float) -> None:
        """The throttled link's rate from now on, in MB/s (10^6 bytes)."""
        if self.proxy is None:
            raise RuntimeError("no throttled link: StoreBench(tier='s3', s3_mbps=...)")
        self.proxy.mbps = mbps

    def observe_full(self, *, prompt_tokens: int, num_layers: int, seconds: float) -> None:
        """The example's full prefill took ``seconds``: the recompute throughput the per-chunk
        choice weighs loads against."""
        self.controller.observe_recompute(tokens=prompt_tokens, layers=num_layers, seconds=seconds)
        self._question_tokens = max(0, prompt_tokens - self._chunk_tokens)
        self._num_layers = num_layers

    def observe_blend(self, *, computed_token_layers: int, seconds: float) -> None:
        """The example's blend took ``seconds`` with every chunk's KV in memory: what blend
        costs per read token, beyond the tokens it computes (after :meth:`observe_full`)."""
        self.controller.observe_blend(
            read_token_layers=self._chunk_tokens * self._num_layers,
            computed_token_layers=computed_token_layers,
            compute_s=seconds,
        )

    def observe_run(self, key: str, seconds: float) -> None:
        """The run ``key`` just took ``seconds`` to its first token: the loading controller
        learns what its plan's estimate missed (``LoadingController.observe_plan``), as the
        inference worker does after every request."""
        plan = self._plans.get(key)
        if plan is not None:
            self.controller.observe_plan(plan, seconds)

    def plan(self, chunks: Sequence[ChunkKV], ratio: float) -> LoadPlan | None:
        """The loading controller's per-chunk choice over the throttled link, or None where
        every chunk is read (no throttled link, ``load_all``, full not measured yet)."""
        if self.proxy is None or self.load_all:
            return None
        if self.controller.recompute_token_layers_per_s is None:
            return None
        self.controller.observe_tier_bandwidths({"s3": self.proxy.mbps * 1e6})
        return self.controller.choose_loads(
            chunks=[ChunkLoad(c.num_tokens, self._sizes[id(c)], "s3") for c in chunks],
            question_tokens=self._question_tokens,
            num_layers=self._num_layers,
            recompute_ratio=ratio,
        )

    def sources(
        self, chunks: Sequence[ChunkKV], mode: str, *, key: str | None = None, ratio: float = 0.0
    ) -> list[LayeredKV | None]:
        """What the blender reads in ``mode``: ``full`` reads no cached KV; ``prefix`` only
        the first chunk's (the others are computed: None); ``reuse``/``blend`` every chunk's
        the loading controller chooses to read (:meth:`plan`; the others are recomputed:
        None). The loads are reported under ``key`` (the bench's run key, e.g.
        ``blend@0.05``; default the mode)."""
        self._settle()
        if mode == "full":
            return list(chunks)
        read = [True] * len(chunks) if mode != "prefix" else [i == 0 for i in range(len(chunks))]
        plan = self.plan(chunks, ratio) if mode != "prefix" else None
        if plan is not None:
            read = list(plan.load)
            self._plans[key or mode] = plan
        wanted = [chunk for chunk, load in zip(chunks, read, strict=True) if load]
        if not wanted:  # the link is so slow that every chunk is recomputed
            return [None] * len(chunks)
        keys = [self._keys[id(chunk)] for chunk in wanted]
        batch = self.loader.open(keys, token_ids=[chunk.token_ids for chunk in wanted])
        self._pending.setdefault(key or mode, []).append(batch)
        loaded = iter(batch)
        return [next(loaded) if load else None for load in read]

    def _settle(self) -> None:
        for mode, batches in self._pending.items():
            self._stats.setdefault(mode, []).extend(batch.stats() for batch in batches)
        self._pending = {}

    def report(
        self, mode: str, *, prompt_tokens: int, num_layers: int, full_ttft_s: float | None
    ) -> dict[str, Any]:
        """``load_s``, ``hidden_load_fraction`` (medians over the repeats) and the loading
        controller's ``ratio_chosen`` for this example, for the loads made under ``mode`` (or
        the run key given to :meth:`sources`). The recompute throughput fed to the
        controller is the ``full`` prefill's: ``prompt_tokens * num_layers / full_ttft_s``.
        Also ``kv_bytes_per_token`` (the stored objects' bytes a chunk token, in the codec
        they were written in), ``s3_mbps`` (the throttled link's rate, None unthrottled) and,
        where the per-chunk choice ran, ``recomputed_chunks`` and ``load_plan``."""
        self._settle()
        stats = self._stats.get(mode, [])
        plan = self._plans.get(mode)
        common = {
            "tier": self.tier,
            "kv_bytes_per_token": sum(self._sizes.values()) / max(1, self._chunk_tokens),
            "s3_mbps": self.s3_mbps,
            **({"recomputed_chunks": plan.recomputed, "load_plan": plan.to_dict()} if plan else {}),
        }
        if not stats:  # this mode read no cached KV
            return common | {"load_s": 0.0, "hidden_load_fraction": None, "ratio_chosen": None}
        throughput = prompt_tokens * num_layers / full_ttft_s if full_ttft_s else None
        bandwidth = {s.name: s.read_bandwidth_bytes_per_s for s in self.store.stats().tiers}
        decision = choose_ratio(
            num_tokens=self._chunk_tokens,
            num_layers=num_layers,
            load_bytes_by_tier=stats[-1].tier_bytes,
            tier_bandwidth=bandwidth,
            recompute_token_layers_per_s=throughput,
        )
        return common | {
            "pipelined": self.pipeline,
            "load_s": statistics.median(s.load_s for s in stats),
            "load_wait_s": statistics.median(s.wait_s for s in stats),
            "hidden_load_fraction": statistics.median(s.hidden_load_fraction for s in stats),
            "load_bytes": stats[-1].bytes_read,
            "ratio_chosen": decision.recompute_ratio,
            "ratio_why": decision.why["rule"],
            "cheapest_hidden_tier": decision.cheapest_hidden_tier,
        }

    def close(self) -> None:
        self.loader.close()
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        if self._gateway is not None:
            self._gateway.stop()
            self._gateway = None
        self._tmp.cleanup()


_BENCHES: dict[tuple[str, bool, float | None, bool], StoreBench] = {}


def store_bench(
    tier: str,
    pipeline: bool,
    *,
    s3_mbps: float | None = None,
    load_all: bool = False,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> StoreBench:
    """One StoreBench per (tier, pipeline, link, device, dtype) in the process, closed at
    exit. ``cuda`` and ``cuda:0`` are one device here: staging and reading must find the same
    bench."""
    key = (tier, pipeline, s3_mbps, load_all, canonical_device(device), dtype)
    if key not in _BENCHES:
        _BENCHES[key] = StoreBench(
            tier,
            pipeline=pipeline,
            s3_mbps=s3_mbps,
            load_all=load_all,
            device=device,
            dtype=dtype,
        )
        atexit.register(_BENCHES[key].close)
    return _BENCHES[key]


def canonical_device(device: torch.device | str) -> str:
    """``device`` with its index: ``cuda`` is the current CUDA device's (``cuda:0``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


UNTHROTTLED_MBPS = 1e6  # the link's rate under ``auto`` until the example's full is measured


def bench_of(args: Any, tier: str) -> StoreBench:
    """The StoreBench of ``tier`` under the bench's flags: ``--no-pipeline``, ``--s3-mbps``
    (``args.s3_link``, from :func:`parse_link_rate`), ``--load-all``; ``kdn``: the
    knowledge delivery API's (``bench.kdn``, ``--kdn-url``/``--kdn-key``)."""
    dtype = getattr(args, "kv_dtype", None)  # the model's cache dtype, set once it is built
    if tier == "kdn":
        from bench.kdn import kdn_bench

        return kdn_bench(args.kdn_url, args.kdn_key, getattr(args, "precision", None), dtype)
    mbps, scale = getattr(args, "s3_link", (None, None))
    device = getattr(args, "device", "cpu")
    if tier != "s3" or (mbps is None and scale is None):
        return store_bench(tier, not args.no_pipeline, device=device, dtype=dtype)
    return store_bench(
        tier,
        not args.no_pipeline,
        s3_mbps=mbps or UNTHROTTLED_MBPS,
        load_all=getattr(args, "load_all", False),
        device=device,
        dtype=dtype,
    )


def after_full(
    args: Any,
    tier: str,
    *,
    prompt_tokens: int,
    num_layers: int,
    seconds: float,
    blend_in_memory: Callable[[], tuple[float, int]] | None = None,
) -> None:
    """The example's full prefill took ``seconds``: under ``--s3-mbps auto`` the link is set
    to read the prompt's fp16 KV in as long (times the multiple), and the per-chunk choice
    weighs loads against full's recompute throughput and against blend's own cost per read
    token, from ``blend_in_memory()`` (seconds and computed token-layers of a blend with
    every chunk in memory; not counted in the results)."""
    bench = bench_of(args, tier)
    if bench.proxy is None:
        return
    _, scale = args.s3_link
    if scale is not None:
        bench.set_link(scale * bench.fp16_bytes / seconds / 1e6)
    bench.observe_full(prompt_tokens=prompt_tokens, num_layers=num_layers, seconds=seconds)
    if blend_in_memory is not None:
        blend_s, computed = blend_in_memory()
        bench.observe_blend(computed_token_layers=computed, seconds=blend_s)
