from __future__ import annotations

import json

import pytest
import torch

from kvservice.model.families import ModelConfig, UnsupportedModelError
from kvservice.model.transformer import (
    KVCache,
    Transformer,
    apply_rope,
    attend,
    precompute_chunks,
    rope_inv_freq,
)

from .conftest import tiny_hf_model


def _hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids).logits.float()


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_logits_equal_hf_for_tiny_families(kind, tiny_checkpoints):
    hf_model = tiny_hf_model(kind)
    ours = Transformer.from_pretrained(tiny_checkpoints[kind])
    # Long enough that llama3 rope scaling (original context 64) matters.
    ids = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(150)[None].expand(2, -1)
    logits, _ = ours(ids, positions, all_logits=True)
    expected = _hf_logits(hf_model, ids)
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_family_options_are_read(tiny_checkpoints):
    llama = Transformer.from_pretrained(tiny_checkpoints["llama"]).config
    qwen = Transformer.from_pretrained(tiny_checkpoints["qwen2"]).config
    assert llama.rope_type == "llama3" and llama.tie_embeddings and not llama.qkv_bias
    assert qwen.qkv_bias and not qwen.tie_embeddings


def test_incremental_decode_with_cache_equals_one_pass(tiny_llama):
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40)[None]
    full, _ = tiny_llama(ids, positions, all_logits=True)
    cache = KVCache(tiny_llama.config, 1, 40, torch.device("cpu"))
    first, _ = tiny_llama(ids[:, :30], positions[:, :30], cache, all_logits=True)
    steps = [
        tiny_llama(ids[:, t : t + 1], positions[:, t : t + 1], cache)[0] for t in range(30, 40)
    ]
    torch.testing.assert_close(first, full[:, :30], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 30:], atol=1e-5, rtol=1e-5)


def test_padded_batch_rows_equal_unpadded(tiny_llama):
    short = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    long = torch.randint(0, 128, (1, 25), generator=torch.Generator().manual_seed(3))
    ids = torch.zeros(2, 25, dtype=torch.long)
    ids[0, :10], ids[1] = short[0], long[0]
    valid = torch.zeros(2, 25, dtype=torch.bool)
    valid[0, :10], valid[1] = True, True
    positions = torch.arange(25)[None].expand(2, -1)
    logits, _ = tiny_llama(ids, positions, valid=valid, all_logits=True)
    alone, _ = tiny_llama(short, positions[:1, :10], all_logits=True)
    torch.testing.assert_close(logits[0, :10], alone[0], atol=1e-5, rtol=1e-5)


def test_refuses_unknown_rope_scaling_and_partial_rotary(tiny_checkpoints):
    hf = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    yarn = {**hf, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf_config(yarn)
    with pytest.raises(UnsupportedModelError, match="partial rotary"):
        ModelConfig.from_hf_config({**hf, "partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf_config({**hf, "model_type": "gpt2"})


def test_rope_is_relative():
    config = ModelConfig(
        vocab_size=8,
        dim=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=16,
        intermediate_size=8,
        norm_eps=1e-5,
        rope_theta=10000.0,
    )
    inv_freq = rope_inv_freq(config)
    from kvservice.model.transformer import rope_cos_sin

    q, k = torch.randn(16), torch.randn(16)

    def score(pq: int, pk: int) -> torch.Tensor:
        cq, sq = rope_cos_sin(inv_freq, torch.tensor([pq]))
        ck, sk = rope_cos_sin(inv_freq, torch.tensor([pk]))
        return (apply_rope(q[None], cq, sq) * apply_rope(k[None], ck, sk)).sum()

    torch.testing.assert_close(score(7, 3), score(107, 103), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score(7, 3), score(7, 5), atol=1e-3)


def test_precompute_chunks_equal_their_part_of_a_joint_forward(tiny_llama):
    gen = torch.Generator().manual_seed(4)
    head = torch.randint(0, 128, (6,), generator=gen).tolist()
    chunks = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 14, 5)]
    got = precompute_chunks(tiny_llama, head, chunks)
    for chunk_ids, kv in zip(chunks, got, strict=True):
        ids = torch.tensor([head + chunk_ids])
        _, layers = tiny_llama(ids, torch.arange(ids.shape[1])[None], collect_kv=True)
        k = torch.stack([lk[0, :, len(head) :] for lk, _ in layers])  # [L, H_kv, n, D]
        v = torch.stack([lv[0, :, len(head) :] for _, lv in layers])
        assert kv.token_ids == chunk_ids and kv.k.shape == k.shape
        torch.testing.assert_close(kv.k, k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv.v, v, atol=1e-5, rtol=1e-5)
    (single,) = precompute_chunks(tiny_llama, head, [chunks[1]])  # alone: no padding
    torch.testing.assert_close(single.v, got[1].v, atol=1e-5, rtol=1e-5)
    (other_head,) = precompute_chunks(tiny_llama, head[1:], [chunks[1]])
    assert single.head_hash == got[0].head_hash and single.head_hash != other_head.head_hash


def test_bundled_smollm2_logits_equal_hf(smollm2, smollm2_dir, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    text = "The quick brown fox jumps over the lazy dog. " * 8
    ids = torch.tensor([smollm2_tokenizer(text)["input_ids"]])
    logits, _ = smollm2(ids, torch.arange(ids.shape[1])[None], all_logits=True)
    # 3e-4: oneDNN's fp32 products sum in another order than MKL's (up to 1.1e-4 seen)
    torch.testing.assert_close(logits, _hf_logits(hf_model, ids), atol=3e-4, rtol=1e-4)
    assert smollm2.fingerprint and len(smollm2.fingerprint) == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("queries", [1, 5])
def test_grouped_query_attention_on_the_cpu_equals_head_by_head(dtype, queries):
    """``attend`` with a mask reads each KV head once for its group of query heads on the
    CPU: the values of SDPA over K and V repeated per query head, for one query (decode) and
    several, a ragged batch's mask and one mask for every row."""
    gen = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, keys, dim = 3, 9, 3, 70, 16
    q = torch.randn(batch, heads, queries, dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, keys, dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, keys, dim, generator=gen).to(dtype)
    causal = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    ragged = causal.repeat(batch, 1, 1)
    for row in range(batch):
        ragged[row, :, keys - queries - 10 * (row + 1) : keys - queries] = False  # padding
    for mask in (ragged, causal):
        got = attend(q, k, v, mask)
        per_head = mask[:, None] if mask.dim() == 3 else mask
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=per_head
        )
        assert got.shape == want.shape == (batch, heads, queries, dim)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
        # the rows of query heads of one group differ: each reads its own head's q
        assert not torch.equal(got[:, 0], got[:, 1])
