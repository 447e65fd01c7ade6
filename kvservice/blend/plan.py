"""What one blend prefill computes: the prompt's layout (``Segment``s: head, cached or missed
chunks, question, a cached prefix), the chunk tokens that may be recomputed, the budget, and
how the stale cached KV is read (``StaleReading``); ``plan_prefill`` puts them in one
``RecomputePlan`` that the driver (``kvservice.blend.prefill``) runs."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvservice.blend.selection import round_budgets
from kvservice.blend.settings import BlendSettings
from kvservice.chunk import LayeredKV
from kvservice.model.transformer import head_hash

Mode = Literal["full", "prefix", "reuse", "blend"]
MODES: tuple[Mode, ...] = ("full", "prefix", "reuse", "blend")


@dataclass
class Segment:
    start: int  # first position in the prompt
    length: int
    source: LayeredKV | None  # cached KV to read, or None when computed fresh
    kind: Literal["head", "chunk", "question", "prefix"]

    @property
    def stop(self) -> int:
        return self.start + self.length


def layout_segments(
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


def with_cached_prefix(segments: list[Segment], prefix: LayeredKV | None) -> list[Segment]:
    """The segments that end within ``prefix`` (a previous prompt's KV, K rotated at its
    positions: ``kvservice.serve.prefix.PrefixKV``) replaced by one segment read from it as is."""
    if prefix is None:
        return segments
    covered = [seg for seg in segments if seg.stop <= prefix.num_tokens]
    if not covered or covered[-1].stop != prefix.num_tokens or covered[-1].kind == "question":
        raise ValueError("a cached prefix must end at a segment boundary before the question")
    return [Segment(0, prefix.num_tokens, prefix, "prefix"), *segments[len(covered) :]]


def recompute_candidates(segments: list[Segment], head_ids: Sequence[int], num_tokens: int, device):
    """``[T]`` bool: the cached chunk tokens blend may recompute. The first chunk is exact
    when it was precomputed after this same head (it sits where it was computed), so it is
    not one."""
    spans = []
    for seg in (s for s in segments if s.kind == "chunk"):
        at_home = seg.start == len(head_ids)  # right after the head, where it was computed
        exact = at_home and getattr(seg.source, "head_hash", None) == head_hash(head_ids)
        if seg.source is not None and not exact:
            spans.append((seg.start, seg.stop))
    return slots_mask(num_tokens, spans, device)


def slots_mask(num_tokens: int, spans: Iterable[tuple[int, int]], device) -> torch.Tensor:
    """``[T]`` bool, True in each ``[start, stop)``: marked on the host and moved in one copy
    (a fill per span would be an operator each, a kernel launch on a GPU)."""
    marks = bytearray(num_tokens)
    for start, stop in spans:
        stop = min(stop, num_tokens)
        marks[start:stop] = b"\x01" * max(0, stop - start)
    if not marks:  # (frombuffer takes no empty buffer)
        return torch.zeros(0, dtype=torch.bool, device=device)
    return torch.frombuffer(marks, dtype=torch.bool).to(device)


@dataclass(frozen=True)
class StaleReading:
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


def recompute_budget(
    mode: Mode, ratio: float, chunk_tokens: int, candidates: int, slots: int | None
) -> int:
    """How many chunk tokens blend recomputes: ``ceil(ratio * chunk tokens)``, or the fixed
    slots' count, at most the candidates; 0 in the other modes."""
    budget = math.ceil(ratio * chunk_tokens - 1e-9) if slots is None else slots
    return min(budget, candidates) if mode == "blend" else 0


def stale_reading(
    segments: list[Segment], stale: torch.Tensor, settings: BlendSettings
) -> StaleReading:
    """How the stale cached chunk KV (``stale [T]``) is read in the first pass. A chunk's
    keys are scaled by ``stale_key_scale``, or, with ``stale_ramp_tokens``, by as much of it
    as the cached chunk tokens before it (the context its stored KV never saw) make up of
    that many: a passage right after the head is read as stored. ``stale_bias`` is added to
    the logits of a chunk's stale keys in the same proportion."""
    spans, scales, before, unseen = [], [], [], 0
    bias = torch.zeros(stale.shape, device=stale.device) if settings.stale_bias else None
    marks = stale.tolist()  # read on the host once, not a reduction per chunk
    for seg in segments:
        if seg.kind != "chunk" or seg.source is None:
            continue
        if any(marks[seg.start : seg.stop]):
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
    return StaleReading(tuple(spans), tuple(scales), bias, tuple(before))


@dataclass
class RecomputePlan:
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
    stale: StaleReading
    slots: torch.Tensor | None = None

    def counts(self) -> list[int]:
        """Tokens selected per round (``round_budgets``)."""
        if self.slots is not None:
            return [self.slots.numel()]
        return round_budgets(self.budget, self.settings.rounds, self.settings.first_round_share)

    def forced(self) -> torch.Tensor:
        """``[T]`` bool: the first ``chunk_starts`` tokens of every candidate chunk."""
        starts = self.settings.chunk_starts
        chunks = (s for s in self.segments if s.kind == "chunk")
        forced = slots_mask(
            self.candidate.numel(),
            ((s.start, s.start + starts) for s in chunks),
            self.candidate.device,
        )
        return forced & self.candidate


def plan_prefill(
    segments, head_ids, mode, ratio, recompute_slots, settings, device
) -> RecomputePlan:
    """What blend computes: the slots not cached (pass 1), the candidates and the budget of
    the recompute rounds after it."""
    num_tokens = segments[-1].stop
    candidate = recompute_candidates(segments, head_ids, num_tokens, device)
    chunk_tokens = sum(s.length for s in segments if s.kind == "chunk")
    slots = None if recompute_slots is None else len(recompute_slots)
    budget = recompute_budget(mode, ratio, chunk_tokens, int(candidate.sum()), slots)
    computed = slots_mask(
        num_tokens, ((s.start, s.stop) for s in segments if s.source is None), device
    )
    if budget and budget == int(candidate.sum()):  # everything: one pass, as full
        computed |= candidate
        budget = 0
    # The corrections of stale KV belong to blend: reuse read through them was worse
    # (validation example 20 at a temperature of 1/0.9: 0.161 against 0.149).
    stale = stale_reading(segments, candidate & ~computed, settings) if budget else StaleReading()
    plan = RecomputePlan(
        segments, candidate, computed, budget, chunk_tokens, mode == "blend", settings, stale
    )
    if recompute_slots is not None and budget:
        plan.slots = torch.as_tensor(list(recompute_slots), device=device).sort().values
    return plan
