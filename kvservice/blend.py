"""CacheBlend (arXiv 2405.16444): prefill a prompt from cached chunk KV with selective recompute.

The prompt is ``[head][chunk 1]...[chunk n][question]``. Chunks' KV was precomputed after the
same fixed head (``kvservice.model.precompute_chunks``), with K stored before RoPE.

Modes, for one prompt:

* ``full``: ordinary prefill of every token; no cache is read.
* ``prefix``: prefix caching only. The head and the first chunk are exactly what was
  precomputed (same tokens at the same positions after the same head), so their KV is
  reused; every later token is recomputed.
* ``reuse``: every chunk's KV is reused as is, moved to its place by RoPE; only the question
  is computed.
* ``blend``: ``reuse``, then the chunk tokens whose stale KV matters most to this question are
  recomputed from layer 0 on, over the whole prompt, and their fresh KV overwrites the cached
  KV; the question is computed again over the result. Which tokens: the ones the question
  attends to most in the ``reuse`` pass, across the deeper layers (``attention_importance``).

``blend`` at ratio 1.0 is ``full``; at ratio 0 it is ``reuse``.

Why select by the question's attention and not by KV deviation (CacheBlend's HKVD)
----------------------------------------------------------------------------------
Measured with SmolLM2-135M on Musique (6 passages, ratio 0.15, teacher-forced KL of the first
16 answer tokens to full prefill; ``kvservice.bench``; the numbers are in ``docs/blend.md``):
an oracle that gives 15 % of the chunk tokens their true (full-prefill) KV recovers most of
reuse's error when the tokens are the ones the question attends to, and almost nothing when
they are the ones whose KV deviates most (the deviation concentrates on tokens nobody reads)
or the first tokens of each chunk. Selecting by the question's attention in a cheap reuse
pass, then recomputing those tokens, is the query-aware selection of ProphetKV / A^3; it
also makes blend cheaper than CacheBlend's gradual filtering, which runs its first check
layers over every chunk token.

The algorithm is a set of pure tensor functions plus one driver, ``blend_prefill``, that
writes into our ``KVCache``. A driver for another engine (vLLM's paged cache) reuses the
driver over the model's two layer halves (``Block.project`` then ``Block.finish``) and decides
itself where the resulting KV goes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F

from kvservice.chunk import LayeredKV
from kvservice.model import (
    KVCache,
    Transformer,
    apply_rope,
    attend,
    head_hash,
    position_mask,
    rope_cos_sin,
)

Mode = Literal["full", "prefix", "reuse", "blend"]
MODES: tuple[Mode, ...] = ("full", "prefix", "reuse", "blend")

# Selection defaults, chosen on Musique dev examples 0-19 only and reported on 20-39 (SmolLM2,
# 6 passages, ratio 0.15, teacher-forced KL of 16 answer tokens to full; docs/blend.md).
# Validation 20-39: KL mean 0.037 (median 0.027, p90 0.078) against reuse's 0.121; worse than
# reuse on 0 of 20; top-1 agreement 0.936 against 0.907. CacheBlend's HKVD selection (the
# previous default) gave 0.044 on the tuning examples where this gives 0.033 (reuse 0.101).
# Tuning 0-19, mean KL by the first layer the attention is read from: 0 -> 0.0349,
# 1/3 -> 0.0333, 1/2 -> 0.0344, 2/3 -> 0.0350.
ATTENTION_FROM_DEPTH = 1 / 3
# Smoothing the importance over neighbours (CacheClip) did not help once selection reads the
# question's attention: tuning KL 0.035 unsmoothed, 0.038 over 5 tokens, 0.044 over 11.
SMOOTH_WINDOW = 1
# The cached chunk keys blend does not recompute are read at an attention temperature of
# 1/0.9 (their keys scaled by 0.9 as they are placed; APE's temperature, issue #32): stale
# KV, computed without the other chunks, draws too sharp an attention. Tuning 0-9 at ratio
# 0.10 (auto precision): KL 0.036 against 0.043, better on 7 of 10; a logit bias of -0.5 on
# the same keys gave 0.042, the opposite corrections (x1.1, +0.5) +65 %. Validation 20-39:
# 0.10 KL 0.042 against 0.045, top-1 agreement 0.964 against 0.929 (better KL on 9 of 20);
# 0.15 0.035 against 0.037; 0.05 0.060 against 0.059 (docs/blend.md). Reuse reads the KV as
# stored (through the temperature it was worse). With chunks stored after the retrieval
# preamble (KV_PREAMBLE=on) the stale KV is less sharp and 0.95 fits it on Musique: tuning
# 1-19 at 0.10 0.0420 against 0.9's 0.0459 (better on 14 of 19); validation 20-39 0.05 / 0.10
# / 0.15: 0.042 / 0.034 / 0.029 against 0.050 / 0.039 / 0.034. Not the default: the product's
# handbook test answered 3 of its questions ungrounded with both (docs/blend.md).
STALE_KEY_SCALE = 0.9
# The temperature applies in full to a cached chunk after this many cached chunk tokens, in
# part before (``_stale_reading``); 0: in full to every stale chunk. On the handbook's short
# prompts (1-3 passages) the full temperature made blend worse than reuse on 8 of 14
# questions (bench.doc_fidelity). Tuning 0-19 at 0.10: 0 0.0444, 600 0.0450, 1200 0.0437,
# 2400 0.0424; validation 20-39 at 0.05 / 0.10 / 0.15: 0.0506 / 0.0385 / 0.0323 against
# 0.0525 / 0.0412 / 0.0346 (better on 15 / 14 / 15 of 20) (docs/blend.md).
STALE_RAMP_TOKENS = 2400
# Selection reads the layers up to this depth, and the reuse pass stops there. Tuning 0-19 at
# 0.15 (auto precision): to 30 of 30 layers 0.0361, 25 0.0367, 20 0.0377, 15 0.0426; the
# question's deep layers are worth their cost in memory (docs/blend.md).
ATTENTION_TO_DEPTH = 1.0
# What a cached chunk lacks from the context before it moves all its tokens' KV alike in good
# part: per chunk, layer and KV head, the mean over tokens of the true KV's difference from
# the stored KV holds ~35 % of K's difference and ~14 % of V's (tuning examples 0-3). The
# recompute pass measures that mean on the chunk's recomputed tokens (fresh minus stored,
# K before RoPE), drawn towards the mean over every chunk's recomputed tokens by 16 tokens'
# worth of it, and moves the chunk's other tokens by it, layer by layer, in proportion to the
# cached chunk tokens before it up to 1,200; their keys are then read at no temperature
# (``_shift_stale``). Tuning 0-19 against no shift: 0.10 KL 0.0424 -> 0.0189, 0.05 0.0532 ->
# 0.0257. Each chunk on its own mean: 0.0199 / 0.0317, and on as few as 1 token 4 of 20
# prompts at 0.05 got worse, one 3.6x; all chunks' mean alone 0.0203 / 0.0277; unramped
# 0.0193 / 0.0271, but on the handbook's short prompts worse than before on 10 of 14 (0.0254
# -> 0.0498 at 0.10); ramped over 1,200 tokens there 0.0239, over 2,400 0.0258 (docs/blend.md).
# Off by default: on examples no shift setting was chosen on it fails now and then, and
# badly. Musique-as-a-library validation 20-39 (bench.doc_fidelity --musique): 0.10 0.0609 ->
# 0.0695 (better on 14, worse on 6; p90 0.101 -> 0.074), because one prompt went 0.200 ->
# 0.557, worse than reuse (0.241); Musique validation 20-39 at 0.05: 0.0506 -> 0.0720, one
# prompt 0.051 -> 0.743 (at 0.10 0.0385 -> 0.0294, better on 15, worse on 5). Where it fails
# (library tuning example 1: 0.129 -> 0.350) the moved KV and the attention are closer to
# full's, and the answer turns at a near tie later on: no guard on the estimate sees that
# (docs/blend.md, stop 43). ``--blend stale_shift=1.0`` turns it on.
STALE_SHIFT = 0.0
STALE_SHIFT_MIN_TOKENS = 1
STALE_SHIFT_POOL = 16
STALE_SHIFT_RAMP_TOKENS = 1200
# Gemma 3's sliding-window layers (15 of 18 in the 270M, each reading the last 512 tokens)
# give the question's attention only to the last window of the context, so they draw the
# selection there: at 0.15 on Musique 72-79 % of the selected tokens lie in the last 512
# before the question, which hold 18-19 % of the candidates. Left out of the selection
# (weight 0: the global layers alone, 21-23 % there) blend got worse on tuning examples 0-4:
# KL 0.0284 against 0.0139, worse on 4 of 5. The last window is what 15 of 18 layers of the
# question read, so recomputing most of it is right (docs/blend.md, "Gemma 3", 2026-11-27).
LOCAL_LAYER_WEIGHT = 1.0


@dataclass(frozen=True)
class BlendSettings:
    """How blend selects what it recomputes (defaults chosen and reported as above); the
    bench's ``--blend NAME=VALUE`` sets them to compare selections on the same prompts."""

    attention_from_depth: float = ATTENTION_FROM_DEPTH  # ``attention_importance``
    # ... and the layer it stops at: the reuse pass ends there, and the recompute pass places
    # the deeper layers' cached KV as it reaches them (``_prefill``).
    attention_to_depth: float = ATTENTION_TO_DEPTH
    smooth_window: int = SMOOTH_WINDOW  # ``smooth_scores``
    rounds: int = 1  # selection rounds: each later one selects by the attention after the last
    first_round_share: float = 0.5  # of the budget, with rounds > 1
    chunk_starts: int = 0  # the first tokens of every cached chunk always recomputed (EPIC)
    stale_bias: float = 0.0  # added to the attention logits of stale keys (APE), ramped alike
    stale_key_scale: float = STALE_KEY_SCALE  # stale cached keys scaled: a temperature (APE)
    stale_ramp_tokens: int = STALE_RAMP_TOKENS  # ... in full only after that many cached tokens
    # each stale chunk's KV moved by this share of the mean difference between fresh and
    # stored KV over its recomputed tokens (``_shift_stale``); 0: off
    stale_shift: float = STALE_SHIFT
    stale_shift_min_tokens: int = STALE_SHIFT_MIN_TOKENS  # a chunk with fewer is not moved
    stale_shift_pool: int = STALE_SHIFT_POOL  # each chunk's estimate drawn to all chunks' mean
    stale_shift_ramp_tokens: int = STALE_SHIFT_RAMP_TOKENS  # ... in full after that many
    # how much the question's attention in a sliding-window layer (Gemma 3's local layers)
    # counts in selection against a global layer's (``local_layer_weights``); 1: alike
    local_layer_weight: float = LOCAL_LAYER_WEIGHT


