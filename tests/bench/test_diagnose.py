from __future__ import annotations

import torch

from bench.diagnose import with_true_kv
from kvservice.blend.prefill import blend_prefill
from kvservice.model.transformer import precompute_chunks


def test_reuse_over_true_kv_is_full_and_partial_true_kv_is_between(tiny_llama):
    """The oracle's patched chunks: every chunk token's true KV makes reuse exactly full;
    the true KV of only some tokens leaves reuse's error smaller but not zero; the chunks
    themselves are left untouched."""
    gen = torch.Generator().manual_seed(7)
    head = torch.randint(0, 128, (4,), generator=gen).tolist()
    chunk_ids = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (10, 13, 11)]
    question = torch.randint(0, 128, (5,), generator=gen).tolist()
    chunks = precompute_chunks(tiny_llama, head, chunk_ids)
    ids = torch.tensor([head + sum(chunk_ids, []) + question])
    _, kv = tiny_llama(ids, torch.arange(ids.shape[1])[None], collect_kv=True)
    true_k = torch.stack([k[0] for k, _ in kv])
    true_v = torch.stack([v[0] for _, v in kv])
    starts = [4, 14, 27]
    before = [c.v.clone() for c in chunks]
    every = torch.zeros(ids.shape[1], dtype=torch.bool)
    every[4:38] = True
    some = torch.zeros(ids.shape[1], dtype=torch.bool)
    some[20:30] = True

    full = blend_prefill(tiny_llama, head, chunks, question, mode="full")
    reuse = blend_prefill(tiny_llama, head, chunks, question, mode="reuse")
    patched_all = with_true_kv(chunks, starts, true_k, true_v, every)
    patched_some = with_true_kv(chunks, starts, true_k, true_v, some)
    oracle_all = blend_prefill(tiny_llama, head, patched_all, question, mode="reuse")
    oracle_some = blend_prefill(tiny_llama, head, patched_some, question, mode="reuse")

    torch.testing.assert_close(oracle_all.logits, full.logits, atol=1e-4, rtol=1e-4)
    error = {
        name: (result.logits - full.logits).abs().max().item()
        for name, result in (("reuse", reuse), ("some", oracle_some))
    }
    assert 0 < error["some"] < error["reuse"]
    assert all(torch.equal(b, c.v) for b, c in zip(before, chunks, strict=True))
