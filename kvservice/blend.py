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
* ``blend``: like ``reuse``, but the tokens whose KV deviates most from what full prefill
  would give (high-KV-deviation, HKVD) are recomputed and their fresh KV overwrites the
  cached KV. Layer 0 runs over all chunk tokens; at each check layer the deviation between
  fresh and cached K and V picks the tokens kept for the next layers, shrinking gradually
  to the target ratio (gradual filtering); the question is always recomputed in full.

``blend`` at ratio 1.0 is ``full``; at ratio 0 it is ``reuse``.

The algorithm is a set of pure tensor functions plus one driver, ``blend_prefill``, that
writes into our ``KVCache``. A driver for another engine (vLLM's paged cache) reuses the
functions and the model's two layer halves (``Block.project`` then ``Block.attend_and_mlp``)
and decides itself where each layer's KV goes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
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
Measure = Literal["v", "k", "kv"]


# --------------------------------------------------------------------------------------------
# Pure tensor functions


def rerotate(k: torch.Tensor, old_pos: torch.Tensor, new_pos: torch.Tensor, inv_freq: torch.Tensor):
    """Move rotated keys ``k [..., T, D]`` from positions ``old_pos [T]`` to ``new_pos [T]``.

    RoPE rotations compose, so rotating by ``new - old`` is exact. (Our chunk K is stored
    before RoPE, i.e. at "no position", and is simply rotated to the new positions; this is
    for caches that keep K rotated.)"""
    cos, sin = rope_cos_sin(inv_freq, new_pos - old_pos)
    return apply_rope(k, cos, sin)


def token_deviation(
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    cached_k: torch.Tensor,
    cached_v: torch.Tensor,
    measure: Measure = "kv",
) -> torch.Tensor:
    """Per-token KV deviation ``[S]`` between fresh and cached ``[H_kv, S, D]`` tensors.

    ``v``: squared L2 distance of V (CacheBlend's measure). ``k``: of K. ``kv``: both, each
    relative to the mean squared norm of the cached tensor, so neither dominates by scale.
    K may be compared rotated: both sides sit at the same position, and rotation keeps norms.
    """

    def distance(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        return (fresh.float() - cached.float()).pow(2).sum(dim=(0, 2))  # [S]

    if measure == "v":
        return distance(fresh_v, cached_v)
    if measure == "k":
        return distance(fresh_k, cached_k)
    k_scale = cached_k.float().pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-12)
    v_scale = cached_v.float().pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-12)
    return distance(fresh_k, cached_k) / k_scale + distance(fresh_v, cached_v) / v_scale


