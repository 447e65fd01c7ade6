"""CacheBlend (arXiv 2405.16444): prefill a prompt from cached chunk KV with selective recompute.

The prompt is ``[head][chunk 1]...[chunk n][question]``. Chunks' KV was precomputed after the
same fixed head (``kvservice.model.transformer.precompute_chunks``), with K stored before RoPE.

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

Every pass pauses after each layer: ``blend_prefill_steps`` and ``refresh_steps`` are
generators that yield once a layer and return their result, so the engine's batcher runs a
prefill in slices between decode steps (``kvservice.serve.batcher``); ``blend_prefill`` and
``refresh`` run them to the end (``run_steps``). A pass recorded as a CUDA graph runs whole.

The parts, by role: ``blend_settings`` (the defaults and the measurements behind them),
``blend_plan`` (the prompt's layout, the candidates and the budget), ``blend_selection``
(which tokens the question's attention ranks first), ``blend_attention`` (attention over the
blended cache), ``blend_placing`` (cached KV rotated into place, stale KV corrected). This
module is the driver: ``blend_prefill``, ``refresh`` and the passes they run.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch
import torch.nn.functional as F

from kvservice.blend.attention import AttentionPlan, attend_layer, attention_plan
from kvservice.blend.graphs import PassGraphs
from kvservice.blend.placing import (
    StaleShift,
    place_layers,
    place_sources,
    place_whole,
    placing_runs,
    shift_stale,
    stale_shift,
)
from kvservice.blend.plan import (
    MODES,
    Mode,
    RecomputePlan,
    Segment,
    StaleReading,
    layout_segments,
    plan_prefill,
    recompute_budget,
    with_cached_prefix,
)
from kvservice.blend.selection import (
    attention_importance,
    local_layer_weights,
    select_recompute,
    selection_layers,
    smooth_scores,
)
from kvservice.blend.settings import BlendSettings
from kvservice.chunk import LayeredKV
from kvservice.model.transformer import KVCache, Transformer
from kvservice.protocol.ratio import DEFAULT_RECOMPUTE_RATIO

T = TypeVar("T")
# A computation that pauses after each layer it runs (yielding None), or while the cached KV
# of its next layer is still on its way from the store (yielding LOADING), and returns a T.
LOADING = "loading"
Steps = Generator[str | None, None, T]

__all__ = [
    "MODES",
    "BlendResult",
    "BlendSettings",
    "Mode",
    "LOADING",
    "Steps",
    "blend_prefill",
    "blend_prefill_steps",
    "can_refresh",
    "refresh",
    "refresh_steps",
    "run_steps",
]


def run_steps(steps: Generator[None, None, T]) -> T:
    """Run a paused computation (``Steps``) to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@dataclass
class BlendResult:
    logits: torch.Tensor  # [V] next-token logits after the last prompt token
    cache: KVCache  # batch 1; slots [0, num_tokens) hold the prompt (K rotated)
    num_tokens: int  # prompt length; the next token goes at this position
    recomputed_per_layer: list[int] = field(default_factory=list)  # tokens computed per layer
    recompute_ratio_effective: float = 0.0  # share of chunk tokens recomputed
    # [L, T] what blend selected by, if it did (zeros below the first layer selection reads)
    question_attention: torch.Tensor | None = None
    # what ``refresh`` needs of a blend that selected: its plan and the prompt's token ids
    plan: RecomputePlan | None = field(default=None, repr=False)
    token_ids: torch.Tensor | None = field(default=None, repr=False)


@dataclass
class Completion:
    """One request's answer, from either engine (``kvservice.serve.engine``,
    ``kvservice.vllm.engine``)."""

    token_ids: list[int]
    text: str
    ttft_s: float
    finish_reason: str
    prefill: BlendResult | None = None


@dataclass
class _Pass:
    """One pass over the layers: ``active`` slots are computed from layer 0 on, attending to
    the whole cache; the rest of the cache is read as it stands."""

    logits: torch.Tensor | None  # [V] after the last active token (None: stopped early)
    attention: torch.Tensor | None  # [L', T] the question's attention per layer run, if recorded


