from __future__ import annotations

import logging
import time

import pytest
import torch

from deploy import services
from kvservice.protocol.errors import ChunkMissing, FingerprintMismatch, StoreUnavailable
from kvservice.protocol.keys import ChunkKey
from kvservice.store.config import StoreConfig
from kvservice.store.format import decode_header, encode_chunk
from kvservice.store.tiered import TieredStore

from .conftest import make_chunk


def _only_in_s3(store, chunk):
    key = store.put(chunk)
    store.drop_local(key)
    return key


def _replace_in_s3(store, key, data):
    store.tier("s3").put(key, data)


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "wrong_fingerprint"])
def test_bad_s3_object_is_detected_recomputed_and_replaced(store, recompute_from, damage, caplog):
    chunk = make_chunk(20)
    key = _only_in_s3(store, chunk)
    data = encode_chunk(chunk)
    if damage == "corrupt":
        data[decode_header(data).layer_offset(1) + 3] ^= 0x01
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = encode_chunk(make_chunk(20, fingerprint="another-model"))
    _replace_in_s3(store, key, data)

    recompute = recompute_from(chunk)
    with caplog.at_level(logging.WARNING):
        back = store.get_or_recompute(key, chunk.token_ids, recompute)
    assert torch.equal(back.k, chunk.k) and recompute.calls == 1
    assert store.stats().faults.get(damage) == 1 and store.stats().recomputes == 1
    assert "recomputing" in caplog.text and str(key) in caplog.text
    # the object was replaced: a fresh read from S3 is good again, no recompute
    store.drop_local(key)
    again = store.get_or_recompute(key, chunk.token_ids, recompute)
    assert torch.equal(again.v, chunk.v) and recompute.calls == 1


def test_wrong_fingerprint_raises_typed_error_without_recompute_fn(store):
    chunk = make_chunk(21)
    key = _only_in_s3(store, chunk)
    _replace_in_s3(store, key, encode_chunk(make_chunk(21, fingerprint="another-model")))
    with pytest.raises(FingerprintMismatch):
        store.get(key)


def test_corrupt_local_copy_falls_back_to_s3(store, recompute_from):
    chunk = make_chunk(22)
    key = store.put(chunk)
    bad = encode_chunk(chunk)
    bad[decode_header(bad).layer_offset(0)] ^= 0xFF
    store.tier("cpu").delete(key)
    store.tier("disk").put(key, bad)  # disk is an untrusted tier: verified on read
    recompute = recompute_from(chunk)
    back = store.get_or_recompute(key, chunk.token_ids, recompute)
    assert torch.equal(back.k, chunk.k) and recompute.calls == 0
    assert store.stats().faults == {"corrupt": 1}


def test_missing_chunk_is_recomputed_and_stored(store, recompute_from):
    chunk = make_chunk(23)
    key = ChunkKey.of(chunk)
    with pytest.raises(ChunkMissing):
        store.get(key)
    recompute = recompute_from(chunk)
    store.get_or_recompute(key, chunk.token_ids, recompute)
    assert recompute.calls == 1 and store.tier("s3").contains(key)


def test_s3_down_recomputes_quickly_with_a_clear_log(tmp_path, recompute_from, caplog):
    port = services.free_port(also_free_at_offset=10000)
    s3 = services.start_seaweedfs(
        tmp_path / "short-lived",
        port=port,
        access_key="ak",
        secret_key="sk-short-lived",
        buckets=("kvcache",),
    )
    fast_fail = {
        "KV_S3_CONNECT_TIMEOUT_S": "0.5",
        "KV_S3_RETRIES": "1",
        "KV_STORE_DTYPE": "float32",
    }
    config = StoreConfig.from_env({**s3.env, **fast_fail, "KV_DISK_CAPACITY_BYTES": "0"})
    store = TieredStore.from_config(config)
    chunk = make_chunk(24)
    key = _only_in_s3(store, chunk)
    s3.stop()

    recompute = recompute_from(chunk)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        back = store.get_or_recompute(key, chunk.token_ids, recompute)
    assert time.monotonic() - started < 5
    assert torch.equal(back.k, chunk.k) and recompute.calls == 1
    assert "S3 unreachable" in caplog.text and store.stats().faults["unavailable"] >= 1
    assert store.tier("cpu").contains(key)  # kept locally though S3 could not take it
    assert store.stats().write_through_failures == 1
    with pytest.raises(StoreUnavailable):  # fails fast while S3 is marked down
        store.put(make_chunk(25))
