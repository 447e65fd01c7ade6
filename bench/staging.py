"""The store side of the prefill bench: where chunk KV starts before timing (``--tier``),
pipelined or not (``--no-pipeline``), and what each mode's loading cost.

Before any timing, :meth:`StoreBench.stage` writes the example's chunks into the chosen tier
only (CPU memory, a local-disk directory, or S3: ``S3_ENDPOINT`` from the environment, else
a SeaweedFS gateway started for the run, ``bench.s3``). Inside the timed prefill,
:meth:`StoreBench.sources` opens the chunks through the pipelined loader, so the blender
reads each layer as it arrives. Promotion is off, so every repeat starts from the same tier.
Store settings (``KV_QUANTIZE``, ``KV_LOAD_WORKERS``, ``KV_PREFETCH_DEPTH``) come from the
environment as everywhere else.
"""

from __future__ import annotations

import atexit
import logging
import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.s3 import gateway_unless_configured
from kvservice.chunk import ChunkKV, LayeredKV
from kvservice.controller import choose_ratio
from kvservice.store.config import StoreConfig
from kvservice.store.disk import DiskTier
from kvservice.store.keys import ChunkKey
from kvservice.store.loader import KVLoader, LoadBatch, LoadStats
from kvservice.store.memory import MemoryTier
from kvservice.store.s3 import S3Tier
from kvservice.store.tiered import TieredStore

log = logging.getLogger(__name__)

TIERS = ("cpu", "disk", "s3")


class StoreBench:
    def __init__(
        self, tier: str = "cpu", *, pipeline: bool = True, environ: dict[str, str] | None = None
    ) -> None:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        self.tier = tier
        self.pipeline = pipeline
        env = dict(os.environ if environ is None else environ)
        self._tmp = tempfile.TemporaryDirectory(prefix="kv-bench-")
        root = Path(self._tmp.name)
        self._gateway = gateway_unless_configured(env, root) if tier == "s3" else None
        if self._gateway is not None:
            env.update(self._gateway.env)
        env.setdefault("KV_S3_PREFIX", f"bench-{os.getpid()}/")
        self.config = StoreConfig.from_env(env)
        tiers: list[Any] = [MemoryTier(1 << 40), DiskTier(root / "disk", 1 << 40)]
        if tier == "s3":
            tiers.append(S3Tier(self.config))
        self.store = TieredStore(tiers, quantize=self.config.quantize, config=self.config)
        self.loader = KVLoader(self.store, pipeline=pipeline, promote=False)
        self._keys: dict[int, ChunkKey] = {}
        self._chunk_tokens = 0
        self._pending: dict[str, list[LoadBatch]] = {}
        self._stats: dict[str, list[LoadStats]] = {}

    def stage(self, chunks: Sequence[ChunkKV]) -> None:
        """Put the example's chunks into the chosen tier, and nowhere else (not timed)."""
        self._pending, self._stats = {}, {}
        for key in self._keys.values():
            self.store.drop_local(key)
        self._keys = {}
        self._chunk_tokens = sum(chunk.num_tokens for chunk in chunks)
        for chunk in chunks:
            key = self.store.put(
                chunk,
                tiers=[] if self.tier == "s3" else [self.tier],
                write_through=self.tier == "s3",
            )
            self._keys[id(chunk)] = key
        log.info("staged %d chunks in the %s tier", len(chunks), self.tier)

    def sources(
        self, chunks: Sequence[ChunkKV], mode: str, *, key: str | None = None
    ) -> list[LayeredKV | None]:
        """What the blender reads in ``mode``: ``full`` reads no cached KV; ``prefix`` only
        the first chunk's (the others are computed: None); ``reuse``/``blend`` every chunk's.
        The loads are reported under ``key`` (the bench's run key, e.g. ``blend@0.05``;
        default the mode)."""
        self._settle()
        if mode == "full":
            return list(chunks)
        wanted = chunks[:1] if mode == "prefix" else chunks
        keys = [self._keys[id(chunk)] for chunk in wanted]
        batch = self.loader.open(keys, token_ids=[chunk.token_ids for chunk in wanted])
        self._pending.setdefault(key or mode, []).append(batch)
        return [*batch, *([None] * (len(chunks) - len(wanted)))]

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
        controller is the ``full`` prefill's: ``prompt_tokens * num_layers / full_ttft_s``."""
        self._settle()
        stats = self._stats.get(mode, [])
        if not stats:  # this mode read no cached KV
            return {
                "tier": self.tier,
                "load_s": 0.0,
                "hidden_load_fraction": None,
                "ratio_chosen": None,
            }
        throughput = prompt_tokens * num_layers / full_ttft_s if full_ttft_s else None
        bandwidth = {s.name: s.read_bandwidth_bytes_per_s for s in self.store.stats().tiers}
        decision = choose_ratio(
            num_tokens=self._chunk_tokens, num_layers=num_layers,
            load_bytes_by_tier=stats[-1].tier_bytes, tier_bandwidth=bandwidth,
            recompute_token_layers_per_s=throughput,
        )  # fmt: skip
        return {
            "tier": self.tier,
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
        if self._gateway is not None:
            self._gateway.stop()
            self._gateway = None
        self._tmp.cleanup()


_BENCHES: dict[tuple[str, bool], StoreBench] = {}


def store_bench(tier: str, pipeline: bool) -> StoreBench:
    """One StoreBench per (tier, pipeline) in the process, closed at exit."""
    key = (tier, pipeline)
    if key not in _BENCHES:
        _BENCHES[key] = StoreBench(tier, pipeline=pipeline)
        atexit.register(_BENCHES[key].close)
    return _BENCHES[key]
