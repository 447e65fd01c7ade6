"""The experiment settings of blend's selection (``BlendSettings``: rounds, chunk starts,
a logit bias on stale keys), as pure functions and through ``blend_prefill``."""

from __future__ import annotations

import pytest
import torch

from kvservice.blend.attention import attend_and_weigh, attend_grouped, group_queries
from kvservice.blend.placing import stale_shift
from kvservice.blend.plan import StaleReading
from kvservice.blend.prefill import BlendSettings, blend_prefill
from kvservice.blend.selection import round_budgets
from kvservice.model.transformer import attend, position_mask, precompute_chunks


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
    for settings in (
        BlendSettings(rounds=2),
        BlendSettings(rounds=3, first_round_share=0.2),
        BlendSettings(chunk_starts=2),
        BlendSettings(stale_bias=-0.5),
        BlendSettings(stale_key_scale=1.0),
    ):
        result = blend_prefill(model, head, chunks, question, settings=settings, **kwargs)
        assert result.recompute_ratio_effective == pytest.approx(plain.recompute_ratio_effective)
        assert result.recomputed_per_layer[0] >= plain.recomputed_per_layer[0]
    biased = blend_prefill(
        model, head, chunks, question, settings=BlendSettings(stale_bias=-2.0), **kwargs
    )
    assert not torch.allclose(biased.logits, plain.logits, atol=1e-4)
    untouched = blend_prefill(model, head, chunks, question, settings=BlendSettings(), **kwargs)
    torch.testing.assert_close(untouched.logits, plain.logits)


def test_the_stale_corrections_leave_reuse_as_stored(tiny_blend):
    """Reuse reads the cached KV as stored, whatever the blend corrections say; blend reads
    its stale keys through the temperature (here without the shift, which replaces it where
    it moves a chunk)."""
    model, head, chunks, chunk_ids, question = tiny_blend
    plain = blend_prefill(model, head, chunks, question, mode="reuse", chunk_ids=chunk_ids)
    corrected = blend_prefill(
        model,
        head,
        chunks,
        question,
        mode="reuse",
        chunk_ids=chunk_ids,
        settings=BlendSettings(stale_key_scale=0.5, stale_bias=-3.0),
    )
    torch.testing.assert_close(corrected.logits, plain.logits)
    scaled = blend_prefill(
        model,
        head,
        chunks,
        question,
        chunk_ids=chunk_ids,
        recompute_ratio=0.25,
        settings=BlendSettings(stale_key_scale=0.5, stale_ramp_tokens=0, stale_shift=0.0),
    )
    as_stored = blend_prefill(
        model,
        head,
        chunks,
        question,
        chunk_ids=chunk_ids,
        recompute_ratio=0.25,
        settings=BlendSettings(stale_key_scale=1.0, stale_shift=0.0),
    )
    assert not torch.allclose(scaled.logits, as_stored.logits, atol=1e-4)
    # the default's temperature, in full (its ramp off): these chunks are ~50 tokens, and by
    # default a chunk gets the temperature in full only after 2,400 cached tokens
    assert BlendSettings().stale_key_scale == 0.9 and BlendSettings().stale_ramp_tokens == 2400
    unramped_settings = BlendSettings(stale_ramp_tokens=0, stale_shift=0.0)
    unramped = blend_prefill(
        model,
        head,
        chunks,
        question,
        chunk_ids=chunk_ids,
        recompute_ratio=0.25,
        settings=unramped_settings,
    )
    assert not torch.allclose(unramped.logits, as_stored.logits, atol=1e-4)


def test_the_stale_temperature_ramps_with_the_cached_tokens_a_chunk_never_saw():
    from kvservice.blend.plan import Segment, stale_reading

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
    ramped = stale_reading(
        segments, stale, BlendSettings(stale_key_scale=0.9, stale_ramp_tokens=200)
    )
    assert [(s.start, s.stop) for s in ramped.spans] == [(12, 112), (112, 412), (462, 502)]
    assert ramped.key_scales == pytest.approx((1.0, 0.95, 0.9))
    assert ramped.key_scale(112, 412) == pytest.approx(0.95) and ramped.key_scale(0, 10) == 1.0
    flat = stale_reading(segments, stale, BlendSettings(stale_key_scale=0.9, stale_ramp_tokens=0))
    assert flat.key_scales == pytest.approx((0.9, 0.9, 0.9))
    assert ramped.bias is None and flat.bias is None  # no bias asked
    # a logit bias ramps alike, on the stale slots only
    biased = stale_reading(segments, stale, BlendSettings(stale_bias=-0.5, stale_ramp_tokens=200))
    expected = torch.zeros(510)
    expected[112:412], expected[462:502] = -0.25, -0.5
    torch.testing.assert_close(biased.bias, expected)
    stale[200:210] = False  # recomputed in a first round: read as computed, no bias
    again = stale_reading(segments, stale, BlendSettings(stale_bias=-0.5, stale_ramp_tokens=200))
    assert bool((again.bias[200:210] == 0).all()) and float(again.bias[220]) == -0.25


