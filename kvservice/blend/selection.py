"""Which cached chunk tokens blend recomputes: the question's attention in the reuse pass
(``kvservice.blend.attention.attend_and_weigh``) read per layer, normalized over the
candidates, weighed and ranked. Pure tensor functions, each testable on CPU."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvservice.blend.settings import ATTENTION_FROM_DEPTH


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
