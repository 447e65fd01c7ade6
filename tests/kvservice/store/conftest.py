from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvservice.chunk import ChunkKV
from kvservice.store.config import StoreConfig
from kvservice.store.tiered import TieredStore

FINGERPRINT = "test-model@abc123"
HEAD_HASH = "head-0001"
L, H, T, D = 4, 2, 17, 8


def make_chunk(
    seed: int = 0,
    *,
    tokens: int = T,
    dtype: torch.dtype = torch.float32,
    fingerprint: str = FINGERPRINT,
) -> ChunkKV:
    gen = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, 50_000, (tokens,), generator=gen).tolist()
    k = torch.randn(L, H, tokens, D, generator=gen).to(dtype)
    v = torch.randn(L, H, tokens, D, generator=gen).to(dtype)
    return ChunkKV(token_ids, k, v, fingerprint, HEAD_HASH)


@pytest.fixture
def store_config(s3_service, tmp_path: Path) -> StoreConfig:
    """Config against the real S3 gateway, each test under its own key prefix."""
    env = dict(s3_service.env)
    env.update(
        {
            "KV_S3_PREFIX": f"test-{uuid.uuid4().hex[:12]}/",
            "KV_DISK_DIR": str(tmp_path / "disk"),
            "KV_CPU_CAPACITY_BYTES": "64MiB",
            "KV_DISK_CAPACITY_BYTES": "64MiB",
            "KV_S3_BUCKET": "kvcache",
            "KV_STORE_DTYPE": "float32",  # exact round trips; narrowing is tested in test_format
            "KV_CODEC": "fp16",  # unquantized; the codecs are tested in test_codec
        }
    )
    return StoreConfig.from_env(env)


@pytest.fixture
def store(store_config: StoreConfig) -> TieredStore:
    return TieredStore.from_config(store_config)


@pytest.fixture
def recompute_from(request) -> Callable[[ChunkKV], Callable[[list[int]], ChunkKV]]:
    """recompute_fn for a known chunk: returns it (as a model would), counting calls."""

    def factory(chunk: ChunkKV):
        def recompute(token_ids: list[int]) -> ChunkKV:
            assert token_ids == chunk.token_ids
            recompute.calls += 1
            return chunk

        recompute.calls = 0
        return recompute

    return factory
