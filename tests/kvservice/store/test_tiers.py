from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.objects import HEADER_PROBE_BYTES
from kvservice.store.config import StoreConfig
from kvservice.store.device import DeviceTier
from kvservice.store.disk import DiskTier
from kvservice.store.format import (
    decode_chunk,
    decode_header,
    decode_layer,
    encode_chunk,
)
from kvservice.store.memory import MemoryTier
from kvservice.store.s3 import S3Tier
from kvservice.store.tiered import TieredStore

from .conftest import L, make_chunk

CUDA = torch.cuda.is_available()


def _tiers(store_config, tmp_path):
    return [
        DeviceTier(1 << 20, device="cpu"),  # the device tier's code path, on the CPU here
        MemoryTier(1 << 20),
        *([MemoryTier(1 << 20, pinned=True)] if CUDA else []),
        DiskTier(tmp_path / "disk", 1 << 20),
        S3Tier(store_config),
    ]


def test_exact_round_trip_and_ranged_layer_reads_through_every_tier(store_config, tmp_path):
    chunk = make_chunk(10)
    key = ChunkKey.of(chunk)
    data = encode_chunk(chunk)
    for tier in _tiers(store_config, tmp_path):
        assert not tier.contains(key)
        assert tier.get(key) is None
        tier.put(key, data)
        assert tier.contains(key), tier.name
        back = decode_chunk(tier.get(key), key)
        assert torch.equal(back.k, chunk.k) and torch.equal(back.v, chunk.v), tier.name
        header = decode_header(tier.read_range(key, 0, HEADER_PROBE_BYTES))
        for i in reversed(range(L)):  # any order: each layer is its own ranged read
            block = tier.read_range(key, header.layer_offset(i), header.layer_size(i))
            k, v = decode_layer(header, i, block)
            assert torch.equal(k, chunk.k[i]) and torch.equal(v, chunk.v[i]), (tier.name, i)
        stats = tier.stats()
        assert stats.hits >= L + 2 and stats.misses == 1 and stats.bytes_read > header.layers_bytes
        assert stats.read_bandwidth_bytes_per_s and stats.read_bandwidth_bytes_per_s > 0
        assert tier.delete(key) and not tier.contains(key)


def test_lru_evicts_least_recently_used_by_bytes(tmp_path):
    chunks = [make_chunk(i) for i in range(4)]
    encoded = [encode_chunk(c) for c in chunks]
    keys = [ChunkKey.of(c) for c in chunks]
    size = len(encoded[0])
    for tier in (MemoryTier(3 * size), DiskTier(tmp_path / "d", 3 * size)):
        for key, data in zip(keys[:3], encoded[:3], strict=True):
            tier.put(key, data)
        assert tier.get(keys[0]) is not None  # 0 is now the most recent; 1 the least
        tier.put(keys[3], encoded[3])
        assert [tier.contains(k) for k in keys] == [True, False, True, True], tier.name
        stats = tier.stats()
        assert (stats.entries, stats.bytes, stats.evictions) == (3, 3 * size, 1)
        tier.put(keys[1], bytes(4 * size))  # larger than the whole tier: not stored
        assert not tier.contains(keys[1])


def test_disk_tier_keeps_objects_across_restarts(tmp_path):
    chunk = make_chunk(11)
    key = ChunkKey.of(chunk)
    DiskTier(tmp_path / "d", 1 << 20).put(key, encode_chunk(chunk))
    again = DiskTier(tmp_path / "d", 1 << 20)
    assert again.contains(key) and again.stats().entries == 1
    assert torch.equal(decode_chunk(again.get(key)).k, chunk.k)


def test_put_writes_through_to_s3_and_hit_promotes(store):
    chunk = make_chunk(12)
    key = store.put(chunk)
    assert [t.name for t in store.tiers] == ["cpu", "disk", "s3"]
    assert store.tier("cpu").contains(key) and store.tier("s3").contains(key)
    assert not store.tier("disk").contains(key)

    store.drop_local(key)
    assert store.where(key) == "s3"
    back = store.get(key)
    assert torch.equal(back.k, chunk.k) and back.token_ids == chunk.token_ids
    assert store.tier("cpu").contains(key) and store.tier("disk").contains(key)  # promoted
    assert store.where(key) == "cpu"

    store.tier("cpu").delete(key)
    store.get(key)
    stats = {s.name: s for s in store.stats().tiers}
    assert stats["disk"].hits >= 2 and stats["cpu"].misses >= 1
    assert store.tier("cpu").contains(key)