# --------------------------------------------------------------------------------------------
# Pure tensor functions


def rerotate(k: torch.Tensor, old_pos: torch.Tensor, new_pos: torch.Tensor, inv_freq: torch.Tensor):
    """Move rotated keys ``k [..., T, D]`` from positions ``old_pos [T]`` to ``new_pos [T]``.

    RoPE rotations compose, so rotating by ``new - old`` is exact. (Our chunk K is stored
    before RoPE, i.e. at "no position", and is simply rotated to the new positions; this is
    for caches that keep K rotated.)"""
    cos, sin = rope_cos_sin(inv_freq, new_pos - old_pos)
    return apply_rope(k, cos, sin)


def rotate_into(
    dest: torch.Tensor,
    k_pre: torch.Tensor | Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float | torch.Tensor = 1.0,
) -> None:
    """Write pre-RoPE keys ``k_pre [H_kv, n, D]`` into ``dest [H_kv, n, D]`` (a cache slice)
    rotated by ``cos``/``sin`` ``[n, R]``: ``apply_rope`` computed in place, in float32.
    One copy (which also widens a float16 store) and four in-place products instead of
    ``apply_rope``'s seven temporaries and a copy: placing the cached chunks was ~45 % of the
    reuse pass (3,700 tokens, 30 layers). A bfloat16 cache gets the float32 result rounded
    once (8 bits of mantissa). The keys are multiplied by ``scale`` on the way (a number, or
    one per token, ``[n, 1]``: ``_Stale.key_scale``): a rotation is linear, so scaled tables
    give it in the same passes. ``k_pre`` may be consecutive segments' keys, ``[H_kv, n_j,
    D]`` each (``_place_sources``): copied in side by side, then rotated as one."""
    rotary = cos.shape[-1]  # < D with partial rotary: the other dims stay as copied
    half = rotary // 2
    work = dest if dest.dtype == torch.float32 else torch.empty(dest.shape, device=dest.device)
    if isinstance(k_pre, torch.Tensor):
        work.copy_(k_pre)
    else:  # one call, widening as it copies
        torch.cat([part.to(work.device) for part in k_pre], dim=1, out=work)
    x1, x2 = work[..., :half], work[..., half:rotary]
    cos_h, sin_h = cos[..., :half].float(), sin[..., :half].float()
    if isinstance(scale, torch.Tensor) or scale != 1.0:
        cos_h, sin_h = cos_h * scale, sin_h * scale
        if rotary < work.shape[-1]:
            work[..., rotary:] *= scale
    x1_sin = x1 * sin_h
    x1.mul_(cos_h).addcmul_(x2, sin_h, value=-1)  # x1 cos - x2 sin
    x2.mul_(cos_h).add_(x1_sin)  # x2 cos + x1 sin
    if work is not dest:
        dest.copy_(work)


