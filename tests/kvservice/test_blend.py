from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch

from kvservice.blend.attention import attend_and_weigh, attend_grouped, group_queries
from kvservice.blend.placing import rotate_into
from kvservice.blend.prefill import BlendSettings, blend_prefill, refresh
from kvservice.blend.selection import (
    attention_importance,
    select_recompute,
    selection_layers,
    smooth_scores,
)
from kvservice.chunk import ChunkKV
from kvservice.model.transformer import (
    KVCache,
    apply_rope,
    attend,
    position_mask,
    precompute_chunks,
    precompute_head,
    rope_cos_sin,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def prompt(tiny_llama):
    gen = torch.Generator().manual_seed(10)
    head = torch.randint(0, 128, (5,), generator=gen).tolist()
    chunks = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (12, 17, 9, 14)]
    question = torch.randint(0, 128, (6,), generator=gen).tolist()
    kvs = precompute_chunks(tiny_llama, head, chunks)
    return head, chunks, question, kvs


def _full(model, head, chunks, question):
    ids = torch.tensor([head + sum(chunks, []) + question])
    logits, kv = model(ids, torch.arange(ids.shape[1])[None], collect_kv=True)
    return logits[0], kv


def _cache_kv(result):
    n = result.num_tokens
    return result.cache.k[:, 0, :, :n], result.cache.v[:, 0, :, :n]


# ---- pure functions ------------------------------------------------------------------------


@pytest.mark.parametrize("stored", [torch.float32, torch.float16])
def test_rotate_into_writes_apply_rope_of_the_widened_keys_into_the_slice(tiny_llama, stored):
    k_pre = torch.randn(2, 7, 16).to(stored)
    cos, sin = rope_cos_sin(tiny_llama.inv_freq, torch.arange(100, 107))
    cache = torch.zeros(2, 20, 16)
    rotate_into(cache[:, 5:12], k_pre, cos, sin)
    expected = apply_rope(k_pre.float(), cos, sin)
    torch.testing.assert_close(cache[:, 5:12], expected, atol=1e-6, rtol=1e-6)
    assert cache[:, :5].eq(0).all() and cache[:, 12:].eq(0).all()  # nothing outside the slice
    assert not torch.allclose(cache[:, 5:12], k_pre.float(), atol=1e-3)  # it did rotate


