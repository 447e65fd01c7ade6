"""Placing cached KV in the prompt: each layer's cached chunk keys rotated from "no
position" (K is stored before RoPE) to their slots, stale keys scaled by their temperature,
and, with ``BlendSettings.stale_shift``, stale chunks moved by what their recomputed tokens
measured (``shift_stale``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvservice.blend.plan import Segment, StaleReading
from kvservice.blend.settings import BlendSettings
from kvservice.chunk import ChunkKV
from kvservice.model.transformer import apply_rope


def rotate_into(
    dest: torch.Tensor,
    k_pre: torch.Tensor | Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float | torch.Tensor = 1.0,
    *,
    scaled: bool = False,
) -> None:
    """Write pre-RoPE keys ``k_pre [H_kv, n, D]`` into ``dest [H_kv, n, D]`` (a cache slice)
    rotated by ``cos``/``sin`` ``[n, R]``: ``apply_rope`` in float32 (a float16 or bfloat16
    store is widened inside its operators), rounded once into ``dest``: three operators, no
    temporary copy. The keys are multiplied by ``scale`` on the way (a number, or one per
    token, ``[n, 1]``: ``StaleReading.key_scale``): a rotation is linear, so scaled tables give
    it in the same operators (``scaled``: ``cos``/``sin`` carry the scale already, as
    ``Placing.tables`` makes them once a pass). ``k_pre`` may be consecutive segments' keys,
    ``[H_kv, n_j, D]`` each (``place_sources``): read as one where they lie side by side
    (``joined_view``), else joined by one copy, then rotated as one."""
    if not isinstance(k_pre, torch.Tensor):
        joined = joined_view(k_pre)
        k_pre = torch.cat([p.to(dest.device) for p in k_pre], -2) if joined is None else joined
    k_pre = k_pre.to(dest.device)
    if not scaled:
        cos, sin = scaled_tables(cos, sin, scale)
    apply_rope(k_pre, cos, sin, compute=torch.float32, out=dest)
    rotary = cos.shape[-1]  # < D with partial rotary: the other dims are scaled alone
    if _scales(scale) and rotary < dest.shape[-1]:
        dest[..., rotary:] = k_pre[..., rotary:].float() * scale


def joined_view(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[..., n_0 + n_1 + ..., D]``: tensors ``[..., n_j, D]`` that lie side by side along
    their tokens in one buffer (the loader decodes a request's chunks so:
    ``joined.joint_slots``) seen as one, without a copy; None where they do not."""
    first = parts[0]
    step, at = first.stride(-2), first.storage_offset()
    for part in parts:
        if (
            part.shape[:-2] != first.shape[:-2]
            or part.shape[-1] != first.shape[-1]
            or not _one_buffer(first, part)
            or part.storage_offset() != at
        ):
            return None
        at += part.shape[-2] * step
    tokens = sum(part.shape[-2] for part in parts)
    return first.as_strided((*first.shape[:-2], tokens, first.shape[-1]), first.stride())


def _scales(scale: float | torch.Tensor) -> bool:
    return isinstance(scale, torch.Tensor) or scale != 1.0


