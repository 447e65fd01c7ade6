from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.blend_cost import metered_attention, visible_pairs
from kvservice.blend.prefill import blend_prefill
from kvservice.model.transformer import precompute_chunks


def test_visible_pairs_counts_what_each_kind_of_call_lets_a_query_see():
    assert visible_pairs(4, 4, None, is_causal=True) == 1 + 2 + 3 + 4
    assert visible_pairs(2, 5, None, is_causal=True) == 1 + 2  # top-left aligned
    assert visible_pairs(3, 5, None, is_causal=False) == 15
    allowed = torch.tensor([[True, False, False], [True, True, True]])
    additive = torch.zeros(2, 3).masked_fill_(~allowed, float("-inf"))
    assert visible_pairs(2, 3, allowed, is_causal=False) == 4
    assert visible_pairs(2, 3, additive[None, None], is_causal=False) == 4


def test_metered_attention_counts_full_prefills_pairs_and_puts_sdpa_back(tiny_llama):
    gen = torch.Generator().manual_seed(3)
    head = torch.randint(0, 128, (4,), generator=gen).tolist()
    chunk_ids = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (12, 9, 14)]
    question = torch.randint(0, 128, (5,), generator=gen).tolist()
    chunks = precompute_chunks(tiny_llama, head, chunk_ids)
    tokens = 4 + 12 + 9 + 14 + 5
    layers = tiny_llama.config.n_layers
    original = F.scaled_dot_product_attention

    with metered_attention() as full:
        blend_prefill(tiny_llama, head, chunks, question, mode="full")
    with metered_attention() as blend:
        blend_prefill(tiny_llama, head, chunks, question, mode="blend", recompute_ratio=0.3)

    assert F.scaled_dot_product_attention is original
    # Per query head, every layer but the last: the causal triangle; the last: only the last
    # token's row.
    heads = tiny_llama.config.n_heads
    assert full.visible == heads * ((layers - 1) * tokens * (tokens + 1) // 2 + tokens)
    assert full.seconds > 0
    assert 0 < blend.visible <= blend.given
    assert blend.visible < full.visible