@torch.no_grad()
def _run_pass(
    model: Transformer,
    cache: KVCache,
    token_ids: torch.Tensor,
    active: torch.Tensor,
    *,
    sources: Sequence[Segment] = (),
    question_length: int = 0,
    weigh_from: int = 0,
    stale: StaleReading = StaleReading(),
    until: int | None = None,
    place_from: int = 0,
    shift: StaleShift | None = None,
    ropes: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    graphs: PassGraphs | None = None,
) -> Generator[None, None, _Pass]:
    """Compute the ``active`` slots (sorted; the last one is the prompt's last token) through
    every layer, or the first ``until`` (no logits then). ``sources``' cached KV is written
    into the cache (rotated to its place) as each layer from ``place_from`` on begins, so
    ``.layer(i)`` is read once per layer in order and a loader may prefetch the next one
    meanwhile (``ropes``: the tables, when the caller made them for several passes). With
    ``question_length``, the attention of the last that many active tokens (the question)
    is recorded per layer from ``weigh_from`` on (the first layer selection reads); the
    layers below it record zeros, not computed. With ``graphs`` (``cache`` is theirs), a pass
    they can record runs as one (``kvservice.blend.graphs``); a prefill of every slot does not.
    A generator: it pauses after each layer it runs (not inside a recorded pass)."""
    num_tokens, config = token_ids.numel(), model.config
    until = config.n_layers if until is None else until
    if graphs is not None and not sources and shift is None and active.numel() < num_tokens:
        shape = graphs.shape(active.numel(), num_tokens, until, question_length, weigh_from)
        recorded = shape and graphs.run(token_ids, active, shape, question_length, stale.bias)
        if recorded is not None:
            return _Pass(*recorded)
    if ropes is None:  # per layer: [T, R] x2 (``Transformer.ropes``)
        ropes = model.ropes(torch.arange(num_tokens, device=model.device))
    at_active = _at_active(ropes, active)  # per layer: [1, S, R] x2
    x = model.embed(token_ids[active])[None]  # x: [1, S, dim]
    plans: dict[int | None, AttentionPlan] = {}  # per sliding window (Gemma 3 has two)
    placings = placing_runs(sources, stale, model.device)
    span = _as_span(active)
    attention: list[torch.Tensor] = []
    weighs_all = not (question_length and weigh_from)
    unread = None if weighs_all else torch.zeros(num_tokens, device=model.device)
    for i, layer in enumerate(model.layers[:until]):
        cos_all, sin_all = ropes[i]
        cos_a, sin_a = at_active[i]
        window = config.window(i)
        if window not in plans:
            plans[window] = attention_plan(
                model, cache, active, num_tokens, question_length, stale.bias, i
            )
        plan = plans[window]
        if placings and i >= place_from:
            while not _layer_ready(placings, i):
                yield LOADING
            place_sources(cache, i, placings, cos_all, sin_all)
        # q, k and v in the cache's dtype: [1, H, S, D]; [1, H_kv, S, D]
        q, k_rot, v, k_pre = layer.project(x, cos_a, sin_a, cache.k.dtype)
        if shift is not None:
            shift_stale(cache, i, shift, k_pre, v, active, cos_all, sin_all)
        k_rot = k_rot[0]
        if span is not None:
            cache.k[i, 0, :, span].copy_(k_rot)
            cache.v[i, 0, :, span].copy_(v[0])
        else:
            cache.k[i, 0, :, active] = k_rot
            cache.v[i, 0, :, active] = v[0]
        k_layer, v_layer = cache.k[i, :, :, :num_tokens], cache.v[i, :, :, :num_tokens]
        last = i == config.n_layers - 1
        out, weights = attend_layer(plan, q, k_layer, v_layer, last, weigh=i >= weigh_from)
        if question_length:
            attention.append(unread if weights is None else weights)
        if last:  # after the last layer only the last token's output counts
            x, out = x[:, -1:], out[:, :, -1:]
        x = layer.finish(x, out)
        yield
    logits = model.logits(x[0, -1]) if until == config.n_layers else None
    return _Pass(logits, torch.stack(attention) if attention else None)


