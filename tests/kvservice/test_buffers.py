"""The pool of large CPU buffers a request's KV cache is made in (kvservice.store.buffers)."""

from __future__ import annotations

import gc

import torch

from kvservice.model.transformer import KVCache
from kvservice.store.buffers import MIN_BYTES, BufferPool

BIG = (MIN_BYTES // 4 + 1024,)  # float32 elements: just over the pool's least size


def test_a_buffer_comes_back_only_once_nothing_holds_it() -> None:
    pool = BufferPool(1 << 30)
    first = pool.empty(BIG, torch.float32)
    address = first.data_ptr()
    view = first[10:20]
    del first
    second = pool.empty(BIG, torch.float32)
    assert second.data_ptr() != address  # a view of the first still lives
    del view
    gc.collect()
    # any dtype and shape that fits, as uninitialized memory
    third = pool.empty((2, BIG[0]), torch.bfloat16)
    assert third.data_ptr() == address and third.dtype == torch.bfloat16
    assert third.shape == (2, BIG[0])
    assert pool.stats()["reused"] == 1 and pool.stats()["buffers"] == 2


def test_small_tensors_and_other_devices_are_plain_allocations() -> None:
    pool = BufferPool(1 << 30)
    small = pool.empty((16, 16), torch.float32)
    assert small.shape == (16, 16) and pool.stats()["buffers"] == 0
    meta = pool.empty(BIG, torch.float32, "meta")
    assert meta.device.type == "meta" and pool.stats()["buffers"] == 0


def test_the_pool_keeps_no_more_than_its_limit_and_drops_the_least_recent_unused() -> None:
    size = BIG[0] * 4
    pool = BufferPool(2 * size + 16)
    a = pool.empty(BIG, torch.float32)
    b = pool.empty(BIG, torch.float32)
    c = pool.empty(BIG, torch.float32)  # no room: a and b are in use
    assert pool.stats()["buffers"] == 2 and c.shape == BIG
    address_a = a.data_ptr()
    del a, c
    d = pool.empty((BIG[0] // 3,), torch.float32)  # too small for a's buffer: a new one
    assert d.data_ptr() != address_a
    assert pool.held_bytes <= pool.limit_bytes  # a's buffer dropped to make room
    assert pool.stats()["buffers"] == 2 and b.shape == BIG


def test_a_kv_cache_reuses_the_last_ones_memory_and_is_zeroed_where_it_is_read(
    tiny_llama,
) -> None:
    config = tiny_llama.config
    per_slot = config.n_layers * config.n_kv_heads * config.head_dim * 4
    capacity = MIN_BYTES // per_slot + 64  # over the pool's least size per tensor
    first = KVCache(config, 1, capacity, torch.device("cpu"))
    first.k.fill_(float("nan"))
    address = first.k.data_ptr()
    del first
    gc.collect()
    second = KVCache(config, 1, capacity, torch.device("cpu"), written_before_read=10)
    addresses = {second.k.data_ptr(), second.v.data_ptr()}
    assert address in addresses
    assert not second.k[:, :, :, 10:].isnan().any()  # the slots read before written: zeros


def test_buffers_of_the_same_size_are_told_apart() -> None:
    pool = BufferPool(1 << 30)
    held = [pool.empty(BIG, torch.float32) for _ in range(3)]
    addresses = [t.data_ptr() for t in held]
    del held[1]
    again = pool.empty(BIG, torch.float32)  # the middle one, the only one free
    assert again.data_ptr() == addresses[1]
    assert pool.stats() == {"buffers": 3, "held_bytes": 3 * BIG[0] * 4, "handed": 4, "reused": 1}


def test_without_torchs_use_count_the_pool_hands_out_plain_tensors(monkeypatch) -> None:
    from kvservice.store import buffers

    monkeypatch.setattr(buffers, "_use_count", None)
    pool = BufferPool(1 << 30)
    tensor = pool.empty(BIG, torch.float32)
    assert tensor.shape == BIG and pool.stats()["buffers"] == 0
