"""The store feeds the real blender: the same logits as blending from in-memory ChunkKVs."""

from __future__ import annotations

import pytest
import torch

from kvservice.model.transformer import precompute_chunks
from kvservice.store.format import decode_header, encode_chunk
from kvservice.store.loader import KVLoader

# the engine's, in progress
blend_prefill = pytest.importorskip("kvservice.blend.prefill").blend_prefill

HEAD = [1, 5, 9, 2]
QUESTION = [7, 8, 9, 10, 11]


def _chunks(model):
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 120, (n,), generator=gen).tolist() for n in (11, 17, 9)]
    return precompute_chunks(model, HEAD, ids)


def test_blend_from_s3_equals_blend_from_memory(tiny_llama, store):
    chunks = _chunks(tiny_llama)
    keys = [store.put(chunk, tiers=[]) for chunk in chunks]
    expected = blend_prefill(tiny_llama, HEAD, chunks, QUESTION, mode="blend", recompute_ratio=0.3)
    with KVLoader(store, promote=False) as loader:
        batch = loader.open(keys, token_ids=[c.token_ids for c in chunks])
        got = blend_prefill(
            tiny_llama, HEAD, list(batch), QUESTION, mode="blend", recompute_ratio=0.3
        )
        assert batch.tiers == ["s3"] * 3
    assert torch.equal(got.logits, expected.logits)


def test_blend_survives_a_corrupt_object_by_recomputing_it(tiny_llama, store):
    chunks = _chunks(tiny_llama)
    keys = [store.put(chunk, tiers=[]) for chunk in chunks]
    bad = encode_chunk(chunks[1])
    bad[decode_header(bad).layer_offset(1) + 7] ^= 0x04
    store.tier("s3").put(keys[1], bad)
    expected = blend_prefill(tiny_llama, HEAD, chunks, QUESTION, mode="reuse")

    def recompute(token_ids):
        return precompute_chunks(tiny_llama, HEAD, [token_ids])[0]

    with KVLoader(store) as loader:
        batch = loader.open(keys, token_ids=[c.token_ids for c in chunks], recompute_fn=recompute)
        got = blend_prefill(tiny_llama, HEAD, list(batch), QUESTION, mode="reuse")
        assert batch.tiers == ["s3", "recomputed", "s3"]
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    assert store.stats().recomputes == 1