def _in_context(model, head, chunks, chunk_ids, question):
    """Copies of ``chunks`` holding their true KV in this prompt (what full prefill computes
    for them there), as if stored after exactly the context the prompt gives them."""
    ids = torch.tensor([head + sum(chunk_ids, []) + question])
    _, kv = model(ids, torch.arange(ids.shape[1])[None], collect_kv=True)
    start, exact = len(head), []
    for c in chunks:
        span = slice(start, start + c.num_tokens)
        start += c.num_tokens
        k = torch.stack([layer_k[0, :, span] for layer_k, _ in kv])
        v = torch.stack([layer_v[0, :, span] for _, layer_v in kv])
        exact.append(type(c)(c.token_ids, k, v, c.model_fingerprint, c.head_hash))
    return exact


def _offset(chunks, gen, shared=False):
    """Copies of ``chunks`` whose K (before RoPE) and V are moved by one random vector per
    layer and KV head (per chunk, or one for all when ``shared``): stored KV that is wrong by
    a constant shift."""
    out, shape = [], (*chunks[0].k.shape[:2], 1, chunks[0].k.shape[-1])
    dk, dv = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    for c in chunks:
        if not shared:
            dk, dv = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        out.append(type(c)(c.token_ids, c.k + dk, c.v + dv, c.model_fingerprint, c.head_hash))
    return out


def test_the_stale_shift_takes_a_constant_error_out_of_every_token_of_a_chunk(tiny_blend):
    """Chunks stored off their true KV by a constant per layer and head: the recomputed
    tokens measure it, so moving each chunk by their mean (its own, or with one offset for
    all, drawn to every chunk's) gives full prefill's result; without the shift, or with a
    chunk too sparsely recomputed to be moved, blend keeps the error."""
    model, head, chunks, chunk_ids, question = tiny_blend
    exact = _in_context(model, head, chunks, chunk_ids, question)
    shifted = [exact[0], *_offset(exact[1:], torch.Generator().manual_seed(5))]
    full = blend_prefill(model, head, chunks, question, mode="full", chunk_ids=chunk_ids)

    def blend(sources=shifted, **settings):
        # each chunk on its own tokens' mean (no pooling), and no temperature: exact
        settings = BlendSettings(
            **{
                "stale_key_scale": 1.0,
                "stale_shift_pool": 0,
                "stale_shift_ramp_tokens": 0,
                **settings,
            }
        )
        return blend_prefill(
            model,
            head,
            sources,
            question,
            mode="blend",
            recompute_ratio=0.5,
            chunk_ids=chunk_ids,
            settings=settings,
        )

    common = [exact[0], *_offset(exact[1:], torch.Generator().manual_seed(6), shared=True)]
    pooled = blend(common, stale_shift=1.0, stale_shift_pool=16)
    torch.testing.assert_close(pooled.logits, full.logits, atol=2e-4, rtol=2e-4)

    moved, plain = blend(stale_shift=1.0), blend(stale_shift=0.0)
    torch.testing.assert_close(moved.logits, full.logits, atol=2e-4, rtol=2e-4)
    # a shifted chunk is read at no temperature: the default one changes only the selection
    tempered = blend(stale_shift=1.0, stale_key_scale=0.9, stale_ramp_tokens=0)
    torch.testing.assert_close(tempered.logits, full.logits, atol=2e-4, rtol=2e-4)
    assert (plain.logits - full.logits).abs().max() > 1e-2
    # at 0.5 every chunk has a recomputed token; no chunk has 100
    too_few = blend(stale_shift=1.0, stale_shift_min_tokens=100)
    torch.testing.assert_close(too_few.logits, plain.logits)
    half = blend(stale_shift=0.5)
    error = {
        name: (result.logits - full.logits).abs().max().item()
        for name, result in (("half", half), ("plain", plain))
    }
    assert error["half"] < error["plain"]