def _layer_ready(placings, i: int) -> bool:
    """Whether every cached source has layer ``i`` at hand (a store's loader may not yet)."""
    return all(
        getattr(seg.source, "layer_ready", None) is None or seg.source.layer_ready(i)
        for placing in placings
        for seg in placing.segments
    )


def _at_active(ropes: list[tuple[torch.Tensor, torch.Tensor]], active: torch.Tensor):
    """Each layer's cos/sin at the ``active`` slots, ``[1, S, R]``: gathered once for every
    layer that shares its RoPE tables (all, or Gemma 3's two kinds), not once a layer."""
    gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for cos, sin in ropes:
        if id(cos) not in gathered:
            gathered[id(cos)] = (cos[active][None], sin[active][None])
    return [gathered[id(cos)] for cos, _ in ropes]


def _as_span(active: torch.Tensor) -> slice | None:
    """``active`` (sorted, distinct slots) as a slice when it is one run of slots (a prefill,
    or the question after reused chunks), else None."""
    if active.numel() == 0:
        return None
    first, last = int(active[0]), int(active[-1])
    return slice(first, last + 1) if last - first + 1 == active.numel() else None


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


def blend_prefill(*args, **kwargs) -> BlendResult:
    """``blend_prefill_steps`` run to its end (the same arguments)."""
    return run_steps(blend_prefill_steps(*args, **kwargs))


@torch.no_grad()
def blend_prefill_steps(
    model: Transformer,
    head_ids: Sequence[int],
    chunks: Sequence[LayeredKV | None],
    question_ids: Sequence[int],
    *,
    mode: Mode = "blend",
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO,
    chunk_ids: Sequence[Sequence[int]] | None = None,
    head_kv: LayeredKV | None = None,
    extra_capacity: int = 0,
    settings: BlendSettings = BlendSettings(),
    recompute_slots: Sequence[int] | None = None,
    cached_prefix: LayeredKV | None = None,
) -> Generator[None, None, BlendResult]:
    """Prefill ``[head][chunks...][question]`` in one of the four modes; see the module doc.
    Pauses after each layer of each pass it runs itself (``Steps``); the checks of the
    arguments raise at the first step.

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
    earlier prompt left them (``kvservice.serve.prefix``: a follow-up sharing the previous turn's
    passages): read as is, never recomputed, and not counted in the chunk tokens the ratio
    applies to; it must end at a segment boundary. Not in ``full`` mode.
    """
    chunk_ids = _checked(mode, recompute_ratio, chunks, chunk_ids, question_ids, cached_prefix)
    device, config = model.device, model.config
    segments = layout_segments(head_ids, chunks, chunk_ids, question_ids, head_kv, mode)
    num_tokens = segments[-1].stop
    token_ids = _prompt_ids(segments, head_ids, chunk_ids, question_ids, device)
    segments = with_cached_prefix(segments, cached_prefix)
    cache = KVCache(config, 1, num_tokens + extra_capacity, device, model.cache_dtype, num_tokens)
    cache.reserve(torch.arange(num_tokens, device=device)[None])

    plan = plan_prefill(
        segments, head_ids, mode, recompute_ratio, recompute_slots, settings, device
    )
    graphs: PassGraphs | None = getattr(model, "pass_graphs", None)
    if graphs is None or mode == "full" or num_tokens > graphs.capacity:
        return (yield from _prefill(model, cache, token_ids, plan))
    # The passes run in the graphs' cache, then the prompt's KV is copied: in one go, since
    # another prefill would use the same cache (fast where graphs record: on a GPU).
    with graphs.lock:
        result = run_steps(_prefill(model, graphs.begin(num_tokens), token_ids, plan, graphs))
        cache.k[:, :, :, :num_tokens] = graphs.cache.k[:, :, :, :num_tokens]
        cache.v[:, :, :, :num_tokens] = graphs.cache.v[:, :, :, :num_tokens]
    result.cache = cache
    return result


