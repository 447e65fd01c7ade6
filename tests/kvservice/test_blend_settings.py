"""The experiment settings of blend's selection (``BlendSettings``: rounds, chunk starts,
a logit bias on stale keys), as pure functions and through ``blend_prefill``."""

from __future__ import annotations

import pytest
import torch

from kvservice.blend import (
    BlendSettings,
    attend_and_weigh,
    attend_grouped,
    blend_prefill,
    group_queries,
    round_budgets,
)
from kvservice.model import attend, position_mask, precompute_chunks


@pytest.fixture(scope="module")
def tiny_blend(tiny_llama):
    gen = torch.Generator().manual_seed(11)
    head = torch.randint(0, 128, (5,), generator=gen).tolist()
    chunk_ids = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (12, 17, 9, 14)]
    question = torch.randint(0, 128, (6,), generator=gen).tolist()
    return tiny_llama, head, precompute_chunks(tiny_llama, head, chunk_ids), chunk_ids, question


def test_round_budgets_split_the_budget_and_refuse_nonsense():
    assert round_budgets(100, 1, 0.5) == [100]
    assert round_budgets(100, 2, 0.5) == [50, 50]
    assert round_budgets(100, 3, 0.4) == [40, 30, 30]
    assert round_budgets(7, 3, 0.5) == [4, 1, 2]
    assert round_budgets(1, 3, 0.5) == [1]  # nothing left to split
    assert sum(round_budgets(593, 4, 0.25)) == 593
    with pytest.raises(ValueError, match="rounds"):
        round_budgets(10, 0, 0.5)
    with pytest.raises(ValueError, match="first_share"):
        round_budgets(10, 2, 0.0)


def test_a_key_bias_moves_attention_like_an_added_logit_in_both_attention_paths():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(4, 3, 8, generator=gen)
    k, v = torch.randn(2, 12, 8, generator=gen), torch.randn(2, 12, 8, generator=gen)
    query_pos, key_pos = torch.tensor([9, 10, 11]), torch.arange(12)
    bias = torch.zeros(12)
    bias[2:6] = -1.0
    mask = position_mask(query_pos, key_pos)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) + bias
    expected = attend(q[None], k[None], v[None], additive)[0]
    out, weights = attend_and_weigh(q, k, v, query_pos, key_pos, key_bias=bias)
    torch.testing.assert_close(out, expected)
    _, plain = attend_and_weigh(q, k, v, query_pos, key_pos)
    assert weights[2:6].sum() < plain[2:6].sum() and weights.sum().item() == pytest.approx(1.0)
    groups = group_queries(query_pos, key_pos, heads_per_key=2, min_rows=2, key_bias=bias)
    torch.testing.assert_close(attend_grouped(q[None], k[None], v[None], groups), expected[None])


def test_rounds_chunk_starts_and_bias_recompute_the_budget_and_change_the_result(tiny_blend):
    """Through blend_prefill on a tiny model: every setting recomputes the same budget of
    candidates (chunk starts among them where asked), and a bias changes the logits."""
    model, head, chunks, chunk_ids, question = tiny_blend
    kwargs = dict(chunk_ids=chunk_ids, recompute_ratio=0.25)
    plain = blend_prefill(model, head, chunks, question, **kwargs)
    for settings in (BlendSettings(rounds=2), BlendSettings(rounds=3, first_round_share=0.2),
                     BlendSettings(chunk_starts=2), BlendSettings(stale_bias=-0.5),
                     BlendSettings(stale_key_scale=1.0)):  # fmt: skip
        result = blend_prefill(model, head, chunks, question, settings=settings, **kwargs)
        assert result.recompute_ratio_effective == pytest.approx(plain.recompute_ratio_effective)
        assert result.recomputed_per_layer[0] >= plain.recomputed_per_layer[0]
    biased = blend_prefill(model, head, chunks, question, settings=BlendSettings(stale_bias=-2.0),
                           **kwargs)  # fmt: skip
    assert not torch.allclose(biased.logits, plain.logits, atol=1e-4)
    untouched = blend_prefill(model, head, chunks, question, settings=BlendSettings(), **kwargs)
    torch.testing.assert_close(untouched.logits, plain.logits)