def test_the_stale_shift_leaves_reuse_and_exact_chunks_alone(tiny_blend):
    model, head, chunks, chunk_ids, question = tiny_blend

    def run(mode, sources, settings=None):
        settings = settings or BlendSettings()
        return blend_prefill(
            model,
            head,
            sources,
            question,
            mode=mode,
            chunk_ids=chunk_ids,
            recompute_ratio=0.25,
            settings=settings,
        )

    off = BlendSettings(stale_shift=0.0)
    torch.testing.assert_close(run("reuse", chunks).logits, run("reuse", chunks, off).logits)
    # stored exactly as in this prompt's context: the shift measures ~0 and moves nothing
    exact = _in_context(model, head, chunks, chunk_ids, question)
    moved = run("blend", exact, BlendSettings(stale_shift=1.0, stale_key_scale=1.0))
    torch.testing.assert_close(moved.logits, run("full", chunks).logits, atol=2e-4, rtol=2e-4)


def test_the_stale_shift_ramps_with_the_cached_tokens_a_chunk_never_saw():
    """A chunk is moved by as much of its estimate as the cached chunk tokens before it make
    up of ``stale_shift_ramp_tokens``; one without enough recomputed tokens not at all."""
    spans = (slice(10, 20), slice(20, 30), slice(30, 40))
    stale = StaleReading(spans, (1.0, 0.95, 0.9), unseen=(300, 600, 2400))
    active = torch.tensor([12, 13, 21, 22, 23, 31, 44])  # the last one: the question
    on = {"stale_shift": 1.0, "stale_shift_pool": 16}
    shift = stale_shift(stale, active, BlendSettings(**on, stale_shift_ramp_tokens=1200))
    assert shift.shares == pytest.approx((0.25, 0.5, 1.0))
    assert [r.tolist() for r in shift.rows] == [[0, 1], [2, 3, 4], [5]]
    fewer = stale_shift(stale, active, BlendSettings(**on, stale_shift_min_tokens=2))
    assert fewer.shares[2] == 0.0 and fewer.shares[1] > 0.0
    assert stale_shift(stale, active, BlendSettings()) is None  # off by default
    assert stale_shift(stale, torch.tensor([44]), BlendSettings(**on)) is None  # none recomputed


def test_local_layer_weight_weighs_the_sliding_layers_in_selection():
    """Gemma 3's sliding layers read only the last window: at weight 0 selection reads the
    global layers alone, at 1 every layer alike (the default), and a model with no sliding
    layers, or only sliding ones (Phi-3), is read alike whatever the weight."""
    from kvservice.blend.selection import attention_importance, local_layer_weights

    windows = [4, 4, None, 4, 4, None]
    assert local_layer_weights(windows, 1.0) is None
    assert (
        local_layer_weights([None] * 6, 0.0) is None and local_layer_weights([4] * 6, 0.0) is None
    )
    attention = torch.rand(6, 10, generator=torch.Generator().manual_seed(3))
    candidate = torch.ones(10, dtype=torch.bool)
    weights = local_layer_weights(windows, 0.0)
    only_global = attention_importance(attention, candidate, 0.0, 1.0, 6, weights)
    shares = attention / attention.sum(dim=1, keepdim=True)
    torch.testing.assert_close(only_global, shares[[2, 5]].mean(dim=0))
    alike = attention_importance(
        attention, candidate, 0.0, 1.0, 6, local_layer_weights(windows, 1.0)
    )
    torch.testing.assert_close(alike, shares.mean(dim=0))
    # no global layer among those read: they are read alike rather than not at all
    early = attention_importance(attention, candidate, 0.0, 0.3, 6, weights)
    torch.testing.assert_close(early, shares[:2].mean(dim=0))


def test_local_layer_weight_changes_what_gemma3_blend_recomputes(tmp_path):
    """Through ``blend_prefill`` on a tiny Gemma 3 (sliding window 8, a 54-token prompt):
    the same first pass, another selection, so another result."""
    import transformers

    from kvservice.model.transformer import Transformer

    from .conftest import perturbed

    config = transformers.Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    perturbed(transformers.Gemma3ForCausalLM(config)).save_pretrained(tmp_path)
    model = Transformer.from_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(4)
    head = torch.randint(0, 128, (3,), generator=gen).tolist()
    chunk_ids = [torch.randint(0, 128, (15,), generator=gen).tolist() for _ in range(3)]
    question = torch.randint(0, 128, (6,), generator=gen).tolist()
    chunks = precompute_chunks(model, head, chunk_ids)
    alike, global_only = (
        blend_prefill(
            model,
            head,
            chunks,
            question,
            recompute_ratio=0.2,
            settings=BlendSettings(local_layer_weight=weight),
        )
        for weight in (1.0, 0.0)
    )
    torch.testing.assert_close(alike.question_attention, global_only.question_attention)
    assert torch.isfinite(global_only.logits).all()
    assert not torch.equal(alike.logits, global_only.logits)
