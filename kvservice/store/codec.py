"""Chunk KV codecs: how one layer's K and V become bytes in a chunk object, and back.

A codec is a ``Codec`` (``kvservice.protocol.codecs``): a kind (how values are coded) and,
for the grouped integer kind, the bit width of K and of V in each layer and the group sizes.
The object records the kind,
the group sizes and every layer's bit widths (``kvservice.store.format``), so an object
decodes by what it says, whatever the codecs are named or tuned to later.

Kinds:

* ``raw``: K and V as they are, in 16 bits (``KV_STORE_DTYPE``; float32 if asked).
* ``int8``: 8-bit per-token quantization with a float32 scale per (head, token)
  (``kvservice.store.quant``, the store's first quantized format).
* ``fp8``: float8 e4m3 with a float16 scale per (head, token): the baseline.
* ``kivi``: grouped asymmetric integer quantization (KIVI, arXiv 2402.02750). K per
  channel: each channel of each head gets a minimum and a step per group of ``k_group``
  tokens, because keys, stored before RoPE, have a few channels of large magnitude on every
  token; V per token: each (head, token) gets a minimum and a step per ``v_group`` channels.
  Minima and steps are float16; codes of ``b`` bits are packed 8 values to ``b`` bytes.
  Two encoder refinements, both measured on the tuning examples (``docs/codec.md``): each
  group's range is the one among a few shares of its own (:data:`CLIPS`) that gives the
  least squared error (``clip``; nothing to decode), and V may be turned by a Hadamard
  matrix before quantizing (``v_rotate``, recorded in the object; decode turns it back),
  which spreads an outlier channel over the token's others.

Decoding is torch only (shifts, masks, one fused multiply-add), so it runs the same on CPU
and on CUDA, on the device the object's bytes are on.

The named codecs (``KV_CODEC``) and the measurements that chose the default are in
``kvservice.protocol.codecs.CODECS`` (a table the web app reads too); ``python -m bench.codec``
measures them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from kvservice.protocol.codecs import (
    FP8,
    INT8,
    KIND_NAMES,
    KIVI,
    RAW,
    Codec,
    k_groups,
    v_group_size,
)
from kvservice.store.quant import dequantize_per_token, quantize_per_token

FP8_MAX = 448.0  # largest finite float8 e4m3fn


def describe(kind: int, layer_bits: Sequence[tuple[int, int]], dtype: torch.dtype) -> str:
    """What an object is stored as, in words: ``fp16`` (or ``raw float32``..), ``int8``,
    ``fp8``, or ``kivi`` with its (K, V) bit widths (``kivi k4v2``)."""
    if kind == KIVI:
        return "kivi " + ",".join(f"k{k}v{v}" for k, v in sorted(set(layer_bits)))
    if kind != RAW:
        return KIND_NAMES[kind]
    return "fp16" if dtype == torch.float16 else f"raw {str(dtype).removeprefix('torch.')}"


# --------------------------------------------------------------------------------------------
# Bit packing: 8 codes of ``bits`` bits in ``bits`` bytes, little-endian within each byte run


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes (< 2**bits, any shape) -> uint8 ``[packed_size(numel, bits)]``."""
    flat = codes.reshape(-1).to(torch.int64)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8)).view(-1, 8)  # [N, 8]
    shifts = torch.arange(8, device=flat.device, dtype=torch.int64) * bits
    word = (flat << shifts).sum(-1)  # [N]: 8 codes in 8 * bits <= 64 bits
    byte_shifts = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    return ((word[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)  # [N * bits]


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 (any shape; a run's layers may be rows of a
    strided view) -> ``[count]`` codes (uint8 where ``bits`` divides 8, else int32 or
    int64). Two operators: every code slot of a byte (or of a run of ``bits`` bytes, one
    integer) shifted by a tensor of shifts at once, then masked. One shift-and-mask per
    slot took two operators a slot (sixteen for 3-bit codes); the broadcast shift is as
    fast on the CPU (a 4-bit K run of 26 layers of a 630-token chunk: 16 against 34 ms,
    2 threads, a busy machine) and one kernel a step on a GPU."""
    if bits == 8:
        return packed.reshape(-1)[:count]
    if 8 % bits == 0:  # whole codes per byte
        words, slots = packed, 8 // bits
    else:  # 8 codes in a run of ``bits`` bytes
        words, slots = _run_words(packed, bits), 8
    shifts = _shifts(bits, slots, words.dtype, str(words.device))
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).view(-1)[:count]


@functools.lru_cache(maxsize=32)
def _shifts(bits: int, slots: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """``[slots]``: the shift that brings each code slot of a word down to its low bits."""
    return (torch.arange(slots) * bits).to(dtype=dtype, device=device)


def _run_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Each run of 8 codes (``bits`` bytes, little-endian) as one integer, ``[..., N]``
    (``packed`` may have leading dims: layers of a run, each its row): one copy of the runs
    into the low bytes of 4- or 8-byte words, seen as integers (little-endian, as every
    platform torch runs on here). The words' high bytes are left unset: the codes lie in
    the low ``8 * bits`` bits, and ``unpack_bits`` masks each shifted slot to ``bits``. A
    widening copy and a shift and an OR per further byte took six operators (3-bit codes)."""
    runs = packed.unflatten(-1, (-1, bits))  # [..., N, bits]
    width, as_int = (4, torch.int32) if bits <= 4 else (8, torch.int64)
    words = torch.empty((*runs.shape[:-1], width), dtype=torch.uint8, device=packed.device)
    words[..., :bits].copy_(runs)
    return words.view(as_int).squeeze(-1)


# --------------------------------------------------------------------------------------------
# Grouped asymmetric quantization


CLIPS = (1.0, 0.9, 0.8, 0.7)  # shares of a group's range tried; the least squared error wins


def quantize_groups(
    x: torch.Tensor, bits: int, dim: int, *, clip: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes of ``x`` with one float16 minimum and step per slice along ``dim`` (a group):
    returns (codes like x, int64; step; minimum), the last two with ``dim`` reduced.

    Without ``clip`` the range is the group's own (``|x - decode| <= step / 2`` up to float16
    rounding of the minimum and step). With it, each group takes the range, centred on its
    own, among :data:`CLIPS` of it, that gives the least squared error: a rare outlier is
    clipped instead of widening every value's step (encoder only; on the SmolLM2-135M chunks
    of tuning examples 1 and 3, V at 3 bits per token: relative error 0.205 -> 0.184)."""
    xf = x.float()
    levels = (1 << bits) - 1
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    if not (bool(lo.isfinite().all()) and bool(hi.isfinite().all())) or (
        float(hi.abs().max()) > 60000.0 or float(lo.abs().max()) > 60000.0
    ):
        raise OverflowError("KV values beyond float16's range: not quantized")
    best = None
    for share in CLIPS if clip else (1.0,):
        mid, half = (lo + hi) / 2, (hi - lo) / 2 * share
        low = (mid - half).to(torch.float16)
        step = ((mid + half - low.float()) / levels).to(torch.float16)
        safe = torch.where(step > 0, step.float(), torch.ones_like(step, dtype=torch.float32))
        codes = torch.round((xf - low.float()) / safe).clamp_(0, levels)
        error = ((codes * step.float() + low.float() - xf) ** 2).sum(dim, keepdim=True)
        if best is None:
            best = [codes, step, low, error]
            continue
        better = error < best[3]
        best = [
            torch.where(better, new, old)
            for new, old in zip((codes, step, low, error), best, strict=True)
        ]
    codes, step, low, _ = best
    return codes.to(torch.int64), step.squeeze(dim), low.squeeze(dim)


def quantize_k_per_channel(
    k: torch.Tensor, bits: int, group: int, *, clip: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k: [H, T, D] -> (codes [H, T, D], step [H, G, D], minimum [H, G, D]), ``G`` groups of
    ``group`` tokens (the last may be shorter) per channel."""
    heads, tokens, dim = k.shape
    groups = k_groups(tokens, group)
    pad = groups * group - tokens
    # the last token repeated: the last group's range is its own tokens'
    padded = torch.cat([k, k[:, -1:].expand(heads, pad, dim)], 1) if pad else k
    codes, step, low = quantize_groups(
        padded.reshape(heads, groups, group, dim), bits, dim=2, clip=clip
    )
    return codes.view(heads, groups * group, dim)[:, :tokens], step, low


def hadamard(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal Hadamard matrix of a power-of-two ``size`` (symmetric: its own
    inverse). V rows turned by it spread a channel's outlier over all channels, so one
    per-token range fits them better (QuaRot, arXiv 2404.00456). Built once per size and
    device (a third of a layer's decoding when it was built per call)."""
    return _hadamard(size, str(torch.device(device)))


@functools.lru_cache(maxsize=16)
def _hadamard(size: int, device: str) -> torch.Tensor:
    matrix = torch.ones(1, 1, device=device)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return matrix / math.sqrt(size)


def quantize_v_per_token(
    v: torch.Tensor, bits: int, group: int, *, clip: bool = True, rotate: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v: [H, T, D] -> (codes [H, T, D], step [H, T, D/group], minimum [H, T, D/group]);
    ``rotate``: of V times the Hadamard matrix (decode multiplies by it again)."""
    heads, tokens, dim = v.shape
    x = v.float() @ hadamard(dim, v.device) if rotate else v
    codes, step, low = quantize_groups(
        x.reshape(heads, tokens, dim // group, group), bits, dim=3, clip=clip
    )
    return codes.view(heads, tokens, dim), step, low


# --------------------------------------------------------------------------------------------
# Layer blocks


def rotates_v(codec: Codec, dim: int) -> bool:
    """Whether ``codec`` turns V of head dim ``dim`` (a power of two only)."""
    return codec.kind == KIVI and codec.v_rotate and dim & (dim - 1) == 0


def encode_layer(
    codec: Codec, bits: tuple[int, int], k: torch.Tensor, v: torch.Tensor
) -> list[torch.Tensor]:
    """The sections of one layer (K and V ``[H, T, D]`` on any device, already in the stored
    dtype for ``raw``), in :func:`section_sizes`' order, on that device."""
    if codec.kind == RAW:
        return [k, v]
    if codec.kind == INT8:
        kq, ks = quantize_per_token(k)
        vq, vs = quantize_per_token(v)
        return [kq, ks, vq, vs]
    if codec.kind == FP8:
        return [*_fp8_encode(k), *_fp8_encode(v)]
    heads, tokens, dim = k.shape
    k_bits, v_bits = bits
    k_codes, k_step, k_low = quantize_k_per_channel(k, k_bits, codec.k_group, clip=codec.clip)
    v_codes, v_step, v_low = quantize_v_per_token(
        v, v_bits, v_group_size(codec.v_group, dim), clip=codec.clip, rotate=rotates_v(codec, dim)
    )
    return [pack_bits(k_codes, k_bits), k_step, k_low, pack_bits(v_codes, v_bits), v_step, v_low]


def _fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = (xf.abs().amax(-1) / FP8_MAX).to(torch.float16)  # [H, T]
    if not bool(scale.isfinite().all()):
        raise OverflowError("KV values beyond float16's range: not quantized")
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = (xf / safe.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scale


def decode_sections(
    kind: int,
    bits: tuple[int, int],
    sections: list[torch.Tensor],
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    *,
    k_group: int,
    v_group: int,
    v_rotated: bool = False,
    out_dtype: torch.dtype | None = None,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[H, T, D]`` from a layer's sections (uint8 views, any device), in
    ``out_dtype`` (the KV cache's, so that placing them is a plain copy), else in the object's
    16-bit ``dtype``. ``raw`` sections in their own dtype come back as views, no copy.
    ``into``: K and V tensors of that shape and dtype (views of a larger one may be
    strided) that the quantized codec decodes into (``format.decode_layers``)."""
    heads, tokens, dim = shape
    out = out_dtype or dtype
    if into is not None and kind != KIVI:
        raise ValueError(f"only the quantized codec decodes into given tensors, not {kind}")
    if kind == RAW:
        k_raw, v_raw = sections
        return cast(k_raw.view(dtype).view(shape), out), cast(v_raw.view(dtype).view(shape), out)
    if kind == INT8:
        kq, ks, vq, vs = sections
        return (
            dequantize_per_token(
                kq.view(torch.int8).view(shape), ks.view(torch.float32).view(shape[:2]), out
            ),
            dequantize_per_token(
                vq.view(torch.int8).view(shape), vs.view(torch.float32).view(shape[:2]), out
            ),
        )
    if kind == FP8:
        kq, ks, vq, vs = sections
        return _fp8_decode(kq, ks, shape, out), _fp8_decode(vq, vs, shape, out)
    k_bits, v_bits = bits
    k_packed, k_step, k_low, v_packed, v_step, v_low = sections
    k_into, v_into = (None, None) if into is None else into
    k = _kivi_k(k_packed, k_step, k_low, k_bits, shape, k_group, out, k_into)
    v = _kivi_v(v_packed, v_step, v_low, v_bits, shape, v_group, v_rotated)
    return k, (v.to(out) if v_into is None else v_into.copy_(v))


def _kivi_k(
    packed: torch.Tensor,
    step: torch.Tensor,
    low: torch.Tensor,
    bits: int,
    shape: tuple[int, int, int],
    k_group: int,
    out: torch.dtype,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """K ``[H, T, D]`` in ``out`` (written into ``into`` when given): per channel, a minimum
    and step per group of tokens (read where they lie: ``[H * G * D]``, or a run's
    ``[n, ...]`` rows of a strided view)."""
    heads, tokens, dim = shape
    groups = k_groups(tokens, k_group)
    lead = step.shape[:-1]  # (): one layer; (n,): a run's layers, each its row
    step, low = (x.view(*lead, -1, groups, 1, dim) for x in _widened_pair(step, low))
    k_codes = unpack_bits(packed, bits, heads * tokens * dim).view(*lead, -1, tokens, dim)
    k = torch.empty(shape, dtype=out, device=packed.device) if into is None else into
    dest = k.view(*lead, -1, tokens, dim)
    # whole groups through a view that broadcasts each group's step (no per-token gather),
    # the last partial group on its own; each multiply-add widens the integer codes and
    # rounds into ``out`` inside its one operator
    whole, cut = tokens // k_group, tokens // k_group * k_group
    if whole:
        grouped = (*lead, -1, whole, k_group, dim)
        torch.addcmul(
            low[..., :whole, :, :],
            k_codes[..., :cut, :].view(grouped),
            step[..., :whole, :, :],
            out=dest[..., :cut, :].view(grouped),
        )
    if whole < groups:
        torch.addcmul(
            low[..., -1, :, :], k_codes[..., cut:, :], step[..., -1, :, :], out=dest[..., cut:, :]
        )
    return k


def _widened_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float16 sections (uint8, ``[..., n]``) in float32: one conversion when ``b``
    follows ``a`` in memory row by row (K's steps and minima do in a stored layer), else
    one each."""
    n = a.shape[-1]
    follows = (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.stride()[-1] == 1
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.storage_offset() == a.storage_offset() + n
    )
    if not follows:
        return a.view(torch.float16).float(), b.view(torch.float16).float()
    both = a.as_strided((*a.shape[:-1], 2 * n), a.stride()).view(torch.float16).float()
    return both[..., : n // 2], both[..., n // 2 :]


def _kivi_v(
    packed: torch.Tensor,
    step: torch.Tensor,
    low: torch.Tensor,
    bits: int,
    shape: tuple[int, int, int],
    v_group: int,
    rotated: bool,
) -> torch.Tensor:
    """V ``[H, T, D]`` in float32: per token, a minimum and step per group of channels."""
    heads, tokens, dim = shape
    groups = dim // v_group_size(v_group, dim)
    if rotated and groups == 1 and dim % 8 == 0:
        return _rotated_v(packed, step, low, bits, heads * tokens, dim).view(shape)
    codes = unpack_bits(packed, bits, heads * tokens * dim).view(heads, tokens, groups, -1)
    step = step.view(torch.float16).float().view(heads, tokens, groups, 1)
    low = low.view(torch.float16).float().view(heads, tokens, groups, 1)
    v = torch.addcmul(low, codes.float(), step).view(shape)
    return v @ hadamard(dim, v.device) if rotated else v


def _rotated_v(
    packed: torch.Tensor, step: torch.Tensor, low: torch.Tensor, bits: int, rows: int, dim: int
) -> torch.Tensor:
    """``(low + step * codes) @ H`` for V rows with one minimum and step each, as
    ``step * (codes @ H)`` plus ``low`` times H's column sums (``sqrt(dim)`` in the first
    column, 0 in the others): no float32 pass for the minimum. The float16 steps and minima
    are widened inside the operators that apply them. A whole 620-token layer (K at 4 bits,
    V at 3) decoded in 0.66 ms against 0.86 ms before (docs/codec.md)."""
    codes = unpack_bits(packed, bits, rows * dim).view(rows, dim).float()
    v = codes @ hadamard(dim, str(packed.device))
    # [rows], or a run's [n, rows / n]: applied where they lie, widened by the operators
    step, low = step.view(torch.float16), low.view(torch.float16)
    v.view(*step.shape, dim).mul_(step.unsqueeze(-1))
    v.view(*low.shape, dim)[..., 0].add_(low, alpha=math.sqrt(dim))
    return v


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``; float16 to bfloat16 on the CPU through float32, two vectorised
    passes that took 28 us for a 600-token layer's V against the direct conversion's 97."""
    if x.dtype == dtype:
        return x
    if x.device.type == "cpu" and {x.dtype, dtype} == {torch.float16, torch.bfloat16}:
        return x.float().to(dtype)
    return x.to(dtype)


def _fp8_decode(
    codes: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int, int], dtype: torch.dtype
) -> torch.Tensor:
    values = codes.view(torch.float8_e4m3fn).view(shape).float()
    return (values * scale.view(torch.float16).view(shape[:2]).float().unsqueeze(-1)).to(dtype)


def decode_joined(
    kind: int,
    bits: tuple[int, int],
    sections: list[torch.Tensor],
    tokens: Sequence[int],
    heads: int,
    dim: int,
    dtype: torch.dtype,
    *,
    k_group: int,
    v_group: int,
    v_rotated: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[R, D]`` from the sections of several blocks stored alike but for their token
    counts, each section the blocks' back to back (``tokens``: each block's, in order; ``R``
    the sum of ``heads * tokens``), decoded by one set of operators: how a request's chunks
    are decoded together (``format.decode_chunk_runs``). Every row but K's depends on its own
    (head, token) only, so the rows of all blocks decode as one block of ``R`` rows of one
    token; K's per-channel minima and steps, one per group of ``k_group`` tokens of a head,
    are repeated to every token of their group (:func:`_kivi_k_rows`). Each value is the one
    :func:`decode_sections` gives for its own block."""
    rows = heads * sum(tokens)
    flat = (rows, 1, dim)
    if kind != KIVI:
        k, v = decode_sections(
            kind, bits, sections, flat, dtype, k_group=k_group, v_group=v_group, out_dtype=out_dtype
        )
        return k.view(rows, dim), v.view(rows, dim)
    k_bits, v_bits = bits
    k_packed, k_step, k_low, v_packed, v_step, v_low = sections
    groups = _k_group_rows(tokens, heads, k_group)
    k = _kivi_k_rows(k_packed, k_step, k_low, k_bits, groups, (rows, dim), out_dtype or dtype)
    v = _kivi_v(v_packed, v_step, v_low, v_bits, flat, v_group, v_rotated)
    return k, v.view(rows, dim).to(out_dtype or dtype)


def _k_group_rows(tokens: Sequence[int], heads: int, k_group: int) -> list[int]:
    """Tokens in each K group of the joined blocks, in stored order (block, head, group):
    ``k_group`` but for each head's last group, which has what is left."""
    counts: list[int] = []
    for n in tokens:
        whole, rest = divmod(n, k_group)
        counts += ([k_group] * whole + ([rest] if rest else [])) * heads
    return counts


def _kivi_k_rows(
    packed: torch.Tensor,
    step: torch.Tensor,
    low: torch.Tensor,
    bits: int,
    group_tokens: Sequence[int],
    shape: tuple[int, int],
    out: torch.dtype,
) -> torch.Tensor:
    """K ``[R, D]`` (token rows) in ``out`` from per-channel minima and steps ``[G, D]``, group
    ``g`` covering ``group_tokens[g]`` rows: each group's row of minima and steps repeated to
    its tokens by one index (the blocks' token counts differ, so no view broadcasts it), then
    the same multiply-add as :func:`_kivi_k`'s."""
    rows, dim = shape
    codes = unpack_bits(packed, bits, rows * dim).view(rows, dim)
    counts = torch.tensor(group_tokens, device=packed.device)
    index = torch.repeat_interleave(counts, output_size=rows)  # [R]: each row's group
    step = step.view(torch.float16).view(-1, dim).float().index_select(0, index)
    low = low.view(torch.float16).view(-1, dim).float().index_select(0, index)
    k = torch.empty(shape, dtype=out, device=packed.device)
    return torch.addcmul(low, codes, step, out=k)  # widening the codes, rounding into k