def test_the_stale_corrections_leave_reuse_as_stored(tiny_blend):
    """Reuse reads the cached KV as stored, whatever the blend corrections say."""
    model, head, chunks, chunk_ids, question = tiny_blend
    plain = blend_prefill(model, head, chunks, question, mode="reuse", chunk_ids=chunk_ids)
    corrected = blend_prefill(
        model, head, chunks, question, mode="reuse", chunk_ids=chunk_ids,
        settings=BlendSettings(stale_key_scale=0.5, stale_bias=-3.0),
    )  # fmt: skip
    torch.testing.assert_close(corrected.logits, plain.logits)
    scaled = blend_prefill(
        model, head, chunks, question, chunk_ids=chunk_ids, recompute_ratio=0.25,
        settings=BlendSettings(stale_key_scale=0.5, stale_ramp_tokens=0),
    )  # fmt: skip
    as_stored = blend_prefill(
        model, head, chunks, question, chunk_ids=chunk_ids, recompute_ratio=0.25,
        settings=BlendSettings(stale_key_scale=1.0),
    )  # fmt: skip
    assert not torch.allclose(scaled.logits, as_stored.logits, atol=1e-4)
    # the default's temperature, in full (its ramp off): these chunks are ~50 tokens, and by
    # default a chunk gets the temperature in full only after 2,400 cached tokens
    assert BlendSettings().stale_key_scale == 0.9 and BlendSettings().stale_ramp_tokens == 2400
    unramped = blend_prefill(model, head, chunks, question, chunk_ids=chunk_ids,
                             recompute_ratio=0.25,
                             settings=BlendSettings(stale_ramp_tokens=0))  # fmt: skip
    assert not torch.allclose(unramped.logits, as_stored.logits, atol=1e-4)


def test_the_stale_temperature_ramps_with_the_cached_tokens_a_chunk_never_saw():
    from kvservice.blend import Segment, _stale_reading

    cached = object()  # any source: only whether a segment is read from cache matters here
    segments = [
        Segment(0, 10, None, "head"),
        Segment(10, 2, None, "chunk"),  # a computed passage marker
        Segment(12, 100, cached, "chunk"),  # the first passage: nothing cached before it
        Segment(112, 300, cached, "chunk"),  # after 100 cached tokens
        Segment(412, 50, None, "chunk"),  # a miss: computed, not context it lacked
        Segment(462, 40, cached, "chunk"),  # after 400 cached tokens
        Segment(502, 8, None, "question"),
    ]
    stale = torch.zeros(510, dtype=torch.bool)
    stale[12:412] = stale[462:502] = True
    ramped = _stale_reading(
        segments, stale, BlendSettings(stale_key_scale=0.9, stale_ramp_tokens=200)
    )
    assert [(s.start, s.stop) for s in ramped.spans] == [(12, 112), (112, 412), (462, 502)]
    assert ramped.key_scales == pytest.approx((1.0, 0.95, 0.9))
    assert ramped.key_scale(112, 412) == pytest.approx(0.95) and ramped.key_scale(0, 10) == 1.0
    flat = _stale_reading(segments, stale, BlendSettings(stale_key_scale=0.9, stale_ramp_tokens=0))
    assert flat.key_scales == pytest.approx((0.9, 0.9, 0.9))
    assert ramped.bias is None and flat.bias is None  # no bias asked
    # a logit bias ramps alike, on the stale slots only
    biased = _stale_reading(segments, stale, BlendSettings(stale_bias=-0.5, stale_ramp_tokens=200))
    expected = torch.zeros(510)
    expected[112:412], expected[462:502] = -0.25, -0.5
    torch.testing.assert_close(biased.bias, expected)
    stale[200:210] = False  # recomputed in a first round: read as computed, no bias
    again = _stale_reading(segments, stale, BlendSettings(stale_bias=-0.5, stale_ramp_tokens=200))
    assert bool((again.bias[200:210] == 0).all()) and float(again.bias[220]) == -0.25