def scaled_tables(
    cos: torch.Tensor, sin: torch.Tensor, scale: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin times ``scale`` (the tables themselves when it is 1): rotating by them
    rotates and scales at once."""
    return (cos * scale, sin * scale) if _scales(scale) else (cos, sin)


@dataclass(frozen=True)
class Placing:
    """Cached segments that sit side by side, placed as one (``place_sources``): their keys
    rotated in one pass, each token's by its segment's scale (``scale``: one number when they
    share it, else ``[n, 1]``); a cached prefix (already rotated) is copied alone."""

    segments: tuple[Segment, ...]
    span: slice
    scale: float | torch.Tensor
    rotated: bool = False
    _tables: dict = field(default_factory=dict, compare=False, repr=False)

    def tables(self, cos_all: torch.Tensor, sin_all: torch.Tensor):
        """cos and sin at the run's slots times its scale (``rotate_into(scaled=True)``):
        the same for every layer that shares the RoPE tables, so made once a pass."""
        key = id(cos_all)  # the pass's tables live as long as its placings
        if key not in self._tables:
            self._tables[key] = scaled_tables(cos_all[self.span], sin_all[self.span], self.scale)
        return self._tables[key]


def placing_runs(sources: Sequence[Segment], stale: StaleReading, device) -> list[Placing]:
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
        if len(set(scales)) > 1:  # [n, 1], made from a list: no operator per segment
            per_token = [s for seg, s in zip(run, scales, strict=True) for _ in range(seg.length)]
            scale = torch.tensor(per_token, dtype=torch.float32)[:, None].to(device)
        span = slice(run[0].start, run[-1].stop)
        placings.append(Placing(tuple(run), span, scale, run[0].kind == "prefix"))
    return placings


def place_whole(cache, segments: Sequence[Segment], stale: StaleReading, ropes) -> list[Segment]:
    """Every layer at once of the ``segments`` held whole in memory (``ChunkKV``: the prompt
    head, chunks given as tensors), where every layer shares its RoPE tables (``ropes``, per
    layer); returns the segments placed, which ``place_sources`` then leaves alone. Placed
    layer by layer, the head joined the chunks' keys in one copy a layer; without it, the
    chunks a loader decoded side by side are rotated where they lie (``joined_view``)."""
    whole = [seg for seg in segments if isinstance(seg.source, ChunkKV)]
    if not whole or not _one_table(ropes):
        return []
    cos_all, sin_all = ropes[0]
    device = cache.k.device
    for placing in placing_runs(whole, stale, device):
        keys = [seg.source.k.to(device) for seg in placing.segments]  # [L, H_kv, n, D]
        values = [seg.source.v.to(device) for seg in placing.segments]
        dest = cache.k[:, 0, :, placing.span]
        if placing.rotated:
            dest.copy_(keys[0] if len(keys) == 1 else torch.cat(keys, dim=-2))
        else:
            rotate_into(
                dest,
                keys[0] if len(keys) == 1 else keys,
                *placing.tables(cos_all, sin_all),
                placing.scale,
                scaled=True,
            )
        cache.v[:, 0, :, placing.span] = values[0] if len(values) == 1 else torch.cat(values, -2)
    return whole


def _one_table(ropes) -> bool:
    """Whether every layer rotates by the same RoPE tables (not Gemma 3's two kinds)."""
    return len({id(cos) for cos, _ in ropes}) == 1


def place_sources(cache, i: int, placings: Sequence[Placing], cos_all, sin_all) -> None:
    """Layer ``i`` of every cached segment written into the cache, rotated to its place (a
    cached prefix is already rotated), stale chunk keys scaled by ``StaleReading.key_scale``. The
    segments side by side go as one run (``placing_runs``): on a GPU a rotation per chunk and
    layer was ~8 small operations each, what the host spent most of a reuse on."""
    for placing in placings:
        layers = [seg.source.layer(i) for seg in placing.segments]  # [H_kv, n, D] pairs
        span = placing.span
        if placing.rotated:
            cache.k[i, 0, :, span] = layers[0][0]
        else:
            keys = [k for k, _ in layers]
            rotate_into(
                cache.k[i, 0, :, span],
                keys[0] if len(keys) == 1 else keys,
                *placing.tables(cos_all, sin_all),
                placing.scale,
                scaled=True,
            )
        values = [v for _, v in layers]
        joined = joined_view(values) if len(values) > 1 else values[0]
        if joined is not None:
            cache.v[i, 0, :, span] = joined
        else:
            torch.cat([v.to(cache.v.device) for v in values], dim=1, out=cache.v[i, 0, :, span])


def place_layers(cache, placings: Sequence[Placing], ropes) -> None:
    """Every layer of ``placings``' segments written into the cache at once, before a pass
    that reads the cache whole (a recorded pass, ``kvservice.blend.graphs``): the layers a
    loader decoded in one run (views a fixed step apart in one buffer,
    ``loader.DECODE_LAYERS``) are placed as one block, one rotation and one copy a run of
    layers where ``place_sources`` spends them a layer (on a GPU each operator is a launch).
    A run of segments is one block where its segments lie side by side (``joined_view``),
    else each segment is; where neither holds, or the layers share no RoPE tables (Gemma 3),
    layer by layer."""
    if not _one_table(ropes):
        for i, (cos_all, sin_all) in enumerate(ropes):
            place_sources(cache, i, placings, cos_all, sin_all)
        return
    cos_all, sin_all = ropes[0]
    for placing in placings:
        layers = [[seg.source.layer(i) for seg in placing.segments] for i in range(len(ropes))]
        units = _placing_units(placing, layers)
        if units is None:
            for i in range(len(ropes)):
                place_sources(cache, i, [placing], cos_all, sin_all)
            continue
        cos_run, sin_run = placing.tables(cos_all, sin_all)
        for at, span, keys, values, cuts in units:
            rows = slice(at, at + span.stop - span.start)  # the unit's rows of the run's tables
            scale = placing.scale
            scale = scale[rows] if isinstance(scale, torch.Tensor) else scale
            for first, stop in cuts:
                dest = cache.k[first:stop, 0, :, span]
                k, v = _stacked(keys[first:stop]), _stacked(values[first:stop])
                if placing.rotated:
                    dest.copy_(k)
                else:
                    rotate_into(dest, k, cos_run[rows], sin_run[rows], scale, scaled=True)
                cache.v[first:stop, 0, :, span] = v


def _placing_units(placing: Placing, layers):
    """What ``place_layers`` places a block at a time for ``placing`` (``layers``: per layer,
    each segment's K and V): the run whole where its segments' layers lie side by side, else
    each segment, as ``(row in the run, slots, per-layer K, per-layer V, blocks of layers)``;
    None where placing by blocks would not dispatch fewer operators than layer by layer."""
    joined = [
        (joined_view([k for k, _ in layer]), joined_view([v for _, v in layer])) for layer in layers
    ]
    if all(k is not None and v is not None for k, v in joined):
        keys, values = [k for k, _ in joined], [v for _, v in joined]
        return [(0, placing.span, keys, values, _layer_cuts(keys, values))]
    units = []
    for j, seg in enumerate(placing.segments):
        keys, values = [layer[j][0] for layer in layers], [layer[j][1] for layer in layers]
        at, span = seg.start - placing.span.start, slice(seg.start, seg.stop)
        units.append((at, span, keys, values, _layer_cuts(keys, values)))
    blocks = sum(len(unit[-1]) for unit in units)
    return units if blocks < len(layers) else None


def _layer_cuts(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
    """The layers ``[first, stop)`` whose K and whose V each lie a fixed step apart in one
    buffer (``_stacked``)."""
    starts = sorted(set(_stack_starts(keys)) | set(_stack_starts(values)))
    return list(zip(starts, [*starts[1:], len(keys)], strict=True))


def _stack_starts(parts: Sequence[torch.Tensor]) -> list[int]:
    starts, step = [0], None
    for n in range(1, len(parts)):
        gap = _gap(parts[n - 1], parts[n])
        if gap is not None and (step is None or gap == step):
            step = gap
        else:
            starts.append(n)
            step = None
    return starts


def _gap(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """How far past ``a`` ``b`` lies in their buffer, if they are alike views of one buffer."""
    if a.shape != b.shape or not _one_buffer(a, b):
        return None
    gap = b.storage_offset() - a.storage_offset()
    return gap if gap > 0 else None


def _one_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one buffer with the same strides and dtype."""
    return (
        a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def _stacked(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[m, ...]``: tensors a fixed step apart in one buffer (``_layer_cuts``) as one view."""
    first = parts[0]
    if len(parts) == 1:
        return first[None]
    step = parts[1].storage_offset() - first.storage_offset()
    shape, strides = (len(parts), *first.shape), (step, *first.stride())
    return first.as_strided(shape, strides, first.storage_offset())


@dataclass(frozen=True)
class StaleShift:
    """The stale chunks of a recompute pass (``shift_stale``): as they were placed
    (``stale``: their slots and key scales), per chunk the rows of ``active`` it recomputes,
    and how much each is moved."""

    stale: StaleReading
    rows: tuple[torch.Tensor, ...]
    shares: tuple[float, ...]  # per chunk: how much of its estimate it is moved by (0: not)
    pool: int  # recomputed tokens' worth of the mean over every chunk in each chunk's estimate


def stale_shift(
    stale: StaleReading, active: torch.Tensor, settings: BlendSettings
) -> StaleShift | None:
    """What ``shift_stale`` measures and moves in a recompute pass over ``active``: every
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
        if r.numel() >= settings.stale_shift_min_tokens
        else 0.0
        for r, unseen in zip(rows, stale.unseen, strict=True)
    )
    if not any(shares) or not any(r.numel() for r in rows):
        return None
    return StaleShift(stale, rows, shares, settings.stale_shift_pool)


def shift_stale(cache, i: int, shift: StaleShift, k_pre, v, active, cos_all, sin_all) -> None:
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
