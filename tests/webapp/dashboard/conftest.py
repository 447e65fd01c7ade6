from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from kvservice.blend.controller import LoadingController
from kvservice.chunk import ChunkKV
from kvservice.protocol.heartbeat import heartbeat_key, write_heartbeat
from kvservice.store.disk import DiskTier
from kvservice.store.memory import MemoryTier
from kvservice.store.tiered import TieredStore


@pytest.fixture(autouse=True)
def no_ratio_curve(settings, tmp_path):
    """No measured ratio curve unless a test writes one (the repository's own
    docs/ratio_curve.json would add a chart to every page)."""
    settings.RATIO_CURVE_PATH = tmp_path / "ratio_curve.json"


@pytest.fixture
def staff_client(client, staff):
    client.force_login(staff)
    return client


def _chunk(seed: int, tokens: int = 48) -> ChunkKV:
    gen = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, 49_000, (tokens,), generator=gen).tolist()
    k = torch.randn(4, 2, tokens, 16, generator=gen)
    v = torch.randn(4, 2, tokens, 16, generator=gen)
    return ChunkKV(token_ids, k, v, "dashboard-test@0", "head-0")


@pytest.fixture
def worker_heartbeat(tmp_path) -> Iterator[dict]:
    """A heartbeat as the inference worker writes it, from a real TieredStore (CPU + disk
    tiers that served real reads) and a real LoadingController that made a decision."""
    store = TieredStore([MemoryTier(8 * 2**20), DiskTier(tmp_path / "kv", 32 * 2**20)])
    keys = [store.put(_chunk(seed), tiers=["disk"], write_through=False) for seed in range(3)]
    for key in keys:
        store.get(key)  # a CPU miss, a disk hit, promoted into CPU
    store.get(keys[0])  # a CPU hit
    controller = LoadingController(r_min=0.15)
    controller.observe_store_stats(store.stats().tiers)
    controller.observe_recompute(tokens=512, layers=30, seconds=0.02)
    controller.choose(
        num_tokens=1500, num_layers=30, load_bytes_by_tier={"cpu": 40 * 2**20, "disk": 2**20}
    )
    beat = {
        "pid": os.getpid(),
        "model": "SmolLM2-135M-Instruct",
        "model_loaded": True,
        "store": store.stats().to_dict(),
        "controller": controller.snapshot(),
    }
    from webapp.redis import redis_client

    write_heartbeat(redis_client(), **beat)
    yield beat
    redis_client().delete(heartbeat_key())