@pytest.mark.parametrize("rotary", [16, 8])
def test_rotate_into_scales_the_keys_it_rotates(tiny_llama, rotary):
    """The stale keys' temperature is folded into the rotation: the same as rotating, then
    scaling every dim (the ones partial rotary leaves unturned too), in a bfloat16 slice."""
    k_pre = torch.randn(2, 7, 16)
    cos, sin = rope_cos_sin(tiny_llama.inv_freq[: rotary // 2], torch.arange(100, 107))
    cache = torch.zeros(2, 9, 16, dtype=torch.bfloat16)
    rotate_into(cache[:, 1:8], k_pre, cos, sin, scale=0.9)
    expected = (apply_rope(k_pre, cos, sin) * 0.9).to(torch.bfloat16)
    torch.testing.assert_close(cache[:, 1:8], expected, atol=0.02, rtol=0.01)
    assert cache[:, 0].eq(0).all() and cache[:, 8].eq(0).all()
    unscaled = torch.zeros(2, 7, 16, dtype=torch.bfloat16)
    rotate_into(unscaled, k_pre, cos, sin)
    assert not torch.allclose(unscaled.float(), cache[:, 1:8].float(), atol=1e-2)


@pytest.mark.parametrize("rotary", [16, 8])
def test_rotate_into_places_side_by_side_segments_as_each_alone(tiny_llama, rotary):
    """A run of segments (their keys given apart, each token scaled by its own segment's
    scale) is written exactly as rotating each segment into its own slice."""
    parts = [torch.randn(2, n, 16) for n in (5, 3, 6)]
    scales = (1.0, 0.9, 0.95)
    cos, sin = rope_cos_sin(tiny_llama.inv_freq[: rotary // 2], torch.arange(40, 54))
    alone = torch.zeros(2, 16, 16, dtype=torch.bfloat16)
    start = 1
    for part, scale in zip(parts, scales, strict=True):
        stop = start + part.shape[1]
        rotate_into(
            alone[:, start:stop], part, cos[start - 1 : stop - 1], sin[start - 1 : stop - 1], scale
        )
        start = stop
    per_token = torch.cat(
        [torch.full((p.shape[1], 1), s) for p, s in zip(parts, scales, strict=True)]
    )
    together = torch.zeros(2, 16, 16, dtype=torch.bfloat16)
    rotate_into(together[:, 1:15], parts, cos, sin, per_token)
    assert torch.equal(together, alone)
    assert not alone[:, 1:15].eq(0).all(dim=-1).any()  # every slot of the run was written
    assert together[:, 0].eq(0).all() and together[:, 15].eq(0).all()


def test_cached_chunk_k_moved_to_new_place_equals_k_computed_there(tiny_llama, prompt):
    """Layer-0 K does not depend on context, so the cached chunk's K rotated to its place in
    a new prompt must equal what full prefill computes there."""
    head, chunks, question, kvs = prompt
    result = blend_prefill(tiny_llama, head, kvs, question, mode="reuse")
    ids = torch.tensor([head + sum(chunks, []) + question])
    positions = torch.arange(ids.shape[1])
    _, kv = tiny_llama(ids, positions[None], collect_kv=True)
    k0_full = apply_rope(kv[0][0][0], *rope_cos_sin(tiny_llama.inv_freq, positions))
    start = len(head) + len(chunks[0]) + len(chunks[1])  # the third chunk, far from where cached
    span = slice(start, start + len(chunks[2]))
    torch.testing.assert_close(
        result.cache.k[0, 0, :, span], k0_full[:, span], atol=1e-5, rtol=1e-5
    )


def test_attend_and_weigh_gives_sdpas_output_and_causal_weights_summing_to_one():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(4, 3, 8, generator=gen)
    k, v = torch.randn(2, 10, 8, generator=gen), torch.randn(2, 10, 8, generator=gen)
    query_pos, key_pos = torch.tensor([5, 6, 7]), torch.arange(10)
    out, attention = attend_and_weigh(q, k, v, query_pos, key_pos)
    expected = attend(q[None], k[None], v[None], position_mask(query_pos, key_pos))[0]
    torch.testing.assert_close(out, expected)
    assert attention.shape == (10,)
    assert attention.sum().item() == pytest.approx(1.0, abs=1e-5)
    assert attention[8:].abs().sum().item() == 0.0  # no query reads a later key
    # A query aligned with key 2 (and scaled up) puts its attention there.
    strong = k[:, 2].repeat_interleave(2, dim=0)[:, None] * 10.0  # [H, 1, D]
    _, attention = attend_and_weigh(strong, k, v, torch.tensor([9]), key_pos)
    assert attention.argmax().item() == 2
    # A sliding window hides the keys before it.
    _, windowed = attend_and_weigh(q, k, v, query_pos, key_pos, sliding_window=2)
    assert windowed[:4].abs().sum().item() == 0.0 and windowed[4:8].sum().item() > 0.99


def test_attention_importance_reads_deep_layers_each_normalized_over_candidates():
    candidate = torch.tensor([False, True, True, True, False])
    attention = torch.tensor(
        [
            [0.0, 0.9, 0.05, 0.05, 0.0],  # an early layer: ignored from depth 1/2 on
            [0.8, 0.0, 0.1, 0.0, 0.1],  # mostly the head (a non-candidate): token 2 is all
            [0.0, 0.1, 0.0, 0.3, 0.6],  # of the candidates' share here, token 3 three quarters
            [0.0, 0.0, 0.5, 0.5, 0.0],
        ]
    )
    importance = attention_importance(attention, candidate, from_depth=0.5)
    torch.testing.assert_close(importance, torch.tensor([0.0, 0.125, 0.25, 0.625, 0.0]))
    every_layer = attention_importance(attention, candidate, from_depth=0.0)
    assert every_layer[1].item() == pytest.approx((0.9 + 0.0 + 0.25 + 0.0) / 4)


def test_attention_importance_stops_at_to_depth_of_the_layers_given():
    candidate = torch.tensor([True, True, True])
    attention = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    # Of 6 layers, [2, 3): the third row only, read from the first three rows recorded.
    importance = attention_importance(attention, candidate, 1 / 3, 0.5, num_layers=6)
    torch.testing.assert_close(importance, torch.tensor([0.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="reads 4"):
        attention_importance(attention, candidate, 0.5, 0.6, num_layers=6)
    assert selection_layers(30, 1 / 3, 1.0) == (10, 30)
    assert selection_layers(30, 1 / 3, 2 / 3) == (10, 20)
    assert selection_layers(4, 0.9, 0.95) == (3, 4)  # at least one layer
    with pytest.raises(ValueError, match="from_depth < to_depth"):
        selection_layers(30, 0.5, 0.5)


def test_select_recompute_takes_the_most_important_candidates_only():
    importance = torch.tensor([9.0, 1.0, 5.0, 3.0, 8.0, 0.0])
    candidate = torch.tensor([False, True, True, True, False, True])
    assert select_recompute(importance, candidate, 2).tolist() == [2, 3]
    assert select_recompute(importance, candidate, 10).tolist() == [1, 2, 3, 5]


def test_grouped_attention_equals_one_masked_call():
    q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    query_pos = torch.tensor([2, 5, 6, 11, 17, 23, 27, 28, 29])
    key_pos = torch.arange(30)
    expected = attend(q, k, v, position_mask(query_pos, key_pos))
    groups = group_queries(query_pos, key_pos, heads_per_key=2, min_rows=4)
    # four groups of three queries two apart (the last two share one), each reading the
    # keys up to its last query
    assert [(s.start, s.stop) for s in groups.spans] == [(0, 3), (2, 5), (4, 7), (6, 9)]
    assert groups.n_keys == [7, 18, 28, 30]
    torch.testing.assert_close(attend_grouped(q, k, v, groups), expected)
    # any strides: the queries as a slice of a longer pass's
    longer = torch.randn(1, 4, 12, 8)
    longer[:, :, 2:11] = q
    torch.testing.assert_close(attend_grouped(longer[:, :, 2:11], k, v, groups), expected)


def test_grouped_attention_gives_every_call_at_least_its_minimum_of_stacked_rows():
    key_pos = torch.arange(4000)
    for count, heads_per_key, expected_groups in [
        (596, 3, 2),
        (200, 3, 1),
        (1536, 3, 6),
        (3, 1, 1),
    ]:
        query_pos = torch.linspace(100, 3999, count).long()
        groups = group_queries(query_pos, key_pos, heads_per_key, min_rows=768)
        assert len(groups.spans) == expected_groups
        sizes = [span.stop - span.start for span in groups.spans]
        owned = [groups.owned(g) for g in range(expected_groups)]
        assert sum(owned) == count and len(set(sizes)) == 1  # one length: one stacking copy
        assert sizes[0] - groups.stride < expected_groups  # fewer shared than groups
        if expected_groups > 1:
            assert min(sizes) * heads_per_key >= 768
        assert [m.shape[0] for m in groups.masks] == [heads_per_key * n for n in sizes]


def test_grouped_attention_in_one_call_when_no_minimum_is_set():
    """A GPU's cut (``min_rows=None``): one group over the keys up to the last query."""
    q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    query_pos = torch.tensor([2, 5, 6, 11, 17, 23, 27, 28, 29])
    key_pos = torch.arange(30)
    expected = attend(q, k, v, position_mask(query_pos, key_pos))
    groups = group_queries(query_pos, key_pos, heads_per_key=2, min_rows=None)
    assert len(groups.spans) == 1 and groups.n_keys == [30]
    torch.testing.assert_close(attend_grouped(q, k, v, groups), expected)


def test_grouped_attention_with_queries_bunched_at_the_end():
    """The question alone (``reuse``): every query falls in the last span, one call."""
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    query_pos, key_pos = torch.arange(35, 40), torch.arange(40)
    expected = attend(q, k, v, position_mask(query_pos, key_pos))
    groups = group_queries(query_pos, key_pos, heads_per_key=2)
    assert len(groups.spans) == 1
    torch.testing.assert_close(attend_grouped(q, k, v, groups), expected)


def test_smooth_scores_spreads_a_peak_over_its_neighbours():
    scores = torch.tensor([0.0, 0.0, 9.0, 0.0, 0.0, 0.0])
    assert smooth_scores(scores, 1).tolist() == scores.tolist()
    torch.testing.assert_close(smooth_scores(scores, 3), torch.tensor([0.0, 3, 3, 3, 0, 0]))
    # at the edges only the candidates that exist are averaged
    torch.testing.assert_close(
        smooth_scores(torch.tensor([6.0, 0, 0]), 3), torch.tensor([3.0, 2, 0])
    )
    with pytest.raises(ValueError, match="odd"):
        smooth_scores(scores, 4)


def test_kv_cache_zeroes_only_what_is_not_written_first(tiny_llama):
    cache = KVCache(tiny_llama.config, 1, 10, torch.device("cpu"), written_before_read=6)
    assert cache.k[:, :, :, 6:].abs().sum().item() == 0.0
    assert cache.v[:, :, :, 6:].abs().sum().item() == 0.0


# ---- the identities ------------------------------------------------------------------------


def test_blend_at_ratio_one_equals_full(tiny_llama, prompt):
    head, chunks, question, kvs = prompt
    logits, _ = _full(tiny_llama, head, chunks, question)
    full = blend_prefill(tiny_llama, head, kvs, question, mode="full")
    blended = blend_prefill(tiny_llama, head, kvs, question, mode="blend", recompute_ratio=1.0)
    torch.testing.assert_close(full.logits, logits, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(blended.logits, logits, atol=ATOL, rtol=ATOL)
    for a, b in zip(_cache_kv(blended), _cache_kv(full), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)


def test_blend_at_ratio_zero_equals_reuse_and_differs_from_full(tiny_llama, prompt):
    head, chunks, question, kvs = prompt
    reuse = blend_prefill(tiny_llama, head, kvs, question, mode="reuse")
    blended = blend_prefill(tiny_llama, head, kvs, question, mode="blend", recompute_ratio=0.0)
    full = blend_prefill(tiny_llama, head, kvs, question, mode="full")
    torch.testing.assert_close(blended.logits, reuse.logits, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(reuse.logits, full.logits, atol=1e-3)
    assert blended.recompute_ratio_effective == 0.0


def test_prefix_mode_equals_full(tiny_llama, prompt):
    """Prefix caching reuses only exact KV (head + first chunk), so it is full prefill."""
    head, chunks, question, kvs = prompt
    full = blend_prefill(tiny_llama, head, kvs, question, mode="full")
    prefix = blend_prefill(
        tiny_llama, head, kvs, question, mode="prefix", head_kv=precompute_head(tiny_llama, head)
    )
    torch.testing.assert_close(prefix.logits, full.logits, atol=ATOL, rtol=ATOL)
    assert prefix.recomputed_per_layer[0] == full.num_tokens - len(head) - len(chunks[0])


def test_partial_blend_recomputes_the_requested_share_and_is_closer_to_full(tiny_llama, prompt):
    head, chunks, question, kvs = prompt
    full = blend_prefill(tiny_llama, head, kvs, question, mode="full")
    reuse = blend_prefill(tiny_llama, head, kvs, question, mode="reuse")
    blended = blend_prefill(tiny_llama, head, kvs, question, mode="blend", recompute_ratio=0.5)
    n_chunk = sum(len(c) for c in chunks)
    assert blended.recompute_ratio_effective == pytest.approx(0.5, abs=1.5 / n_chunk)
    # Every layer runs the head (not given cached here) and the question in the reuse pass,
    # then the selected chunk tokens and the question again.
    selected = round(0.5 * n_chunk)
    per_layer = len(head) + len(question) + selected + len(question)
    assert blended.recomputed_per_layer == [per_layer] * tiny_llama.config.n_layers
    err_blend = (blended.logits - full.logits).abs().max()
    err_reuse = (reuse.logits - full.logits).abs().max()
    assert err_blend < err_reuse


def test_selected_tokens_never_see_later_tokens(tiny_llama, prompt):
    """Change everything after the chunks (the question): the KV written for the chunk
    tokens, recomputed ones included, must not change. A bottom-right mask would fail this."""
    head, chunks, question, kvs = prompt
    other_question = [(t + 7) % 128 for t in question]
    # The selection follows the question's attention, so it would differ: fix it.
    options = dict(mode="blend", recompute_slots=[20, 21, 30, 40, 41, 42])
    a = blend_prefill(tiny_llama, head, kvs, question, **options)
    b = blend_prefill(tiny_llama, head, kvs, other_question, **options)
    n_chunks = len(head) + sum(len(c) for c in chunks)
    for x, y in zip(_cache_kv(a), _cache_kv(b), strict=True):
        torch.testing.assert_close(x[:, :, :n_chunks], y[:, :, :n_chunks], atol=0, rtol=0)
        assert not torch.allclose(x[:, :, n_chunks:], y[:, :, n_chunks:])
    # ...and the recomputed chunk KV is not the cached KV (they were really recomputed).
    cached = blend_prefill(tiny_llama, head, kvs, question, mode="reuse")
    assert not torch.allclose(_cache_kv(a)[1][1:], _cache_kv(cached)[1][1:])


# ---- cache-hit patterns --------------------------------------------------------------------


def test_zero_percent_hit_equals_full(tiny_llama, prompt):
    head, chunks, question, _ = prompt
    full = blend_prefill(
        tiny_llama, head, [None] * len(chunks), question, mode="full", chunk_ids=chunks
    )
    miss = blend_prefill(
        tiny_llama, head, [None] * len(chunks), question, mode="blend", chunk_ids=chunks
    )
    torch.testing.assert_close(miss.logits, full.logits, atol=ATOL, rtol=ATOL)
    assert miss.recompute_ratio_effective == 0.0  # nothing was cached, nothing "re"computed
    # With the head's KV given too, nothing after it cached: the head is computed as well
    # (full prefill's one causal pass, the same numbers, not the masked path after a cache)
    head_kv = precompute_head(tiny_llama, head)
    for mode in ("blend", "reuse"):
        missed = blend_prefill(
            tiny_llama,
            head,
            [None] * len(chunks),
            question,
            mode=mode,
            chunk_ids=chunks,
            head_kv=head_kv,
        )
        torch.testing.assert_close(missed.logits, full.logits, atol=0, rtol=0)
        assert missed.recomputed_per_layer[0] == full.recomputed_per_layer[0]


def test_hundred_percent_hit_and_partial_hit(tiny_llama, prompt):
    head, chunks, question, kvs = prompt
    full = blend_prefill(tiny_llama, head, kvs, question, mode="full")
    hit = blend_prefill(tiny_llama, head, kvs, question, mode="blend", recompute_ratio=1.0)
    partial = [kvs[0], None, kvs[2], None]
    mixed = blend_prefill(
        tiny_llama, head, partial, question, mode="blend", recompute_ratio=1.0, chunk_ids=chunks
    )
    torch.testing.assert_close(hit.logits, full.logits, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(mixed.logits, full.logits, atol=ATOL, rtol=ATOL)


def test_a_partial_hit_selected_by_attention_equals_the_same_slots_given(tiny_llama, prompt):
    """With misses, the reuse pass computes them and the question, and records the question's
    attention on the way: the recording path must compute what the plain path computes."""
    head, chunks, question, kvs = prompt
    partial = [kvs[0], None, kvs[2], kvs[3]]
    selected = blend_prefill(
        tiny_llama, head, partial, question, mode="blend", recompute_ratio=0.3, chunk_ids=chunks
    )
    candidate = torch.zeros(selected.num_tokens, dtype=torch.bool)
    start = len(head) + len(chunks[0]) + len(chunks[1])  # chunk 0 is exact, chunk 1 a miss
    candidate[start : start + len(chunks[2]) + len(chunks[3])] = True
    budget = math.ceil(0.3 * sum(len(c) for c in chunks))
    slots = select_recompute(
        attention_importance(selected.question_attention, candidate), candidate, budget
    )
    given = blend_prefill(
        tiny_llama,
        head,
        partial,
        question,
        mode="blend",
        chunk_ids=chunks,
        recompute_slots=slots.tolist(),
    )
    torch.testing.assert_close(selected.logits, given.logits, atol=1e-5, rtol=1e-5)


def test_a_reuse_pass_stopped_at_the_selection_depth_equals_a_whole_one(tiny_llama, prompt):
    """Pass 1 ending at the last layer selection reads (the recompute pass placing the deeper
    layers' cached KV) computes what the whole pass 1 then the same slots compute, and reads
    every layer of every chunk once, in order."""
    head, chunks, question, kvs = prompt
    head_kv = precompute_head(tiny_llama, head)
    layers = tiny_llama.config.n_layers
    settings = BlendSettings(attention_from_depth=0.25, attention_to_depth=0.5)
    short = blend_prefill(
        tiny_llama,
        head,
        kvs,
        question,
        mode="blend",
        recompute_ratio=0.3,
        head_kv=head_kv,
        chunk_ids=chunks,
        settings=settings,
    )
    first, until = selection_layers(layers, 0.25, 0.5)
    assert short.question_attention.shape[0] == until < layers
    candidate = torch.zeros(short.num_tokens, dtype=torch.bool)
    candidate[len(head) + len(chunks[0]) : short.num_tokens - len(question)] = True
    budget = math.ceil(0.3 * sum(len(c) for c in chunks))
    importance = attention_importance(short.question_attention, candidate, 0.25, 0.5, layers)
    slots = select_recompute(importance, candidate, budget)
    given = blend_prefill(
        tiny_llama,
        head,
        kvs,
        question,
        mode="blend",
        head_kv=head_kv,
        chunk_ids=chunks,
        recompute_slots=slots.tolist(),
        settings=settings,
    )
    torch.testing.assert_close(short.logits, given.logits, atol=1e-5, rtol=1e-5)
    k_short, v_short = _cache_kv(short)
    k_given, v_given = _cache_kv(given)
    torch.testing.assert_close(k_short, k_given, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_short, v_given, atol=1e-5, rtol=1e-5)
    per_pass = budget + len(question)
    expected = [per_pass + len(question)] * until + [per_pass] * (layers - until)
    assert short.recomputed_per_layer == expected
    whole = blend_prefill(
        tiny_llama,
        head,
        kvs,
        question,
        mode="blend",
        recompute_ratio=0.3,
        head_kv=head_kv,
        chunk_ids=chunks,
        settings=BlendSettings(attention_from_depth=0.5),
    )
    assert whole.question_attention.shape[0] == layers
    # below the first layer selection reads no weights are computed; from it on, each
    # layer's sum to one
    first, _ = selection_layers(layers, 0.5, 1.0)
    assert first > 0 and not whole.question_attention[:first].any()
    ones = torch.ones(layers - first)
    torch.testing.assert_close(whole.question_attention[first:].sum(1), ones)


def test_same_prompt_twice_is_identical_and_leaves_chunks_untouched(tiny_llama, prompt):
    head, chunks, question, kvs = prompt
    before = [kv.k.clone() for kv in kvs]
    first = blend_prefill(tiny_llama, head, kvs, question, mode="blend", recompute_ratio=0.3)
    second = blend_prefill(tiny_llama, head, kvs, question, mode="blend", recompute_ratio=0.3)
    torch.testing.assert_close(first.logits, second.logits, atol=0, rtol=0)
    assert all(torch.equal(b, kv.k) for b, kv in zip(before, kvs, strict=True))


def test_chunks_reordered_hit_the_same_cache(tiny_llama, prompt):
    head, chunks, question, kvs = prompt
    order = [2, 0, 3, 1]
    reordered = [kvs[i] for i in order]
    full = blend_prefill(tiny_llama, head, reordered, question, mode="full")
    expected, _ = _full(tiny_llama, head, [chunks[i] for i in order], question)
    blended = blend_prefill(
        tiny_llama, head, reordered, question, mode="blend", recompute_ratio=1.0
    )
    reuse = blend_prefill(tiny_llama, head, reordered, question, mode="reuse")
    torch.testing.assert_close(full.logits, expected, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(blended.logits, expected, atol=ATOL, rtol=ATOL)
    assert torch.isfinite(reuse.logits).all() and not torch.allclose(
        reuse.logits, expected, atol=1e-3
    )


class _RecordingKV:
    """A LayeredKV that records the order in which layers are read."""

    def __init__(self, chunk: ChunkKV, log: list[int]):
        self.chunk, self.log, self.num_tokens = chunk, log, chunk.num_tokens
        self.token_ids, self.head_hash = chunk.token_ids, chunk.head_hash

    def layer(self, index: int):
        self.log.append(index)
        return self.chunk.layer(index)


@pytest.mark.parametrize("to_depth", [1.0, 0.5])  # 0.5: pass 1 stops halfway (head cached)
def test_cached_kv_is_read_layer_by_layer_in_order(tiny_llama, prompt, to_depth):
    head, chunks, question, kvs = prompt
    head_kv = precompute_head(tiny_llama, head) if to_depth < 1.0 else None
    logs: list[list[int]] = [[] for _ in kvs]
    sources = [_RecordingKV(kv, log) for kv, log in zip(kvs, logs, strict=True)]
    blend = functools.partial(
        blend_prefill,
        tiny_llama,
        head,
        question_ids=question,
        mode="blend",
        recompute_ratio=0.3,
        head_kv=head_kv,
        settings=BlendSettings(attention_to_depth=to_depth),
    )
    plain, recorded = blend(chunks=kvs), blend(chunks=sources)
    torch.testing.assert_close(recorded.logits, plain.logits, atol=0, rtol=0)
    if to_depth < 1.0:
        assert plain.question_attention.shape[0] < tiny_llama.config.n_layers
    n_layers = tiny_llama.config.n_layers
    assert all(log == list(range(n_layers)) for log in logs)


def test_refresh_upgrades_the_cache_to_a_blend_at_the_higher_ratio(tiny_llama, prompt):
    """Progressive blend: a blend at 0.1, refreshed to 0.4 once two answer tokens are known,
    gives what a blend at 0.4 followed by those tokens gives: the next logits and the cache."""
    head, chunks, question, kvs = prompt

    def blend(ratio):
        return blend_prefill(
            tiny_llama,
            head,
            kvs,
            question,
            mode="blend",
            recompute_ratio=ratio,
            chunk_ids=chunks,
            extra_capacity=4,
        )

    low, high = blend(0.1), blend(0.4)
    answer = [int(low.logits.argmax()), 7]
    n = low.num_tokens
    positions = torch.arange(n, n + 2)[None]
    upgraded = refresh(tiny_llama, low, answer, 0.4)
    expected, _ = tiny_llama(torch.tensor([answer]), positions, high.cache)
    assert upgraded.num_tokens == n + 2 and upgraded.cache is low.cache
    torch.testing.assert_close(upgraded.logits, expected[0], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(
        _cache_kv(upgraded), _cache_kv(replace(high, num_tokens=n + 2)), atol=ATOL, rtol=ATOL
    )
    assert upgraded.recompute_ratio_effective == high.recompute_ratio_effective
    # decoding the same tokens over the 0.1 cache gives something else: the refresh did work
    stale, _ = tiny_llama(torch.tensor([answer]), positions, blend(0.1).cache)
    assert not torch.allclose(stale[0], upgraded.logits, atol=1e-3)


def test_only_a_blend_that_selected_can_be_refreshed(tiny_llama, prompt):
    head, chunks, question, kvs = prompt
    reuse = blend_prefill(
        tiny_llama, head, kvs, question, mode="reuse", chunk_ids=chunks, extra_capacity=2
    )
    with pytest.raises(ValueError, match="refreshed"):
        refresh(tiny_llama, reuse, [1], 0.4)
    rounds = blend_prefill(
        tiny_llama,
        head,
        kvs,
        question,
        mode="blend",
        recompute_ratio=0.2,
        chunk_ids=chunks,
        extra_capacity=2,
        settings=BlendSettings(rounds=2),
    )
    with pytest.raises(ValueError, match="rounds"):
        refresh(tiny_llama, rounds, [1], 0.4)
    blend = blend_prefill(
        tiny_llama,
        head,
        kvs,
        question,
        mode="blend",
        recompute_ratio=0.2,
        chunk_ids=chunks,
        extra_capacity=2,
    )
    with pytest.raises(ValueError, match="answer"):
        refresh(tiny_llama, blend, [], 0.4)


@pytest.mark.parametrize("mode", ["reuse", "blend"])
def test_sources_held_whole_are_placed_once_as_layer_by_layer(
    tiny_llama, prompt, monkeypatch, mode
):
    """The head and chunks given as tensors are placed for every layer at once before the
    first pass (``placing.place_whole``): the same cache and logits as placing them layer by
    layer, stale chunks' key scales included."""
    from kvservice.blend import prefill as prefill_module

    head, chunks, question, kvs = prompt
    head_kv = precompute_head(tiny_llama, head)
    settings = BlendSettings(stale_key_scale=0.9, stale_ramp_tokens=8)
    run = functools.partial(
        blend_prefill,
        tiny_llama,
        head,
        kvs,
        question,
        mode=mode,
        recompute_ratio=0.3,
        head_kv=head_kv,
        chunk_ids=chunks,
        settings=settings,
    )
    whole = run()
    monkeypatch.setattr(prefill_module, "place_whole", lambda *args: [])
    layered = run()
    assert torch.equal(whole.logits, layered.logits)
    for a, b in zip(_cache_kv(whole), _cache_kv(layered), strict=True):
        assert torch.equal(a, b)
