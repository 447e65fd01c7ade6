from __future__ import annotations

import pytest
import torch

from kvservice.protocol.errors import ChunkCorrupt, ChunkTruncated, FingerprintMismatch
from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.objects import HEADER_PROBE_BYTES, K_PRE_ROPE
from kvservice.store.format import (
    decode_chunk,
    decode_header,
    decode_layer,
    decode_token_ids,
    encode_chunk,
)

from .conftest import D, H, L, T, make_chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_exact(dtype):
    chunk = make_chunk(1, dtype=dtype)
    back = decode_chunk(encode_chunk(chunk), ChunkKey.of(chunk))
    assert back.k.dtype == dtype
    assert torch.equal(back.k, chunk.k) and torch.equal(back.v, chunk.v)
    assert back.token_ids == chunk.token_ids
    assert (back.model_fingerprint, back.head_hash) == (chunk.model_fingerprint, chunk.head_hash)


@pytest.mark.parametrize("narrow", [torch.float16, torch.bfloat16])
def test_float32_is_narrowed_to_half_the_bytes(narrow):
    chunk = make_chunk(3)
    data = encode_chunk(chunk, narrow_to=narrow)
    back = decode_chunk(data, ChunkKey.of(chunk))
    assert back.k.dtype == narrow and len(data) < 0.6 * len(encode_chunk(chunk))
    assert torch.equal(back.k, chunk.k.to(narrow)) and torch.equal(back.v, chunk.v.to(narrow))


def test_narrowing_keeps_values_that_would_overflow_and_chunks_already_16_bit():
    big = make_chunk(4)
    big.v[0, 0, 0, 0] = 1e6  # beyond float16's range: stored as float32, not as inf
    assert decode_chunk(encode_chunk(big, narrow_to=torch.float16), ChunkKey.of(big)).v.dtype == (
        torch.float32
    )
    half = make_chunk(5, dtype=torch.bfloat16)  # never re-rounded into another 16-bit type
    back = decode_chunk(encode_chunk(half, narrow_to=torch.float16), ChunkKey.of(half))
    assert back.k.dtype == torch.bfloat16 and torch.equal(back.k, half.k)


def test_the_store_narrows_by_its_setting(tmp_path):
    from kvservice.store.config import StoreConfig
    from kvservice.store.memory import MemoryTier
    from kvservice.store.tiered import TieredStore

    assert StoreConfig().store_dtype == "float16"  # the default: half the bytes
    with pytest.raises(ValueError, match="KV_STORE_DTYPE"):
        StoreConfig.from_env({"KV_STORE_DTYPE": "int4"})
    chunk = make_chunk(6)
    for setting, dtype in (("float16", torch.float16), ("float32", torch.float32)):
        config = StoreConfig(store_dtype=setting, codec="fp16")
        store = TieredStore([MemoryTier(1 << 20)], config=config)
        key = store.put(chunk)
        assert store.get(key).k.dtype == dtype


def test_header_describes_the_chunk():
    chunk = make_chunk(2)
    header = decode_header(encode_chunk(chunk, rope_base_position=42))
    assert (header.num_layers, header.num_kv_heads, header.num_tokens, header.head_dim) == (
        L,
        H,
        T,
        D,
    )
    assert header.key == ChunkKey.of(chunk)
    assert header.k_storage == K_PRE_ROPE and header.rope_base_position == 42
    assert header.header_len % 64 == 0 and header.header_len <= HEADER_PROBE_BYTES


def test_one_layer_decodes_from_its_own_byte_range():
    chunk = make_chunk(3)
    data = encode_chunk(chunk)
    header = decode_header(data[:HEADER_PROBE_BYTES])
    for i in range(L):
        start = header.layer_offset(i)
        k, v = decode_layer(header, i, bytes(data[start : start + header.layer_size(i)]))
        assert torch.equal(k, chunk.k[i]) and torch.equal(v, chunk.v[i])
    tokens = data[header.tokens_offset : header.total_bytes]
    assert decode_token_ids(header, tokens) == chunk.token_ids


def test_flipped_bit_in_a_layer_is_detected():
    chunk = make_chunk(4)
    data = encode_chunk(chunk)
    header = decode_header(data)
    data[header.layer_offset(2) + 5] ^= 0x10
    with pytest.raises(ChunkCorrupt, match="layer 2"):
        decode_chunk(data)
    # the other layers still verify
    decode_layer(header, 1, data[header.layer_offset(1) :])


def test_corrupt_header_and_truncation_are_detected():
    data = encode_chunk(make_chunk(5))
    bad = bytearray(data)
    bad[40] ^= 0xFF
    with pytest.raises(ChunkCorrupt, match="header"):
        decode_header(bad)
    with pytest.raises(ChunkTruncated):
        decode_chunk(data[: len(data) - 10])
    with pytest.raises(ChunkTruncated):
        decode_header(data[:10])
    with pytest.raises(ChunkCorrupt, match="magic"):
        decode_header(b"NOPE" + bytes(200))


def test_another_models_object_is_refused():
    chunk = make_chunk(6)
    other = make_chunk(6, fingerprint="other-model")
    with pytest.raises(FingerprintMismatch):
        decode_chunk(encode_chunk(other), ChunkKey.of(chunk))


def test_key_string_round_trip_and_content_address():
    chunk = make_chunk(7)
    key = ChunkKey.of(chunk)
    assert ChunkKey.from_string(key.to_string()) == key
    odd = ChunkKey("org/model:v1 with space", "", key.tokens_sha256)
    assert odd.to_string().count("/") == 2 and ChunkKey.from_string(odd.to_string()) == odd
    # identical tokens -> identical key, whatever the KV values or where the chunk came from
    assert (
        ChunkKey.for_tokens(chunk.model_fingerprint, chunk.head_hash, list(chunk.token_ids)) == key
    )