def attend_and_weigh(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    sliding_window: int | None = None,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the question's queries ``q [H, S, D]`` (rotated) over a layer's keys
    ``k, v [H_kv, T, D]`` (rotated, at sorted positions ``key_pos``), causal by position, and
    the weights it paid each key.

    Returns the output ``[H, S, D]`` (what SDPA gives) and the weights averaged over heads
    and queries, ``[T]``, summing to 1. One explicit computation gives both: for the few
    question tokens it is faster than SDPA plus a second pass for the weights (5 against
    10-12 ms a layer for 45 queries over 3,700 keys here), and the query heads that share a
    key head are stacked into one matrix product instead of copying the keys per head."""
    heads, length, dim = q.shape
    kv_heads, num_keys = k.shape[0], k.shape[1]
    group = heads // kv_heads
    stacked = (q * (1.0 / math.sqrt(dim))).to(k.dtype).reshape(kv_heads, group * length, dim)
    scores = (stacked @ k.transpose(1, 2)).view(kv_heads, group, length, num_keys)
    if key_bias is not None:
        scores += key_bias.to(scores.dtype)
    # Keys at or before the first query's position are seen by every query (key_pos sorted):
    # only the ones after it are masked (the question's own, when it ends the prompt).
    seen = (
        0
        if sliding_window is not None
        else int(torch.searchsorted(key_pos, query_pos.min(), right=True))
    )
    visible = position_mask(query_pos, key_pos[seen:], sliding_window=sliding_window)  # [S, T']
    scores[..., seen:].masked_fill_(~visible, float("-inf"))
    # In the scores' dtype (softmax accumulates in float32): a bfloat16 cache's weights are
    # rounded as SDPA rounds them before its second product, and no float32 copy is made.
    weights = torch.softmax(scores, dim=-1)  # [H_kv, G, S, T]
    out = (weights.view(kv_heads, group * length, num_keys) @ v.to(weights.dtype)).view(
        heads, length, dim
    )
    return out, weights.sum(dim=(0, 1, 2), dtype=torch.float32) / (kv_heads * group * length)


def attention_importance(
    attention: torch.Tensor,
    candidate: torch.Tensor,
    from_depth: float = ATTENTION_FROM_DEPTH,
    to_depth: float = 1.0,
    num_layers: int | None = None,
    layer_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """How much each token's KV matters to the question, ``[T]`` (0 for non-candidates).

    ``attention [L', T]`` is what ``attend_and_weigh`` gave per layer in the reuse pass, for
    its first ``L'`` layers of ``num_layers`` (all by default); ``candidate [T]`` marks the
    tokens that may be recomputed. Each layer's attention is normalized over the candidates
    (so layers whose question reads mostly the head or itself count as much as the others),
    then averaged over the layers from ``from_depth`` of the depth to ``to_depth``
    (``selection_layers``): the early layers' attention is broad and positional, the deeper
    layers' is what decides the answer. ``layer_weights [L]`` weighs the layers' shares in
    that average (``local_layer_weights``); None: alike.
    """
    first, stop = selection_layers(num_layers or attention.shape[0], from_depth, to_depth)
    if stop > attention.shape[0]:
        raise ValueError(f"attention of {attention.shape[0]} layers, selection reads {stop}")
    over_candidates = attention[first:stop] * candidate  # [L', T]
    share = over_candidates / over_candidates.sum(dim=1, keepdim=True).clamp_min(1e-12)
    if layer_weights is None:
        return share.mean(dim=0)  # [T]
    weights = layer_weights[first:stop].to(share)
    if float(weights.sum()) <= 0.0:  # no layer left to read: read them alike
        return share.mean(dim=0)
    return (weights[:, None] * share).sum(dim=0) / weights.sum()  # [T]


def local_layer_weights(windows: Sequence[int | None], local_weight: float) -> torch.Tensor | None:
    """Each layer's weight in ``attention_importance``: ``local_weight`` for a layer with a
    sliding window, 1 for a global one; None where that makes no difference."""
    if local_weight == 1.0 or all(w is None for w in windows) or all(windows):
        return None
    return torch.tensor([1.0 if w is None else local_weight for w in windows])


def selection_layers(num_layers: int, from_depth: float, to_depth: float) -> tuple[int, int]:
    """The layers ``[first, stop)`` selection reads the question's attention in: from
    ``from_depth`` of the depth to ``to_depth`` of it, at least one."""
    if not 0.0 <= from_depth < to_depth <= 1.0:
        raise ValueError(f"need 0 <= from_depth < to_depth <= 1, got {from_depth}, {to_depth}")
    first = min(int(from_depth * num_layers), num_layers - 1)
    return first, max(first + 1, math.ceil(to_depth * num_layers - 1e-9))


def smooth_scores(scores: torch.Tensor, window: int) -> torch.Tensor:
    """Each token's score averaged with its neighbours' (``window`` tokens, odd): recomputed
    neighbourhoods instead of scattered single tokens (CacheClip). 1: no smoothing."""
    if window <= 1 or scores.numel() <= 1:
        return scores
    if window % 2 == 0:
        raise ValueError(f"the smoothing window must be odd, got {window}")
    pooled = F.avg_pool1d(
        scores[None, None].float(), window, 1, window // 2, count_include_pad=False
    )
    return pooled[0, 0]


def top_tokens(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` highest scores, in increasing (position) order."""
    count = max(0, min(count, scores.numel()))
    return torch.topk(scores, count, sorted=False).indices.sort().values


def select_recompute(importance: torch.Tensor, candidate: torch.Tensor, count: int) -> torch.Tensor:
    """Slots ``[count]`` (sorted) of the most important candidates; never a non-candidate."""
    count = min(count, int(candidate.sum()))
    scores = importance.float().masked_fill(~candidate, float("-inf"))
    return top_tokens(scores, count)


@dataclass(frozen=True)
class QueryGroups:
    """Selected queries cut into groups by position, each with the keys it may read: built
    once per pass (``group_queries``) and used by every layer (``attend_grouped``)."""

    spans: list[slice]  # each group's queries
    n_keys: list[int]  # each group reads keys [0, n_keys)
    masks: list[torch.Tensor]  # additive, 0 or -inf: [heads_per_key * S_g, n_keys] each


# PyTorch's CPU flash attention cuts a call's queries into 256-row blocks from 768 rows on,
# and into 32- or 64-row blocks below, which run ~15 % slower per (query, key) pair here.
MIN_ROWS_PER_CALL = 768
# On a GPU one call per layer: the launches of the CPU's cut (~12 calls a layer at 16,384
# tokens) cost more than the masked work they skip. Blend 0.15 of Llama-3-8B's shape on an
# H200, 12 chunks from CPU memory / the GPU tier (docs/long_context_gpu/h200_s44_ab.txt):
# 4,096 tokens 0.192 / 0.202 -> 0.171 / 0.186 s, 8,192 0.272 / 0.304 -> 0.237 / 0.254,
# 16,384 0.373 / 0.348 -> 0.352 / 0.378 (a wash there).
GPU_ROWS_PER_CALL: int | None = None


def group_queries(
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    heads_per_key: int,
    sliding_window: int | None = None,
    min_rows: int | None = MIN_ROWS_PER_CALL,
    dtype: torch.dtype = torch.float32,
    key_bias: torch.Tensor | None = None,
) -> QueryGroups:
    """Cut queries at positions ``query_pos [S]`` (sorted) over keys at ``key_pos [T]``
    (position order) into groups of consecutive queries that each read only the keys up to
    their last position: the same result as one masked call over all keys, without the
    masked scores past each group.

    ``attend_grouped`` stacks the ``heads_per_key`` query heads that share a key head into
    one call's rows, so a group of ``n`` queries is ``heads_per_key * n`` rows; the groups
    are as many, of equal size, as leave each call at least ``min_rows`` rows (None: one
    group). One layer of
    a blend at 0.15 (tuning examples 0-3, layers 5, 15 and 25: 572-596 queries over
    3,631-3,758 keys; medians of 9): 2 stacked groups 20.1 ms, 1 group 21.2, 3 groups 21.9,
    4 groups 22.2, the previous 8 groups of equal key spans with SDPA's GQA 23.1.
    The masks are additive (SDPA converts a boolean mask on every call) and repeated per
    stacked head (``heads_per_key * S`` rows of keys in all, built once per pass)."""
    count = query_pos.numel()
    n_groups = 1 if min_rows is None else max(1, min(count, heads_per_key * count // min_rows))
    bounds = [count * g // n_groups for g in range(n_groups + 1)]
    spans, n_keys, masks = [], [], []
    for start, stop in itertools.pairwise(bounds):
        group_pos = query_pos[start:stop]
        keys = int(torch.searchsorted(key_pos, group_pos[-1], right=True))
        visible = position_mask(group_pos, key_pos[:keys], sliding_window=sliding_window)
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        if key_bias is not None:
            mask += key_bias[:keys].to(dtype)
        spans.append(slice(start, stop))
        n_keys.append(keys)
        masks.append(mask.masked_fill_(~visible, float("-inf")).repeat(heads_per_key, 1))
    return QueryGroups(spans, n_keys, masks)


def attend_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: QueryGroups
) -> torch.Tensor:
    """Attention of selected queries ``q [1, H, S, D]`` over a layer's keys ``k, v
    [1, H_kv, T, D]``, causal by real position, one SDPA call per group (``group_queries``)
    with the query heads that share a key head stacked as rows. Returns ``[1, H, S, D]``."""
    _, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    outputs = []
    for span, keys, mask in zip(groups.spans, groups.n_keys, groups.masks, strict=True):
        n = span.stop - span.start
        rows = q[0, :, span].to(k.dtype).reshape(1, kv_heads, heads // kv_heads * n, dim)
        out = F.scaled_dot_product_attention(rows, k[:, :, :keys], v[:, :, :keys], attn_mask=mask)
        outputs.append(out.reshape(1, heads, n, dim))  # CUDA's SDPA may return other strides
    return torch.cat(outputs, dim=2)


# --------------------------------------------------------------------------------------------
# The prompt's layout


@dataclass
class Segment:
    start: int  # first position in the prompt
    length: int
    source: LayeredKV | None  # cached KV to read, or None when computed fresh
    kind: Literal["head", "chunk", "question", "prefix"]

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass
class BlendResult:
    logits: torch.Tensor  # [V] next-token logits after the last prompt token
    cache: KVCache  # batch 1; slots [0, num_tokens) hold the prompt (K rotated)
    num_tokens: int  # prompt length; the next token goes at this position
    recomputed_per_layer: list[int] = field(default_factory=list)  # tokens computed per layer
    recompute_ratio_effective: float = 0.0  # share of chunk tokens recomputed
    question_attention: torch.Tensor | None = None  # [L, T] what blend selected by, if it did
    # what ``refresh`` needs of a blend that selected: its plan and the prompt's token ids
    plan: _Plan | None = field(default=None, repr=False)
    token_ids: torch.Tensor | None = field(default=None, repr=False)

    @property
    def next_position(self) -> int:
        return self.num_tokens


def _layout(
    head_ids: Sequence[int],
    chunks: Sequence[LayeredKV | None],
    chunk_ids: Sequence[Sequence[int]] | None,
    question_ids: Sequence[int],
    head_kv: LayeredKV | None,
    mode: Mode,
) -> list[Segment]:
    segments = [Segment(0, len(head_ids), head_kv, "head")] if head_ids else []
    position = len(head_ids)
    for j, chunk in enumerate(chunks):
        if chunk is None:  # a cache miss: computed like in full prefill
            if chunk_ids is None:
                raise ValueError(f"chunk {j} is not cached and its token ids are not given")
            segments.append(Segment(position, len(chunk_ids[j]), None, "chunk"))
            position += len(chunk_ids[j])
            continue
        if chunk_ids is not None and len(chunk_ids[j]) != chunk.num_tokens:
            raise ValueError(
                f"chunk {j}: {len(chunk_ids[j])} token ids but {chunk.num_tokens} cached"
            )
        source: LayeredKV | None = chunk
        # Prefix caching reuses only KV computed at the very same place: the first chunk,
        # precomputed after this same head.
        exact = j == 0 and getattr(chunk, "head_hash", None) == head_hash(head_ids)
        if mode == "full" or (mode == "prefix" and not exact):
            source = None
        segments.append(Segment(position, chunk.num_tokens, source, "chunk"))
        position += chunk.num_tokens
    segments.append(Segment(position, len(question_ids), None, "question"))
    cached = any(seg.source is not None for seg in segments[1:])
    if segments[0].kind == "head" and (mode == "full" or not cached):
        # Nothing after the head is cached (full prefill, or every chunk a miss): the head is
        # computed too. Its ~100 tokens cost less than attending everything after a cached
        # head through the masked path (1.3x full prefill on 2 cores, where the loading
        # controller chose full prefill over a slow link).
        segments[0].source = None
    return segments


def _with_prefix(segments: list[Segment], prefix: LayeredKV | None) -> list[Segment]:
    """The segments that end within ``prefix`` (a previous prompt's KV, K rotated at its
    positions: ``kvservice.prefix.PrefixKV``) replaced by one segment read from it as is."""
    if prefix is None:
        return segments
    covered = [seg for seg in segments if seg.stop <= prefix.num_tokens]
    if not covered or covered[-1].stop != prefix.num_tokens or covered[-1].kind == "question":
        raise ValueError("a cached prefix must end at a segment boundary before the question")
    return [Segment(0, prefix.num_tokens, prefix, "prefix"), *segments[len(covered) :]]


def _candidates(segments: list[Segment], head_ids: Sequence[int], num_tokens: int, device):
    """``[T]`` bool: the cached chunk tokens blend may recompute. The first chunk is exact
    when it was precomputed after this same head (it sits where it was computed), so it is
    not one."""
    candidate = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    for seg in (s for s in segments if s.kind == "chunk"):
        at_home = seg.start == len(head_ids)  # right after the head, where it was computed
        exact = at_home and getattr(seg.source, "head_hash", None) == head_hash(head_ids)
        if seg.source is not None and not exact:
            candidate[seg.start : seg.stop] = True
    return candidate


# --------------------------------------------------------------------------------------------
# The driver over our KVCache


@dataclass
class _Pass:
    """One pass over the layers: ``active`` slots are computed from layer 0 on, attending to
    the whole cache; the rest of the cache is read as it stands."""

    logits: torch.Tensor | None  # [V] after the last active token (None: stopped early)
    attention: torch.Tensor | None  # [L', T] the question's attention per layer run, if recorded


@dataclass(frozen=True)
class _Stale:
    """How the cached chunk KV that was not recomputed is read (``BlendSettings``'
    ``stale_bias`` and ``stale_key_scale``): ``spans`` are the cached chunks' slots."""

    spans: tuple[slice, ...] = ()
    key_scales: tuple[float, ...] = ()  # per span
    bias: torch.Tensor | None = None  # [T] added to every active query's logits
    unseen: tuple[int, ...] = ()  # per span: the cached chunk tokens before it

    def key_scale(self, start: int, stop: int) -> float:
        for span, scale in zip(self.spans, self.key_scales, strict=True):
            if (span.start, span.stop) == (start, stop):
                return scale
        return 1.0


@dataclass(frozen=True)
class _Attention:
    """Who attends how in one pass, built once and used by every layer (``_attend_layer``)."""

    positions: torch.Tensor  # [T] key positions (slot = position)
    active: torch.Tensor  # [S] the computed slots
    grouped: int  # the active queries before the recorded question (all when none is)
    question_length: int  # the last that many active tokens' attention is recorded
    everything: bool  # every slot is active: plain causal prefill
    groups: QueryGroups | None
    last_query: QueryGroups
    window: int | None
    bias: torch.Tensor | None
    layer: int  # the first layer of this plan's window (``Transformer.mask``)


def _attention_plan(model, cache, active, num_tokens, question_length, bias, layer) -> _Attention:
    """Layer ``layer``'s plan; every layer with the same sliding window shares it."""
    config, positions = model.config, torch.arange(num_tokens, device=model.device)
    window, dtype = config.window(layer), cache.k.dtype
    heads_per_key = config.n_heads // config.n_kv_heads
    grouped = active.numel() - question_length
    everything = active.numel() == num_tokens

    rows = MIN_ROWS_PER_CALL if model.device.type == "cpu" else GPU_ROWS_PER_CALL

    def groups_of(queries: torch.Tensor) -> QueryGroups:
        return group_queries(queries, positions, heads_per_key, window, rows, dtype, bias)

    groups = groups_of(active[:grouped]) if grouped and not everything else None
    return _Attention(positions, active, grouped, question_length, everything, groups,
                      groups_of(active[-1:]), window, bias, layer)  # fmt: skip


def _attend_layer(model, plan: _Attention, q, k_layer, v_layer, last: bool):
    """One layer's attention output ``[1, H, S', D]`` for the active queries (only the last
    one's in the last layer) and, when the question is recorded, its weights ``[T]``."""
    if plan.question_length:
        out, weights = attend_and_weigh(
            q[0, :, plan.grouped :], k_layer[0], v_layer[0], plan.active[plan.grouped :],
            plan.positions, plan.window, plan.bias,
        )  # fmt: skip
        if plan.groups is not None and not last:
            before = attend_grouped(q[:, :, : plan.grouped], k_layer, v_layer, plan.groups)
            return torch.cat([before, out[None]], 2), weights
        return out[None], weights
    if last:
        return attend_grouped(q[:, :, -1:], k_layer, v_layer, plan.last_query), None
    if plan.everything:
        mask = model.mask(plan.positions, plan.positions, layer=plan.layer)
        return attend(q, k_layer, v_layer, mask), None
    return attend_grouped(q, k_layer, v_layer, plan.groups), None


@dataclass(frozen=True)
class _Placing:
    """Cached segments that sit side by side, placed as one (``_place_sources``): their keys
    rotated in one pass, each token's by its segment's scale (``scale``: one number when they
    share it, else ``[n, 1]``); a cached prefix (already rotated) is copied alone."""

    segments: tuple[Segment, ...]
    span: slice
    scale: float | torch.Tensor
    rotated: bool = False


def _placings(sources: Sequence[Segment], stale: _Stale, device) -> list[_Placing]:
    """``sources`` (in prompt order) cut into runs of adjacent segments to rotate together."""
    runs: list[list[Segment]] = []
    for seg in sources:
        after = runs[-1][-1] if runs else None
        if after is not None and after.stop == seg.start and "prefix" not in (after.kind, seg.kind):
            runs[-1].append(seg)
        else:
            runs.append([seg])
    placings = []
    for run in runs:
        scales = [stale.key_scale(seg.start, seg.stop) for seg in run]
        scale: float | torch.Tensor = scales[0]
        if len(set(scales)) > 1:
            per_token = [torch.full((seg.length, 1), s) for seg, s in zip(run, scales, strict=True)]
            scale = torch.cat(per_token).to(device)
        span = slice(run[0].start, run[-1].stop)
        placings.append(_Placing(tuple(run), span, scale, run[0].kind == "prefix"))
    return placings


def _place_sources(cache, i: int, placings: Sequence[_Placing], cos_all, sin_all) -> None:
    """Layer ``i`` of every cached segment written into the cache, rotated to its place (a
    cached prefix is already rotated), stale chunk keys scaled by ``_Stale.key_scale``. The
    segments side by side go as one run (``_placings``): on a GPU a rotation per chunk and
    layer was ~8 small operations each, what the host spent most of a reuse on."""
    for placing in placings:
        layers = [seg.source.layer(i) for seg in placing.segments]  # [H_kv, n, D] pairs
        span = placing.span
        if placing.rotated:
            cache.k[i, 0, :, span] = layers[0][0]
        else:
            keys = [k for k, _ in layers]
            rotate_into(cache.k[i, 0, :, span], keys[0] if len(keys) == 1 else keys,
                        cos_all[span], sin_all[span], placing.scale)  # fmt: skip
        values = [v.to(cache.v.device) for _, v in layers]
        torch.cat(values, dim=1, out=cache.v[i, 0, :, span])


@dataclass(frozen=True)
class _Shift:
    """The stale chunks of a recompute pass (``_shift_stale``): as they were placed
    (``stale``: their slots and key scales), per chunk the rows of ``active`` it recomputes,
    and how much each is moved."""

    stale: _Stale
    rows: tuple[torch.Tensor, ...]
    shares: tuple[float, ...]  # per chunk: how much of its estimate it is moved by (0: not)
    pool: int  # recomputed tokens' worth of the mean over every chunk in each chunk's estimate


def _stale_shift(stale: _Stale, active: torch.Tensor, settings: BlendSettings) -> _Shift | None:
    """What ``_shift_stale`` measures and moves in a recompute pass over ``active``: every
    stale chunk's recomputed tokens are measured; a chunk with at least
    ``stale_shift_min_tokens`` of them is moved by ``stale_shift`` of its estimate, or, with
    ``stale_shift_ramp_tokens``, by as much of that as the cached chunk tokens before it make
    up of that many (the context its stored KV never saw)."""
    if not settings.stale_shift or not stale.spans:
        return None
    rows = tuple(
        ((active >= span.start) & (active < span.stop)).nonzero().squeeze(1) for span in stale.spans
    )
    ramp = settings.stale_shift_ramp_tokens
    shares = tuple(
        settings.stale_shift * (min(1.0, unseen / ramp) if ramp else 1.0)
        if r.numel() >= settings.stale_shift_min_tokens else 0.0
        for r, unseen in zip(rows, stale.unseen, strict=True)
    )  # fmt: skip
    if not any(shares) or not any(r.numel() for r in rows):
        return None
    return _Shift(stale, rows, shares, settings.stale_shift_pool)


def _shift_stale(cache, i: int, shift: _Shift, k_pre, v, active, cos_all, sin_all) -> None:
    """Layer ``i`` of each moved chunk shifted by its share (``shift.shares``) of the mean
    difference, over its recomputed tokens, between their fresh KV (``k_pre``, before RoPE,
    and ``v``: ``[1, H_kv, S, D]`` for the ``active`` slots) and the stored KV the cache still
    holds there; with ``shift.pool``, that many tokens' worth of the mean over every stale chunk's
    recomputed tokens joins each chunk's own. The difference in K is taken before RoPE and
    the stale temperature (the keys' placing scale) and put back through RoPE at every slot
    of the chunk, whose keys are then read at no temperature: the shift corrects what the
    temperature only dampened. Before the fresh KV is written."""
    sums = []  # per chunk: summed differences of K and V [H_kv, 1, D], and their count
    for scale, rows in zip(shift.stale.key_scales, shift.rows, strict=True):
        if not rows.numel():
            sums.append((0.0, 0.0, 0))
            continue
        slots = active[rows]
        placed = cache.k[i, 0, :, slots].float()  # [H_kv, m, D]: rotated and scaled
        stored = apply_rope(placed, cos_all[slots], -sin_all[slots]) / scale
        dk = (k_pre[0, :, rows].float() - stored).sum(1, keepdim=True)
        dv = (v[0, :, rows].float() - cache.v[i, 0, :, slots].float()).sum(1, keepdim=True)
        sums.append((dk, dv, rows.numel()))
    count = sum(n for _, _, n in sums)
    pooled_k = sum(dk for dk, _, _ in sums) / count
    pooled_v = sum(dv for _, dv, _ in sums) / count
    dtype = cache.k.dtype
    for span, scale, share, (dk, dv, n) in zip(
        shift.stale.spans, shift.stale.key_scales, shift.shares, sums, strict=True
    ):
        if not share or n + shift.pool == 0:
            continue
        weight = share / (n + shift.pool)
        moved_k = apply_rope((dk + shift.pool * pooled_k) * weight, cos_all[span], sin_all[span])
        keys = cache.k[i, 0, :, span]
        if scale != 1.0:
            keys.mul_(1.0 / scale)
        keys.add_(moved_k.to(dtype))
        cache.v[i, 0, :, span] += ((dv + shift.pool * pooled_v) * weight).to(dtype)


@torch.no_grad()
def _run_pass(
    model: Transformer,
    cache: KVCache,
    token_ids: torch.Tensor,
    active: torch.Tensor,
    *,
    sources: Sequence[Segment] = (),
    question_length: int = 0,
    stale: _Stale = _Stale(),
    until: int | None = None,
    place_from: int = 0,
    shift: _Shift | None = None,
) -> _Pass:
    """Compute the ``active`` slots (sorted; the last one is the prompt's last token) through
    every layer, or the first ``until`` (no logits then). ``sources``' cached KV is written
    into the cache (rotated to its place) as each layer from ``place_from`` on begins, so
    ``.layer(i)`` is read once per layer in order and a loader may prefetch the next one
    meanwhile. With ``question_length``, the attention of the last that many active tokens
    (the question) is recorded per layer."""
    num_tokens, config = token_ids.numel(), model.config
    until = config.n_layers if until is None else until
    ropes = model.ropes(torch.arange(num_tokens, device=model.device))  # per layer: [T, R] x2
    x = model.embed(token_ids[active])[None]  # x: [1, S, dim]
    plans: dict[int | None, _Attention] = {}  # per sliding window (Gemma 3 has two)
    placings = _placings(sources, stale, model.device)
    attention = []
    for i, layer in enumerate(model.layers[:until]):
        cos_all, sin_all = ropes[i]
        cos_a, sin_a = cos_all[active][None], sin_all[active][None]  # [1, S, R]
        window = config.window(i)
        if window not in plans:
            plans[window] = _attention_plan(
                model, cache, active, num_tokens, question_length, stale.bias, i
            )
        plan = plans[window]
        if placings and i >= place_from:
            _place_sources(cache, i, placings, cos_all, sin_all)
        q, k_pre, v = layer.project(x, cos_a, sin_a)  # q: [1, H, S, D]; k, v: [1, H_kv, S, D]
        if shift is not None:
            _shift_stale(cache, i, shift, k_pre, v, active, cos_all, sin_all)
        k_rot = apply_rope(k_pre, cos_a[:, None], sin_a[:, None])[0]
        cache.k[i, 0, :, active] = k_rot.to(cache.k.dtype)  # index_put does not convert
        cache.v[i, 0, :, active] = v[0].to(cache.v.dtype)
        k_layer, v_layer = cache.k[i, :, :, :num_tokens], cache.v[i, :, :, :num_tokens]
        last = i == config.n_layers - 1
        out, weights = _attend_layer(model, plan, q, k_layer, v_layer, last)
        if weights is not None:
            attention.append(weights)
        if last:  # after the last layer only the last token's output counts
            x, out = x[:, -1:], out[:, :, -1:]
        x = layer.finish(x, out)
    logits = model.logits(x[0, -1]) if until == config.n_layers else None
    return _Pass(logits, torch.stack(attention) if attention else None)


def _checked(mode, recompute_ratio, chunks, chunk_ids, question_ids, cached_prefix):
    """The request's arguments checked; returns the chunks' token ids (None: not known,
    which only ``reuse`` can do without)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (one of {MODES})")
    if not 0.0 <= recompute_ratio <= 1.0:
        raise ValueError(f"recompute ratio must be in [0, 1], got {recompute_ratio}")
    if not question_ids:
        raise ValueError("the question part of the prompt must not be empty")
    if cached_prefix is not None and mode == "full":
        raise ValueError("full prefill computes every token: no cached prefix")
    if chunk_ids is None:
        chunk_ids = [getattr(c, "token_ids", None) for c in chunks]
        if any(ids is None for ids in chunk_ids):
            if mode != "reuse":
                raise ValueError(f"mode {mode!r} needs the chunks' token ids")
            return None
    return chunk_ids


def _prompt_ids(segments, head_ids, chunk_ids, question_ids, device) -> torch.Tensor:
    """``[T]`` the prompt's token ids (zeros for chunks whose ids are not known: ``reuse``
    never computes them)."""
    ids = list(head_ids)
    chunk_segments = [s for s in segments if s.kind == "chunk"]
    for j, seg in enumerate(chunk_segments):
        ids += list(chunk_ids[j]) if chunk_ids is not None else [0] * seg.length
    return torch.tensor(ids + list(question_ids), device=device)


@torch.no_grad()
def blend_prefill(
    model: Transformer,
    head_ids: Sequence[int],
    chunks: Sequence[LayeredKV | None],
    question_ids: Sequence[int],
    *,
    mode: Mode = "blend",
    recompute_ratio: float = 0.15,
    chunk_ids: Sequence[Sequence[int]] | None = None,
    head_kv: LayeredKV | None = None,
    extra_capacity: int = 0,
    settings: BlendSettings = BlendSettings(),
    recompute_slots: Sequence[int] | None = None,
    cached_prefix: LayeredKV | None = None,
) -> BlendResult:
    """Prefill ``[head][chunks...][question]`` in one of the four modes; see the module doc.

    ``chunks`` give cached KV (``.layer(i)`` is called once per layer, in increasing order,
    when that layer is processed, so a loader may prefetch the next layer meanwhile); None
    marks a chunk that is not cached (a miss), computed in full from ``chunk_ids``.
    ``chunk_ids`` are the chunks' token ids: needed by ``full`` and ``prefix`` (which compute
    chunk tokens from scratch) and by ``blend`` (which recomputes some); a ``ChunkKV`` carries
    its own. ``head_kv`` is the head's precomputed KV (computed here when absent; it is tiny).
    ``extra_capacity`` leaves room in the returned cache for decoding.

    ``blend`` recomputes ``ceil(recompute_ratio * chunk tokens)`` of the cached chunk tokens
    (the first chunk is exact when precomputed after this head, and never recomputed): the
    ones ``attention_importance`` ranks first, after ``smooth_scores`` (``settings``);
    ``recompute_slots`` fixes the set instead (positions in the prompt; for experiments and
    tests).

    ``cached_prefix`` is the KV of the prompt's first ``cached_prefix.num_tokens`` slots as an
    earlier prompt left them (``kvservice.prefix``: a follow-up sharing the previous turn's
    passages): read as is, never recomputed, and not counted in the chunk tokens the ratio
    applies to; it must end at a segment boundary. Not in ``full`` mode.
    """
    chunk_ids = _checked(mode, recompute_ratio, chunks, chunk_ids, question_ids, cached_prefix)
    device, config = model.device, model.config
    segments = _layout(head_ids, chunks, chunk_ids, question_ids, head_kv, mode)
    num_tokens = segments[-1].stop
    token_ids = _prompt_ids(segments, head_ids, chunk_ids, question_ids, device)
    segments = _with_prefix(segments, cached_prefix)
    cache = KVCache(config, 1, num_tokens + extra_capacity, device, model.cache_dtype, num_tokens)
    cache.reserve(torch.arange(num_tokens, device=device)[None])

    plan = _plan(segments, head_ids, mode, recompute_ratio, recompute_slots, settings, device)
    return _prefill(model, cache, token_ids, plan)


def can_refresh(result: BlendResult) -> bool:
    """Whether ``refresh`` can upgrade ``result``: a blend that selected its tokens in one
    round (not reuse, full, fixed slots, or a blend with nothing left to select)."""
    plan = result.plan
    return (
        plan is not None and result.question_attention is not None
        and result.token_ids is not None and plan.slots is None and plan.settings.rounds == 1
    )  # fmt: skip


@torch.no_grad()
def refresh(
    model: Transformer, result: BlendResult, answer_ids: Sequence[int], ratio: float
) -> BlendResult:
    """Progressive blend: the cache of a blend that selected (``result``) upgraded to
    ``ratio`` once the first answer tokens (``answer_ids``, not yet in the cache) are known.
    The top ``ratio`` of the same first-pass attention (which holds what was recomputed),
    the question and the answer tokens are computed again from layer 0 over the cache: the
    cache then holds what a blend at ``ratio`` followed by those tokens would hold. Returns
    the logits after the last answer token (the next one's), the cache ``result``'s, grown
    by the answer. Of blend 0.10's teacher-forced KL the first answer token holds ~7 %:
    first token at 0.10, the rest over 0.25 gave 0.0238 on validation against 0.0385
    (docs/blend.md, "Progressive blend")."""
    if not can_refresh(result):
        raise ValueError(
            "only a blend that selected its tokens itself, not in several selection rounds, "
            "can be refreshed"
        )
    plan, attention, ids = result.plan, result.question_attention, result.token_ids
    if not answer_ids:
        raise ValueError("refresh needs the answer tokens since the prefill")
    n, extra = result.num_tokens, len(answer_ids)
    answer = torch.as_tensor(list(answer_ids), dtype=ids.dtype, device=ids.device)
    cache = result.cache
    cache.truncate(n)
    cache.reserve(torch.arange(n, n + extra, device=ids.device)[None])
    question = plan.segments[-1]
    no = torch.zeros(extra, dtype=torch.bool, device=ids.device)
    stale = plan.stale
    if stale.bias is not None:
        stale = replace(stale, bias=F.pad(stale.bias, (0, extra)))
    longer = replace(
        plan, segments=[*plan.segments[:-1], replace(question, length=question.length + extra)],
        candidate=torch.cat([plan.candidate, no]), computed=torch.cat([plan.computed, no]),
        budget=_budget("blend", ratio, plan.chunk_tokens, int(plan.candidate.sum()), None),
        stale=stale,
    )  # fmt: skip
    logits, selected, passes = _recompute(
        model, cache, torch.cat([ids, answer]), longer, F.pad(attention, (0, extra)), None
    )
    share = selected.numel() / max(1, plan.chunk_tokens)
    computed = [passes] * model.config.n_layers
    return BlendResult(logits, cache, n + extra, computed, share, attention)


def _plan(segments, head_ids, mode, ratio, recompute_slots, settings, device) -> _Plan:
    """What blend computes: the slots not cached (pass 1), the candidates and the budget of
    the recompute rounds after it."""
    num_tokens = segments[-1].stop
    candidate = _candidates(segments, head_ids, num_tokens, device)
    chunk_tokens = sum(s.length for s in segments if s.kind == "chunk")
    slots = None if recompute_slots is None else len(recompute_slots)
    budget = _budget(mode, ratio, chunk_tokens, int(candidate.sum()), slots)
    computed = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    for seg in segments:
        if seg.source is None:
            computed[seg.start : seg.stop] = True
    if budget and budget == int(candidate.sum()):  # everything: one pass, as full
        computed |= candidate
        budget = 0
    # The corrections of stale KV belong to blend: reuse read through them was worse
    # (validation example 20 at a temperature of 1/0.9: 0.161 against 0.149).
    stale = _stale_reading(segments, candidate & ~computed, settings) if budget else _Stale()
    plan = _Plan(segments, candidate, computed, budget, chunk_tokens, mode == "blend", settings,
                 stale)  # fmt: skip
    if recompute_slots is not None and budget:
        plan.slots = torch.as_tensor(list(recompute_slots), device=device).sort().values
    return plan


def _prefill(model, cache, token_ids, plan: _Plan) -> BlendResult:
    """Pass 1 (what is not cached: the question, misses; everything in full) over the cached
    KV, then the recompute rounds (``_recompute``) when there is a budget. When blend selects
    and pass 1 computes only the question, pass 1 ends at the last layer selection reads
    (``attention_to_depth``): the first recompute pass, which computes the question again
    anyway, places the deeper layers' cached KV. (Misses or an uncached head would have to
    be computed again from layer 0: then pass 1 runs every layer.)"""
    num_tokens, layers = token_ids.numel(), model.config.n_layers
    question = plan.segments[-1].length
    sources = [seg for seg in plan.segments if seg.source is not None]
    selects = bool(plan.budget) and plan.slots is None
    settings, per_layer = plan.settings, int(plan.computed.sum())
    until = (
        selection_layers(layers, settings.attention_from_depth, settings.attention_to_depth)[1]
        if selects and per_layer == question else layers
    )  # fmt: skip
    first = _run_pass(
        model, cache, token_ids, plan.computed.nonzero().squeeze(1), sources=sources,
        question_length=question if selects else 0, stale=plan.stale, until=until,
    )  # fmt: skip
    if not plan.budget:
        recomputed = int((plan.computed & plan.candidate).sum()) if plan.blend else 0
        share = recomputed / max(1, plan.chunk_tokens)
        return BlendResult(first.logits, cache, num_tokens, [per_layer] * layers, share)
    deeper = _Deeper(sources, until) if until < layers else None
    logits, selected, passes = _recompute(model, cache, token_ids, plan, first.attention, deeper)
    share = selected.numel() / max(1, plan.chunk_tokens)
    computed = [passes + (per_layer if i < until else 0) for i in range(layers)]
    return BlendResult(logits, cache, num_tokens, computed, share, first.attention, plan, token_ids)


@dataclass(frozen=True)
class _Deeper:
    """What pass 1 left to the first recompute pass: placing ``sources`` from layer ``start``
    on (pass 1, which computed only the question, stopped there)."""

    sources: list[Segment]
    start: int


def _budget(mode: Mode, ratio: float, chunk_tokens: int, candidates: int, slots: int | None) -> int:
    """How many chunk tokens blend recomputes: ``ceil(ratio * chunk tokens)``, or the fixed
    slots' count, at most the candidates; 0 in the other modes."""
    budget = math.ceil(ratio * chunk_tokens - 1e-9) if slots is None else slots
    return min(budget, candidates) if mode == "blend" else 0


def _stale_reading(segments: list[Segment], stale: torch.Tensor, settings: BlendSettings) -> _Stale:
    """How the stale cached chunk KV (``stale [T]``) is read in the first pass. A chunk's
    keys are scaled by ``stale_key_scale``, or, with ``stale_ramp_tokens``, by as much of it
    as the cached chunk tokens before it (the context its stored KV never saw) make up of
    that many: a passage right after the head is read as stored. ``stale_bias`` is added to
    the logits of a chunk's stale keys in the same proportion."""
    spans, scales, before, unseen = [], [], [], 0
    bias = torch.zeros(stale.shape, device=stale.device) if settings.stale_bias else None
    for seg in segments:
        if seg.kind != "chunk" or seg.source is None:
            continue
        if bool(stale[seg.start : seg.stop].any()):
            share = (
                min(1.0, unseen / settings.stale_ramp_tokens) if settings.stale_ramp_tokens else 1.0
            )
            spans.append(slice(seg.start, seg.stop))
            scales.append(1.0 - (1.0 - settings.stale_key_scale) * share)
            before.append(unseen)
            if bias is not None:
                bias[seg.start : seg.stop] = settings.stale_bias * share
        unseen += seg.length
    bias = None if bias is None else bias * stale
    return _Stale(tuple(spans), tuple(scales), bias, tuple(before))


@dataclass
class _Plan:
    """What one prefill computes: ``computed`` slots in pass 1 (not cached), then ``budget``
    of the ``candidate`` slots over the recompute rounds (``settings.rounds``; each first
    round takes the ``chunk_starts``), or the fixed ``slots``."""

    segments: list[Segment]
    candidate: torch.Tensor  # [T] bool
    computed: torch.Tensor  # [T] bool
    budget: int
    chunk_tokens: int  # what the ratio is a share of
    blend: bool  # the mode is blend
    settings: BlendSettings
    stale: _Stale
    slots: torch.Tensor | None = None

    def counts(self) -> list[int]:
        """Tokens selected per round (``round_budgets``)."""
        if self.slots is not None:
            return [self.slots.numel()]
        return round_budgets(self.budget, self.settings.rounds, self.settings.first_round_share)

    def forced(self) -> torch.Tensor:
        """``[T]`` bool: the first ``chunk_starts`` tokens of every candidate chunk."""
        forced = torch.zeros_like(self.candidate)
        for seg in (s for s in self.segments if s.kind == "chunk"):
            forced[seg.start : seg.start + self.settings.chunk_starts] = True
        return forced & self.candidate


def round_budgets(budget: int, rounds: int, first_share: float) -> list[int]:
    """The budget cut over ``rounds`` selection rounds: ``first_share`` of it in the first,
    the rest evenly; every count at least 1 while the budget lasts."""
    if rounds < 1 or not 0.0 < first_share <= 1.0:
        raise ValueError(f"rounds >= 1 and 0 < first_share <= 1; got {rounds}, {first_share}")
    if rounds == 1 or budget <= 1:
        return [budget]
    first = max(1, min(budget - 1, round(budget * first_share)))
    rest = budget - first
    later = [rest * (r + 1) // (rounds - 1) - rest * r // (rounds - 1) for r in range(rounds - 1)]
    return [first, *(n for n in later if n > 0)]


def _recompute(model, cache, token_ids, rounds: _Plan, attention, deeper: _Deeper | None):
    """The recompute passes: each round selects by the question's attention in the pass
    before it (``attention [L', T]``) among the candidates not yet recomputed, then computes
    those tokens and the question from layer 0 on (the first round also places the cached KV
    of the layers pass 1 did not reach, ``deeper``). Returns the last logits,
    every selected slot, and the tokens computed per layer in all."""
    num_tokens, settings = token_ids.numel(), rounds.settings
    layers = model.config.n_layers
    weights = local_layer_weights([model.config.window(i) for i in range(layers)],
                                  settings.local_layer_weight)  # fmt: skip
    chosen = torch.zeros_like(rounds.candidate)
    counts, forced, computed = rounds.counts(), rounds.forced(), 0
    for index, count in enumerate(counts):
        if rounds.slots is not None:
            new = rounds.slots
        else:
            left = rounds.candidate & ~chosen
            scores = attention_importance(attention, left, settings.attention_from_depth,
                                          settings.attention_to_depth, layers, weights)  # fmt: skip
            scores = smooth_scores(scores, settings.smooth_window)
            if index == 0:
                scores = scores.masked_fill(forced, float("inf"))
            new = select_recompute(scores, left, count)
        chosen[new] = True
        again = torch.zeros_like(chosen)
        again[new] = True
        question = rounds.segments[-1].length
        again[num_tokens - question :] = True
        recorded = question if index < len(counts) - 1 else 0
        bias = rounds.stale.bias
        stale = _Stale(bias=None if bias is None else bias * ~chosen)
        place: dict = {}
        if deeper is not None and index == 0:
            stale = replace(rounds.stale, bias=stale.bias)
            place = {"sources": deeper.sources, "place_from": deeper.start}
        active = again.nonzero().squeeze(1)
        shift = _stale_shift(rounds.stale, active, settings)
        step = _run_pass(model, cache, token_ids, active, question_length=recorded,
                         stale=stale, shift=shift, **place)  # fmt: skip
        attention, computed = step.attention, computed + int(again.sum())
    return step.logits, chosen.nonzero().squeeze(1), computed
