"""Attention of the computed tokens over the blended cache, causal by real position: the
question's with the weights selection reads (``attend_and_weigh``), the others' cut into
groups of queries that each read only the keys up to their last position (``group_queries``,
``attend_grouped``), and one pass's plan of who attends how (``attention_plan``)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvservice.model.transformer import attend, position_mask


@dataclass(frozen=True)
class QueryGroups:
    """Selected queries cut into groups by position, each with the keys it may read: built
    once per pass (``group_queries``) and used by every layer (``attend_grouped``)."""

    spans: list[slice]  # each group's queries: all of one length, a group's start + stride
    n_keys: list[int]  # each group reads keys [0, n_keys)
    masks: list[torch.Tensor]  # additive, 0 or -inf: [heads_per_key * S_g, n_keys] each
    stride: int = 0  # between the groups' starts; a group's output is its first ``stride``
    # queries' (the last group's: all); the last starts where the rest is ``S_g`` queries,
    # so it may share up to (groups - 1) queries with the one before it

    def owned(self, index: int) -> int:
        """How many of group ``index``'s queries it answers for."""
        span = self.spans[index]
        return span.stop - span.start if index == len(self.spans) - 1 else self.stride


# On the CPU each group is computed explicitly (``attend_grouped``): its scores, softmax and
# values' product are three matrix products and a softmax that stay in the caches when a
# group is at most ~500 rows (3 query heads x ~170 queries) over a few thousand keys.
# PyTorch's CPU flash kernel did the same work 2-3x slower here (a blend at 0.15 of SmolLM2,
# 450 queries over 3,000 keys: one layer 18.8 ms through SDPA in 1 group, 6.2 ms explicit
# in 3; 600 over 3,700: 23.6 -> 9.7 ms; 2-core AMD EPYC, bfloat16), and more groups also
# skip more of the keys past each group's last query.
MIN_ROWS_PER_CALL = 384
# On a GPU one call per layer: the launches of the CPU's cut (~12 calls a layer at 16,384
# tokens) cost more than the masked work they skip. Blend 0.15 of Llama-3-8B's shape on an
# H200, 12 chunks from CPU memory / the GPU tier (docs/long_context_gpu/h200_2026-11-26a_ab.txt):
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
    are as many as leave each call at least ``min_rows`` rows (None: one group), all of one
    length, their starts a stride apart (the last may share up to groups - 1 queries with
    the one before it): so one copy stacks every group's queries. The CPU's groups are
    computed explicitly, at least ``MIN_ROWS_PER_CALL`` rows each (see there); a GPU's
    call SDPA. The masks are additive (SDPA converts a boolean mask on every call) and repeated per
    stacked head (``heads_per_key * S`` rows of keys in all, built once per pass)."""
    count = query_pos.numel()
    n_groups = 1 if min_rows is None else max(1, min(count, heads_per_key * count // min_rows))
    stride = count // n_groups
    length = count - (n_groups - 1) * stride  # stride plus fewer than n_groups
    spans, n_keys, masks = [], [], []
    for start in range(0, n_groups * stride, stride):
        stop = start + length
        group_pos = query_pos[start:stop]
        keys = int(torch.searchsorted(key_pos, group_pos[-1], right=True))
        visible = position_mask(group_pos, key_pos[:keys], sliding_window=sliding_window)
        device = str(visible.device)
        allowed = _constant(0.0, dtype, device) if key_bias is None else key_bias[:keys].to(dtype)
        mask = torch.where(visible, allowed, _constant(float("-inf"), dtype, device))
        spans.append(slice(start, stop))
        n_keys.append(keys)
        masks.append(mask.repeat(heads_per_key, 1))
    return QueryGroups(spans, n_keys, masks, stride)


@functools.lru_cache(maxsize=16)
def _constant(value: float, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A 0-dim ``value`` of ``dtype`` (made once; a Python number would be made into a
    tensor on every call): what a mask holds where a key is visible (0) or hidden (-inf)."""
    return torch.tensor(value, dtype=dtype, device=device)