def can_refresh(result: BlendResult) -> bool:
    """Whether ``refresh`` can upgrade ``result``: a blend that selected its tokens in one
    round (not reuse, full, fixed slots, or a blend with nothing left to select)."""
    plan = result.plan
    return (
        plan is not None
        and result.question_attention is not None
        and result.token_ids is not None
        and plan.slots is None
        and plan.settings.rounds == 1
    )


def refresh(
    model: Transformer, result: BlendResult, answer_ids: Sequence[int], ratio: float
) -> BlendResult:
    """``refresh_steps`` run to its end."""
    return run_steps(refresh_steps(model, result, answer_ids, ratio))


@torch.no_grad()
def refresh_steps(
    model: Transformer, result: BlendResult, answer_ids: Sequence[int], ratio: float
) -> Generator[None, None, BlendResult]:
    """Progressive blend, pausing after each layer (``Steps``): the cache of a blend that
    selected (``result``) upgraded to ``ratio`` once the first answer tokens (``answer_ids``,
    not yet in the cache) are known. The top ``ratio`` of the same first-pass attention
    (which holds what was recomputed), the question and the answer tokens are computed
    again from layer 0 over the cache: the cache then holds what a blend at ``ratio``
    followed by those tokens would hold. Returns the logits after the last answer token
    (the next one's), the cache ``result``'s, grown by the answer. Of blend 0.10's
    teacher-forced KL the first answer token holds ~7 %: first token at 0.10, the rest over
    0.25 gave 0.0238 on validation against 0.0385 (docs/blend.md, "Progressive blend")."""
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
        plan,
        segments=[*plan.segments[:-1], replace(question, length=question.length + extra)],
        candidate=torch.cat([plan.candidate, no]),
        computed=torch.cat([plan.computed, no]),
        budget=recompute_budget("blend", ratio, plan.chunk_tokens, int(plan.candidate.sum()), None),
        stale=stale,
    )
    logits, selected, passes = yield from _recompute(
        model, cache, torch.cat([ids, answer]), longer, F.pad(attention, (0, extra)), None
    )
    share = selected.numel() / max(1, plan.chunk_tokens)
    computed = [passes] * model.config.n_layers
    return BlendResult(logits, cache, n + extra, computed, share, attention)


def _prefill(
    model, cache, token_ids, plan: RecomputePlan, graphs=None
) -> Generator[None, None, BlendResult]:
    """Pass 1 (what is not cached: the question, misses; everything in full) over the cached
    KV, then the recompute rounds (``_recompute``) when there is a budget. When blend selects
    and pass 1 computes only the question, pass 1 ends at the last layer selection reads
    (``attention_to_depth``): the first recompute pass, which computes the question again
    anyway, places the deeper layers' cached KV. (Misses or an uncached head would have to
    be computed again from layer 0: then pass 1 runs every layer.) With ``graphs``, every
    layer of the cached KV is placed first: a recorded pass reads the cache whole."""
    num_tokens, layers = token_ids.numel(), model.config.n_layers
    question = plan.segments[-1].length
    sources = [seg for seg in plan.segments if seg.source is not None]
    ropes = model.ropes(torch.arange(num_tokens, device=model.device))  # the passes share them
    placed = place_whole(cache, sources, plan.stale, ropes)
    sources = [seg for seg in sources if seg not in placed]
    if graphs is not None and sources:
        place_layers(cache, placing_runs(sources, plan.stale, model.device), ropes)
        sources = []
    selects = bool(plan.budget) and plan.slots is None
    settings, per_layer = plan.settings, int(plan.computed.sum())
    read_from, read_until = _read_layers(model, settings)
    until = read_until if selects and per_layer == question else layers
    first = yield from _run_pass(
        model,
        cache,
        token_ids,
        plan.computed.nonzero().squeeze(1),
        sources=sources,
        question_length=question if selects else 0,
        weigh_from=read_from,
        stale=plan.stale,
        until=until,
        ropes=ropes,
        graphs=graphs,
    )
    if not plan.budget:
        recomputed = int((plan.computed & plan.candidate).sum()) if plan.blend else 0
        share = recomputed / max(1, plan.chunk_tokens)
        return BlendResult(first.logits, cache, num_tokens, [per_layer] * layers, share)
    deeper = _Deeper(sources, until) if until < layers and sources else None
    logits, selected, passes = yield from _recompute(
        model, cache, token_ids, plan, first.attention, deeper, ropes, graphs
    )
    share = selected.numel() / max(1, plan.chunk_tokens)
    computed = [passes + (per_layer if i < until else 0) for i in range(layers)]
    return BlendResult(logits, cache, num_tokens, computed, share, first.attention, plan, token_ids)


