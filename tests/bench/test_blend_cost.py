from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.blend_cost import beyond_reuse, metered_attention, metered_products, visible_pairs
from kvservice.blend import attention
from kvservice.blend.prefill import blend_prefill
from kvservice.model.kernels import FusedLinear
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
    original, original_weigh = F.scaled_dot_product_attention, attention.attend_and_weigh

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
    # the question's weighed attention, outside SDPA: in blend's first pass, never in full's
    assert full.weighed_visible == full.weighed_seconds == 0
    assert 0 < blend.weighed_visible <= heads * layers * 5 * tokens and blend.weighed_seconds > 0
    assert attention.attend_and_weigh is original_weigh


def test_metered_products_count_every_products_rows_and_put_the_layer_back(tiny_llama):
    """Full prefill multiplies every token's row in each layer's products, and the last
    token's alone in the head."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 128, (1, 23), generator=gen)
    original = FusedLinear.forward
    with metered_products() as meter:
        tiny_llama(ids, torch.arange(23)[None])
    assert FusedLinear.forward is original
    assert meter.calls >= 2 * tiny_llama.config.n_layers + 1 and meter.seconds > 0
    assert meter.rows == 23 * (meter.calls - 1) + 1


def test_blend_beyond_reuse_is_set_beside_full_prefills_own_rates():
    def run(seconds, sdpa, pairs, products, rows, weighed=0.0, weighed_pairs=0.0):
        return {
            "seconds": seconds,
            "sdpa_seconds": sdpa,
            "visible_pairs": pairs,
            "weighed_seconds": weighed,
            "weighed_pairs": weighed_pairs,
            "products_seconds": products,
            "product_rows": rows,
        }

    full = run(10.0, 6.0, 1000.0, 3.0, 100)  # 6 ms a pair, 30 ms a row, rest 10 ms a row
    reuse = run(1.0, 0.1, 10.0, 0.3, 10)
    blend = run(4.0, 2.0, 250.0, 0.5, 30, weighed=0.1, weighed_pairs=20.0)
    added = beyond_reuse(full, reuse, blend)
    assert added["pairs_of_full"] == 0.26 and added["rows_of_full"] == 0.2
    assert added["attention"] == pytest.approx({"seconds": 2.0, "floor": 0.26 * 6.0})
    assert added["products"] == pytest.approx({"seconds": 0.2, "floor": 0.2 * 3.0})
    assert added["rest"] == pytest.approx({"seconds": 1.4 - 0.6, "floor": 0.2 * 1.0})
    assert added["share"] == pytest.approx(0.3)
    assert added["floor_share"] == pytest.approx((1.56 + 0.6 + 0.2) / 10)
