from __future__ import annotations

import torch

from kvservice.store.device import DeviceTier
from kvservice.store.disk import DiskTier
from kvservice.store.format import (
    HEADER_PROBE_BYTES,
    decode_chunk,
    decode_header,
    decode_layer,
    encode_chunk,
)
from kvservice.store.keys import ChunkKey
from kvservice.store.memory import MemoryTier
from kvservice.store.s3 import S3Tier

from .conftest import L, make_chunk


def _tiers(store_config, tmp_path):
    return [
        DeviceTier(1 << 20, device="cpu"),  # the device tier's code path, on the CPU here
        MemoryTier(1 << 20),
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