def test_identical_chunks_share_one_object(store):
    chunk = make_chunk(13)
    twin = make_chunk(13)  # same tokens, e.g. the same paragraph in another document
    assert store.put(chunk) == store.put(twin)
    assert store.tier("cpu").stats().entries == 1


def test_stats_snapshot_is_plain_data(store):
    store.put(make_chunk(14))
    snapshot = store.stats().to_dict()
    assert snapshot["tiers"][0]["name"] == "cpu" and snapshot["tiers"][0]["entries"] == 1
    assert snapshot["tiers"][-1]["entries"] is None  # S3 is not listed on every snapshot
    import json

    json.dumps(snapshot)


def test_warm_copies_a_chunk_into_a_named_tier(store):
    chunk = make_chunk(15)
    key = store.put(chunk, tiers=[])
    assert store.where(key) == "s3"
    assert store.warm(key, "disk") and store.where(key) == "disk"
    assert store.warm(key, "cpu") and store.where(key) == "cpu"
    assert torch.equal(store.get(key).k, chunk.k)


def test_the_disk_tier_lives_under_the_data_dir_unless_told(tmp_path, monkeypatch):
    data = tmp_path / "data"
    config = StoreConfig.from_env({"DATA_DIR": str(data)})
    assert config.disk_dir == str(data / "kv-disk")
    store = TieredStore.from_config(replace(config, cpu_capacity_bytes=0))
    assert store.tier("disk").root == data / "kv-disk" and (data / "kv-disk").is_dir()
    told = str(tmp_path / "elsewhere")
    assert StoreConfig.from_env({"DATA_DIR": str(data), "KV_DISK_DIR": told}).disk_dir == told
    monkeypatch.chdir(tmp_path)  # no DATA_DIR: .ragblend in the working directory
    assert StoreConfig.from_env({}).disk_dir == str(tmp_path.resolve() / ".ragblend" / "kv-disk")
    assert StoreConfig().disk_dir == str(Path(".ragblend", "kv-disk"))


def test_the_cpu_tier_is_pinned_where_cuda_is_unless_told(tmp_path):
    def memory_tier(**env):
        config = StoreConfig.from_env({"KV_DISK_CAPACITY_BYTES": "0", **env})
        return TieredStore.from_config(config).tier("cpu")

    assert memory_tier().pinned == CUDA
    assert memory_tier(KV_CPU_PINNED="auto").pinned == CUDA
    assert not memory_tier(KV_CPU_PINNED="false").pinned
    with pytest.raises(ValueError, match="KV_CPU_PINNED"):
        StoreConfig.from_env({"KV_CPU_PINNED": "sometimes"})
    if not CUDA:
        with pytest.raises(ValueError, match="needs CUDA"):
            memory_tier(KV_CPU_PINNED="true")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_pinned_tier_holds_page_locked_blocks_and_counts_their_size():
    chunk = make_chunk(12)
    key, data = ChunkKey.of(chunk), encode_chunk(chunk)
    tier = MemoryTier(1 << 20, pinned=True)
    tier.put(key, data)
    block = tier.read_range(key, 0, len(data))
    assert isinstance(block, torch.Tensor) and block.is_pinned()
    assert bytes(block.numpy()) == bytes(data)
    footprint = 1 << (len(data) - 1).bit_length()  # torch's host allocator: powers of two
    assert tier.stats().bytes == footprint >= len(data)


def test_a_streams_pauses_are_not_counted_as_the_s3_tiers_read_time(store_config):
    """The loader keeps a chunk's stream open while it decodes the layers it has and reads
    other chunks' streams in turn: the tier's measured bandwidth (which the loading
    controller plans with) is its reads' rate, not bytes over the stream's whole life."""
    tier = S3Tier(store_config)
    key = ChunkKey.for_tokens("meter-test", "", [1, 2, 3])
    size, pieces, pause_s = 8 << 20, 8, 0.25
    tier.put(key, bytearray(size))
    with tier.open_stream(key, 0) as stream:
        assert stream is not None
        buffer = memoryview(bytearray(size // pieces))
        for _ in range(pieces):
            got = 0
            while got < len(buffer):
                n = stream.readinto(buffer[got:])
                assert n > 0
                got += n
            time.sleep(pause_s)  # the reader decoding a layer
    stats = tier.stats()
    paused_s = pieces * pause_s
    print(f"read {stats.bytes_read} bytes in {stats.read_busy_s:.3f} s, paused {paused_s} s")
    assert stats.bytes_read == size
    assert stats.read_busy_s < paused_s / 2, stats