def warm_graphs(
    model: Transformer,
    graphs: PassGraphs,
    contexts: Sequence[int] = (2048, 4096, 8192),
    question: int = 32,
    ratio: float = DEFAULT_RECOMPUTE_RATIO,
    settings: BlendSettings = BlendSettings(),
) -> list:
    """Record the passes a question of up to ``question`` tokens over a prompt of each of
    ``contexts`` tokens runs (reuse's; blend's two, at ``ratio``), before any request: a
    worker's warm-up. Returns the shapes recorded."""
    layers, (read_from, read_until) = model.config.n_layers, _read_layers(model, settings)
    shapes = []
    for tokens in contexts:
        recomputed = math.ceil(ratio * (tokens - question)) + question
        for count, until, weighed in (
            (question, layers, 0),
            (question, read_until, question),
            (recomputed, layers, 0),
        ):
            shape = graphs.shape(count, tokens, until, weighed, read_from)
            if shape is not None and graphs.prepare(shape):
                shapes.append(shape)
    return shapes


def _read_layers(model: Transformer, settings: BlendSettings) -> tuple[int, int]:
    """The layers ``[first, stop)`` whose question attention selection reads."""
    from_depth, to_depth = settings.attention_from_depth, settings.attention_to_depth
    return selection_layers(model.config.n_layers, from_depth, to_depth)


@dataclass(frozen=True)
class _Deeper:
    """What pass 1 left to the first recompute pass: placing ``sources`` from layer ``start``
    on (pass 1, which computed only the question, stopped there)."""

    sources: list[Segment]
    start: int


def _recompute(
    model,
    cache,
    token_ids,
    rounds: RecomputePlan,
    attention,
    deeper: _Deeper | None,
    ropes=None,
    graphs: PassGraphs | None = None,
):
    """The recompute passes: each round selects by the question's attention in the pass
    before it (``attention [L', T]``) among the candidates not yet recomputed, then computes
    those tokens and the question from layer 0 on (the first round also places the cached KV
    of the layers pass 1 did not reach, ``deeper``). Returns the last logits,
    every selected slot, and the tokens computed per layer in all (a generator: ``Steps``)."""
    num_tokens, settings = token_ids.numel(), rounds.settings
    layers = model.config.n_layers
    weights = local_layer_weights(
        [model.config.window(i) for i in range(layers)], settings.local_layer_weight
    )
    chosen = torch.zeros_like(rounds.candidate)
    counts, forced, computed = rounds.counts(), rounds.forced(), 0
    for index, count in enumerate(counts):
        if rounds.slots is not None:
            new = rounds.slots
        else:
            left = rounds.candidate & ~chosen
            scores = attention_importance(
                attention,
                left,
                settings.attention_from_depth,
                settings.attention_to_depth,
                layers,
                weights,
            )
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
        stale = StaleReading(bias=None if bias is None else bias * ~chosen)
        place: dict = {}
        if deeper is not None and index == 0:
            stale = replace(rounds.stale, bias=stale.bias)
            place = {"sources": deeper.sources, "place_from": deeper.start}
        active = again.nonzero().squeeze(1)
        shift = stale_shift(rounds.stale, active, settings)
        step = yield from _run_pass(
            model,
            cache,
            token_ids,
            active,
            question_length=recorded,
            weigh_from=_read_layers(model, settings)[0],
            stale=stale,
            shift=shift,
            ropes=ropes,
            graphs=graphs,
            **place,
        )
        attention, computed = step.attention, computed + int(again.sum())
    return step.logits, chosen.nonzero().squeeze(1), computed