def attend_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: QueryGroups
) -> torch.Tensor:
    """Attention of selected queries ``q [1, H, S, D]`` over a layer's keys ``k, v
    [1, H_kv, T, D]``, causal by real position, group by group (``group_queries``: on the
    CPU three operators a group, ``_attend_explicitly``; elsewhere one SDPA call) with the
    query heads that share a key head stacked as rows. Returns ``[1, H, S, D]``;
    several groups' outputs are joined token-major (a ``[1, S, H, D]`` tensor seen as
    ``[1, H, S, D]``), so that the output product's layout costs no second copy. Several
    groups' queries are stacked by one copy (their spans are one strided view of ``q``); it
    was one copy a group."""
    _, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    q = q.to(k.dtype)
    span = groups.spans[0]
    n = span.stop - span.start
    if len(groups.spans) == 1:
        stacked = q[:, :, span].contiguous()  # no copy when ``q`` is this span
    else:  # [groups, H, n, D]: each group's queries, the groups one stride apart
        at, (head_step, token_step, dim_step) = q[0].storage_offset(), q[0].stride()
        shape = (len(groups.spans), heads, n, dim)
        steps = (groups.stride * token_step, head_step, token_step, dim_step)
        stacked = q[0].as_strided(shape, steps, at).contiguous()
    explicit = q.device.type == "cpu"
    outputs = []
    for index, (keys, mask) in enumerate(zip(groups.n_keys, groups.masks, strict=True)):
        if explicit:
            rows = stacked[index].view(kv_heads, heads // kv_heads * n, dim)
            out = _attend_explicitly(rows, k[0, :, :keys], v[0, :, :keys], mask)
        else:
            rows = stacked[index].view(1, kv_heads, heads // kv_heads * n, dim)
            out = F.scaled_dot_product_attention(
                rows, k[:, :, :keys], v[:, :, :keys], attn_mask=mask
            )
        out = out.reshape(1, heads, n, dim)  # CUDA's SDPA may return other strides
        outputs.append(out[:, :, : groups.owned(index)])
    if len(outputs) == 1:
        return outputs[0]
    return torch.cat([out.transpose(1, 2) for out in outputs], dim=1).transpose(1, 2)


def _attend_explicitly(
    rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """One group's attention as three operators: ``rows [H_kv, R, D]`` (the query heads that
    share a key head, stacked), ``k, v [H_kv, T, D]``, ``mask [R, T]`` additive. The scaled
    scores come with the mask added in the product, in the cache's dtype (softmax
    accumulates in float32), as ``attend_and_weigh`` computes the question's."""
    scale = 1 / math.sqrt(rows.shape[-1])
    scores = torch.baddbmm(mask.to(rows.dtype), rows, k.transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(scores, dim=-1), v.to(scores.dtype))


def attend_and_weigh(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    sliding_window: int | None = None,
    key_bias: torch.Tensor | None = None,
    groups: QueryGroups | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the question's queries ``q [H, S, D]`` (rotated) over a layer's keys
    ``k, v [H_kv, T, D]`` (rotated, at sorted positions ``key_pos``), causal by position, and
    the weights it paid each key.

    Returns the output ``[H, S, D]`` (what SDPA gives) and the weights averaged over heads
    and queries, ``[T]``, summing to 1. One explicit computation gives both: for the few
    question tokens it is faster than SDPA plus a second pass for the weights (5 against
    10-12 ms a layer for 45 queries over 3,700 keys here), and the query heads that share a
    key head are stacked into one matrix product instead of copying the keys per head. Five
    operators: the stacking copy, the scaled scores with the mask (and ``key_bias``) added
    in the same product, softmax, the values' product, the mean. ``groups``: the question as
    one group (``group_queries(query_pos, key_pos, H // H_kv, sliding_window, None, k.dtype,
    key_bias)``), made once for every layer that shares it."""
    heads, length, dim = q.shape
    kv_heads, num_keys = k.shape[0], k.shape[1]
    group = heads // kv_heads
    if groups is None:
        groups = group_queries(query_pos, key_pos, group, sliding_window, None, k.dtype, key_bias)
    keys, mask = groups.n_keys[0], groups.masks[0]  # mask: [G * S, keys], additive
    stacked = q.to(k.dtype).contiguous().view(kv_heads, group * length, dim)
    scores = torch.baddbmm(mask, stacked, k[:, :keys].transpose(1, 2), alpha=1 / math.sqrt(dim))
    # In the scores' dtype (softmax accumulates in float32): a bfloat16 cache's weights are
    # rounded as SDPA rounds them before its second product, and no float32 copy is made.
    weights = torch.softmax(scores, dim=-1)  # [H_kv, G * S, keys]
    out = torch.bmm(weights, v[:, :keys].to(weights.dtype)).view(heads, length, dim)
    paid = weights.mean(dim=(0, 1), dtype=torch.float32)  # [keys]
    return out, paid if keys == num_keys else F.pad(paid, (0, num_keys - keys))


@dataclass(frozen=True)
class AttentionPlan:
    """Who attends how in one pass, built once and used by every layer (``attend_layer``)."""

    positions: torch.Tensor  # [T] key positions (slot = position)
    active: torch.Tensor  # [S] the computed slots
    grouped: int  # the active queries before the recorded question (all when none is)
    question_length: int  # the last that many active tokens' attention is recorded
    everything: bool  # every slot is active: plain causal prefill
    groups: QueryGroups | None
    last_query: QueryGroups
    window: int | None
    bias: torch.Tensor | None
    mask: torch.Tensor | None  # ``everything``'s (``Transformer.mask``; None: the triangle)
    question: QueryGroups | None  # the recorded question as one group (``attend_and_weigh``)


def attention_plan(model, cache, active, num_tokens, question_length, bias, layer) -> AttentionPlan:
    """Layer ``layer``'s plan; every layer with the same sliding window shares it."""
    config, positions = model.config, torch.arange(num_tokens, device=model.device)
    window, dtype = config.window(layer), cache.k.dtype
    heads_per_key = config.n_heads // config.n_kv_heads
    grouped = active.numel() - question_length
    everything = active.numel() == num_tokens

    rows = MIN_ROWS_PER_CALL if model.device.type == "cpu" else GPU_ROWS_PER_CALL

    def groups_of(queries: torch.Tensor, min_rows: int | None = rows) -> QueryGroups:
        return group_queries(queries, positions, heads_per_key, window, min_rows, dtype, bias)

    groups = groups_of(active[:grouped]) if grouped and not everything else None
    mask = model.mask(positions, positions, layer=layer) if everything else None
    question = groups_of(active[grouped:], min_rows=None) if question_length else None
    return AttentionPlan(
        positions,
        active,
        grouped,
        question_length,
        everything,
        groups,
        groups_of(active[-1:]),
        window,
        bias,
        mask,
        question,
    )


def attend_layer(plan: AttentionPlan, q, k_layer, v_layer, last: bool, weigh: bool = True):
    """One layer's attention output ``[1, H, S', D]`` for the active queries (only the last
    one's in the last layer) and, when the question is recorded and ``weigh``, its weights
    ``[T]``. A layer whose weights nobody reads (below the first layer selection reads) runs
    the question as one plain group (``attend_grouped``): three operators instead of five."""
    if plan.question_length:
        question = q[:, :, plan.grouped :]
        if weigh:
            out, weights = attend_and_weigh(
                question[0],
                k_layer[0],
                v_layer[0],
                plan.active[plan.grouped :],
                plan.positions,
                plan.window,
                plan.bias,
                plan.question,
            )
            out = out[None]
        else:
            out, weights = attend_grouped(question, k_layer, v_layer, plan.question), None
        if plan.groups is not None and not last:
            before = attend_grouped(q[:, :, : plan.grouped], k_layer, v_layer, plan.groups)
            return torch.cat([before, out], 2), weights
        return out, weights
    if last:
        return attend_grouped(q[:, :, -1:], k_layer, v_layer, plan.last_query), None
    if plan.everything:
        return attend(q, k_layer, v_layer, plan.mask), None
    return attend_grouped(q, k_layer, v_layer, plan.groups), None
