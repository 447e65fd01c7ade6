"""A prefill's fidelity to full prefill, as the benchmarks measure it: full's answer fed
after the prefill (``teacher_forced_logits``) and compared with full's own logits
(``teacher_forced_fidelity``), a free-running greedy answer (``greedy_answer``), and both for
progressive blend (a cache refreshed after the first answer token)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvservice.blend.prefill import BlendResult, refresh
from kvservice.model.transformer import Transformer


def teacher_forced_fidelity(
    mode_logits: torch.Tensor, full_logits: torch.Tensor, answer: Sequence[int], tf_positions: int
) -> dict[str, float]:
    """Fidelity of a mode to full prefill, both fed full's ``answer`` after their prefill:
    next-token logits ``[len(answer), V]`` (position i predicts ``answer[i]``).

    ``tf_agreement`` (top-1) and ``tf_kl`` (mean KL(mode || full)) over the first
    ``tf_positions`` positions; ``tf_logprob_gap`` over all: the mean of
    ``log p_full(token) - log p_mode(token)`` for the answer's own tokens."""
    logp = torch.log_softmax(mode_logits.float(), dim=-1)  # [T, V]
    full = torch.log_softmax(full_logits.float(), dim=-1)  # [T, V]
    head, full_head = logp[:tf_positions], full[:tf_positions]
    agreement = (head.argmax(-1) == full_head.argmax(-1)).float().mean().item()
    kl = (head.exp() * (head - full_head)).sum(-1).mean().item()
    tokens = torch.tensor(answer, device=logp.device)[:, None]  # [T, 1]
    gap = (full.gather(-1, tokens) - logp.gather(-1, tokens)).mean().item()
    return {"tf_agreement": agreement, "tf_kl": max(kl, 0.0), "tf_logprob_gap": gap}


@torch.no_grad()
def teacher_forced_logits(
    model: Transformer, result: BlendResult, answer: list[int]
) -> torch.Tensor:
    """Next-token logits ``[len(answer), V]`` after the prefill, fed ``answer`` token by token
    (one forward). The cache is rolled back afterwards."""
    n = result.num_tokens
    fed = torch.tensor([answer[:-1]], device=model.device)
    positions = torch.arange(n, n + fed.shape[1], device=model.device)[None]
    later, _ = (
        model(fed, positions, result.cache, all_logits=True) if fed.shape[1] else (None, None)
    )
    result.cache.truncate(n)
    first = result.logits[None]
    return first if later is None else torch.cat([first, later[0]])


@torch.no_grad()
def greedy_answer(
    model: Transformer, result: BlendResult, max_new: int, stop_ids: set[int]
) -> list[int]:
    """Free-running greedy answer from the prefill, at most ``max_new`` tokens, ending with
    the stop token if one is chosen (the cache is rolled back afterwards)."""
    n, logits, out = result.num_tokens, result.logits, []
    for step in range(max_new):
        token = int(logits.argmax())
        out.append(token)
        if token in stop_ids:
            break
        logits, _ = model(
            torch.tensor([[token]], device=model.device),
            torch.tensor([[n + step]], device=model.device),
            result.cache,
        )
        logits = logits[0]
    result.cache.truncate(n)
    return out


def progressive_logits(
    model: Transformer,
    prefill: Callable[[], BlendResult],
    ratio: float,
    answer: list[int],
    lag: int = 1,
) -> torch.Tensor:
    """Teacher-forced logits of progressive blend (``--refresh``): the first ``lag``
    positions' over the prefill's own cache, the later ones over its cache refreshed to
    ``ratio`` with the first answer token (``kvservice.blend.prefill.refresh``) and the
    answer since. ``lag`` 1: the upgrade before the second token; in the product the answer
    streams while the upgrade runs, and it lands a few tokens later
    (``kvservice.serve.batcher``)."""
    result = prefill()
    if len(answer) <= lag:
        return teacher_forced_logits(model, result, answer)
    before = teacher_forced_logits(model, result, answer[:lag])  # positions 0 .. lag-1
    upgraded = refresh(model, result, answer[:1], ratio)
    after = teacher_forced_logits(model, upgraded, answer[1:])  # positions 1 ..
    return torch.cat([before, after[lag - 1 :]])


def progressive_greedy(
    model: Transformer,
    prefill: Callable[[], BlendResult],
    ratio: float,
    max_new: int,
    stop_ids: set[int],
) -> list[int]:
    """Progressive blend's greedy answer: the first token from the prefill, the rest over its
    cache refreshed to ``ratio`` with that token."""
    result = prefill()
    first = int(result.logits.argmax())
    if first in stop_ids or max_new <= 1:
        return [first]
    upgraded = refresh(model, result, [first], ratio)
    return [first, *greedy_answer(model, upgraded, max_new - 1, stop_ids)]


def without_stop(ids: list[int], stop_ids: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in stop_ids else ids