def top_tokens(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` highest scores, in increasing (position) order."""
    count = max(0, min(count, scores.numel()))
    return torch.topk(scores, count, sorted=False).indices.sort().values


def hkvd_scores(
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    cached_k: torch.Tensor,
    cached_v: torch.Tensor,
    measure: Measure = "v",
    *,
    question: torch.Tensor | None = None,
    layer_k: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    floor: float = 0.25,
) -> torch.Tensor:
    """How much each candidate token's stale KV would matter, ``[n]``; the highest are
    recomputed. ``fresh_*``/``cached_*``: ``[H_kv, n, D]``, K rotated.

    Without ``question`` it is the plain KV deviation (``token_deviation``). With the
    question's rotated queries ``question [H, Sq, D]`` and the layer's keys ``layer_k
    [H_kv, T, D]`` (``slots [n]`` says where the candidates sit), the deviation is weighted
    by the attention the question pays each token (plus ``floor`` times the mean attention,
    since the question's early-layer attention is only a hint of what later layers read):
    a deviating token nobody reads matters little.
    """
    deviation = token_deviation(fresh_k, fresh_v, cached_k, cached_v, measure)  # [n]
    if question is None:
        return deviation
    group = question.shape[0] // layer_k.shape[0]
    keys = layer_k.repeat_interleave(group, dim=0)  # [H, T, D]
    scores = question @ keys.transpose(1, 2) / math.sqrt(question.shape[-1])  # [H, Sq, T]
    weight = torch.softmax(scores, dim=-1).mean(dim=(0, 1))[slots]  # [n]
    return deviation * (weight + floor * weight.mean())


def smooth_scores(scores: torch.Tensor, window: int) -> torch.Tensor:
    """Each candidate's score averaged with its neighbours' (``window`` candidates in
    position order, odd). A recomputed token reads mostly its neighbours; when they stay
    stale its fresh KV is still off, so whole deviating neighbourhoods are worth more than
    scattered single tokens. On Musique 10-29 at ratio 0.15 (SmolLM2, teacher-forced KL to
    full): 0.067 unsmoothed, 0.058 with 7, 0.050 with 11, 0.051 with 15, 0.060 with 31."""
    if window <= 1 or scores.numel() <= 1:
        return scores
    if window % 2 == 0:
        raise ValueError(f"the smoothing window must be odd, got {window}")
    pooled = F.avg_pool1d(
        scores[None, None].float(), window, 1, window // 2, count_include_pad=False
    )
    return pooled[0, 0]


def select_hkvd(fresh_v: torch.Tensor, cached_v: torch.Tensor, ratio: float) -> torch.Tensor:
    """The HKVD tokens of CacheBlend's plain form: the ``ratio`` share of tokens whose V
    deviates most. ``[H_kv, S, D]`` -> sorted indices ``[round(ratio * S)]``."""
    scores = (fresh_v.float() - cached_v.float()).pow(2).sum(dim=(0, 2))
    return top_tokens(scores, round(ratio * scores.numel()))


def gradual_schedule(
    target_ratio: float,
    n_layers: int,
    first_check_layer: int = 1,
    n_checks: int = 2,
    start: float = 2.0,
) -> list[float]:
    """Share of chunk tokens kept *after* each layer (so computed in the next one).

    Layers before the first check keep everything (their KV is what the check compares).
    Then the share falls geometrically from ``start * target`` to ``target`` over
    ``n_checks`` check layers and stays there. Ratio 0 keeps nothing from layer 0 on (no
    recompute: ``reuse``); ratio 1 keeps everything (``full``). The default (2x the target
    after layer 1, the target after layer 2) fits as well on Musique 10-29 as 3x over three
    checks (teacher-forced KL 0.050 both) and is 2-3 % faster."""
    if not 0.0 <= target_ratio <= 1.0:
        raise ValueError(f"recompute ratio must be in [0, 1], got {target_ratio}")
    if target_ratio == 0.0:
        return [0.0] * n_layers
    if target_ratio == 1.0:
        return [1.0] * n_layers
    first = min(1.0, start * target_ratio)
    n_checks = max(1, min(n_checks, n_layers - 1 - first_check_layer))  # small models: fit in
    checks = [first * (target_ratio / first) ** (i / max(1, n_checks - 1)) for i in range(n_checks)]
    checks[-1] = target_ratio
    schedule = []
    for layer in range(n_layers):
        index = layer - first_check_layer
        if index < 0:
            schedule.append(1.0)
        else:
            schedule.append(checks[min(index, n_checks - 1)])
    return schedule


def attend_selected(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    sliding_window: int | None = None,
    n_groups: int = 8,
) -> torch.Tensor:
    """Attention of selected queries ``q [1, H, S, D]`` (sorted by position) over a layer's
    keys ``k, v [1, H_kv, T, D]`` held in position order, causal by real position.

    The key range is cut into ``n_groups`` equal spans and the queries grouped by the span
    their position falls in; each group only reads the keys up to its last position. That is
    the same result as one masked call over all keys without computing the (masked) scores
    of later keys: about half the work for queries spread over the prompt, and a single call
    for queries bunched together (the question alone, in ``reuse``), where small groups
    would only add per-call overhead.
    """
    span = max(1, -(-int(key_pos[-1] - key_pos[0] + 1) // n_groups))  # ceil
    bins = torch.div(query_pos - key_pos[0], span, rounding_mode="floor")  # [S]
    counts = torch.unique_consecutive(bins, return_counts=True)[1].tolist()
    outputs, start = [], 0
    for count in counts:
        group = slice(start, start + count)
        start += count
        group_pos = query_pos[group]
        n_keys = int(torch.searchsorted(key_pos, group_pos[-1], right=True))
        mask = position_mask(group_pos, key_pos[:n_keys], sliding_window=sliding_window)
        outputs.append(attend(q[:, :, group], k[:, :, :n_keys], v[:, :, :n_keys], mask))
    return torch.cat(outputs, dim=2)  # [1, H, S, D]


# --------------------------------------------------------------------------------------------
# The prompt's layout


@dataclass
class Segment:
    start: int  # first position in the prompt
    length: int
    source: LayeredKV | None  # cached KV to read, or None when computed fresh
    kind: Literal["head", "chunk", "question"]

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass
class BlendResult:
    logits: torch.Tensor  # [V] next-token logits after the last prompt token
    cache: KVCache  # batch 1; slots [0, num_tokens) hold the prompt (K rotated)
    num_tokens: int  # prompt length; the next token goes at this position
    recomputed_per_layer: list[int] = field(default_factory=list)  # tokens computed per layer
    recompute_ratio_effective: float = 0.0  # chunk tokens recomputed past the check layers

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
    if mode == "full" and segments[0].kind == "head":
        segments[0].source = None
    return segments


# --------------------------------------------------------------------------------------------
# The driver over our KVCache


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
    schedule: Sequence[float] | None = None,
    measure: Measure = "v",
    extra_capacity: int = 0,
    question_weight: bool = True,
    question_weight_floor: float = 0.25,
    accumulate: bool = False,
    smooth_window: int = 11,
) -> BlendResult:
    """Prefill ``[head][chunks...][question]`` in one of the four modes; see the module doc.

    ``chunks`` give cached KV (``.layer(i)`` is called once per layer, in increasing order,
    when that layer is processed, so a loader may prefetch the next layer meanwhile); None
    marks a chunk that is not cached (a miss), computed in full from ``chunk_ids``.
    ``chunk_ids`` are the chunks' token ids: needed by ``full`` and ``prefix`` (which compute
    chunk tokens from scratch) and by ``blend`` (which recomputes some); a ``ChunkKV`` carries
    its own. ``head_kv`` is the head's precomputed KV (computed here when absent; it is tiny).
    The first chunk counts as exact when it was precomputed after this same head (it sits at
    exactly the positions it was computed at), so only later chunks are candidates for
    recompute. ``extra_capacity`` leaves room in the returned cache for decoding.

    Selection (``hkvd_scores``): ``measure`` is the per-token deviation (``v``: of V,
    CacheBlend's; ``kv``: K and V, each relative to its scale); with ``question_weight`` it
    is weighted by the attention the question pays each token at that layer (plus
    ``question_weight_floor`` times the mean), since a deviating token nobody reads matters
    little; ``smooth_window`` then averages neighbouring candidates' scores, so deviating
    neighbourhoods are recomputed together (``smooth_scores``); with ``accumulate`` the
    scores of all check layers so far are summed. The defaults were chosen on Musique
    examples 10-29 with SmolLM2 at ratio 0.15 (teacher-forced KL to full; reuse: 0.126):
    V, weighted with floor 0.25, smoothed over 11, each check on its own gave 0.050, against
    0.067 unsmoothed, 0.081 for K+V, accumulated, floor 1, and 0.096 without the question
    weight.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (one of {MODES})")
    if not question_ids:
        raise ValueError("the question part of the prompt must not be empty")
    device, config = model.device, model.config
    if chunk_ids is None:
        chunk_ids = [getattr(c, "token_ids", None) for c in chunks]
        if any(ids is None for ids in chunk_ids):
            if mode != "reuse":
                raise ValueError(f"mode {mode!r} needs the chunks' token ids")
            chunk_ids = None
    segments = _layout(head_ids, chunks, chunk_ids, question_ids, head_kv, mode)
    num_tokens = segments[-1].stop
    ids = list(head_ids)
    for seg, j in zip([s for s in segments if s.kind == "chunk"], range(len(chunks)), strict=True):
        ids += list(chunk_ids[j]) if chunk_ids is not None else [0] * seg.length
    ids += list(question_ids)
    token_ids = torch.tensor(ids, device=device)  # [T]
    positions = torch.arange(num_tokens, device=device)  # [T]
    dtype = model.embed_tokens.weight.dtype
    cache = KVCache(config, 1, num_tokens + extra_capacity, device, dtype, num_tokens)
    cache.reserve(positions[None])
    cos_all, sin_all = model.rope(positions)  # [T, D]

    # Which tokens are computed, and which chunk tokens may be dropped by the HKVD filter.
    exact_first = (
        mode == "blend"
        and len(chunks) > 0
        and getattr(chunks[0], "head_hash", None) == head_hash(head_ids)
    )
    computed = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    candidate = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    chunk_index = 0
    for seg in segments:
        if seg.kind == "chunk":
            is_candidate = (
                mode == "blend"
                and seg.source is not None
                and not (exact_first and chunk_index == 0)
            )
            candidate[seg.start : seg.stop] = is_candidate
            chunk_index += 1
        if seg.source is None:
            computed[seg.start : seg.stop] = True
    total_chunk_tokens = sum(s.length for s in segments if s.kind == "chunk")
    if mode == "blend":
        if schedule is None:
            schedule = gradual_schedule(recompute_ratio, config.n_layers)
        keep_counts = [math.ceil(share * total_chunk_tokens - 1e-9) for share in schedule]
        if keep_counts[0] > 0:
            computed |= candidate
    else:
        keep_counts = None

    recomputed = 0
    running_score: torch.Tensor | None = None
    active = computed.nonzero().squeeze(1)  # [S] slots (= positions) computed at this layer
    x = model.embed_tokens(token_ids[active])[None]  # x: [1, S, dim]
    recomputed_per_layer = []
    sources = [seg for seg in segments if seg.source is not None]
    for i, layer in enumerate(model.layers):
        # 1. This layer's cached KV, rotated to its place in this prompt.
        for seg in sources:
            k_pre, v = seg.source.layer(i)  # [H_kv, n, D], pre-RoPE
            span = slice(seg.start, seg.stop)
            k_rot = apply_rope(k_pre.to(device), cos_all[span], sin_all[span])
            cache.k[i, 0, :, span] = k_rot
            cache.v[i, 0, :, span] = v.to(device)
        recomputed_per_layer.append(int(active.numel()))
        if active.numel() == 0:
            continue
        # 2. Fresh q, k, v of the active tokens.
        cos_a, sin_a = cos_all[active][None], sin_all[active][None]  # [1, S, D]
        q, k_pre, v = layer.project(x, cos_a, sin_a)  # q: [1, H, S, D]; k, v: [1, H_kv, S, D]
        k_rot = apply_rope(k_pre, cos_a[:, None], sin_a[:, None])  # [1, H_kv, S, D]
        # 3. Fresh KV of every computed token overwrites the cached KV of this layer (the
        #    candidates' cached KV is kept aside for the comparison).
        keep, check = None, False
        if keep_counts is not None:
            active_candidates = candidate[active]  # [S] bool
            n_candidates = int(active_candidates.sum())
            target = keep_counts[i] if i + 1 < len(keep_counts) else n_candidates
            check = target < n_candidates  # the keep count shrinks at this layer
        if check:
            cand_pos = active_candidates.nonzero().squeeze(1)  # indices into active
            slots = active[cand_pos]
            cached_k, cached_v = cache.k[i, 0, :, slots], cache.v[i, 0, :, slots]
        cache.k[i, 0, :, active] = k_rot[0]
        cache.v[i, 0, :, active] = v[0]
        # 4. HKVD filter: at a check layer, compare fresh and cached KV.
        if check:
            scores = hkvd_scores(
                k_rot[0, :, cand_pos],
                v[0, :, cand_pos],
                cached_k,
                cached_v,
                measure,
                question=q[0, :, -len(question_ids) :] if question_weight else None,
                layer_k=cache.k[i, 0, :, :num_tokens],
                slots=slots,
                floor=question_weight_floor,
            )
            scores = smooth_scores(scores, smooth_window)
            if accumulate:
                # Rank by the deviation summed over the check layers so far (each layer's
                # scores scaled to mean 1): the first check's signal keeps its weight.
                scores = scores / scores.mean().clamp_min(1e-12)
                if running_score is not None:
                    scores = scores + running_score[slots]
                running_score = torch.zeros(num_tokens, device=device)
                running_score[slots] = scores
            chosen = cand_pos[top_tokens(scores, target)]
            keep_mask = ~active_candidates
            keep_mask[chosen] = True
            keep = keep_mask.nonzero().squeeze(1)  # indices into active, in order
        # 5. Attention over the whole layer (causal by real position) and the MLP, only for
        #    the tokens that go on to the next layer.
        if keep_counts is not None:
            recomputed = int(candidate[active if keep is None else active[keep]].sum())
        if i == config.n_layers - 1:
            keep = torch.tensor([active.numel() - 1], device=device)  # only the last token's
            # output is needed after the last layer; the others' KV is already written
        if keep is not None:
            x, q, active = x[:, keep], q[:, :, keep], active[keep]
        k_layer, v_layer = cache.k[i, :, :, :num_tokens], cache.v[i, :, :, :num_tokens]
        if active.numel() == num_tokens:  # everything computed: plain causal prefill
            x = layer.attend_and_mlp(x, q, k_layer, v_layer, model.mask(positions, positions))
        else:
            window = config.sliding_window
            x = layer.finish(
                x, attend_selected(q, k_layer, v_layer, positions[active], positions, window)
            )
    logits = model.logits(x[0, -1])  # the last question token is always active
    return BlendResult(
        logits=logits,
        cache=cache,
        num_tokens=num_tokens,
        recomputed_per_layer=recomputed_per_layer,
        recompute_ratio_effective=recomputed / max(1, total_chunk_tokens),
    )
