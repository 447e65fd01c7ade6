"""The named chunk-KV codecs (``KV_CODEC``): what each stores, as data, without torch.

A codec is a :class:`Codec`: a kind (how values are coded) and, for the grouped integer kind,
the bit width of K and of V in each layer and the group sizes. The store encodes and decodes
with them (``kvservice.store.codec``, torch); the dashboard names them in an operator's words
from this table alone. The measurements that chose the default are beside :data:`CODECS`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

RAW = 0
INT8 = 1  # the value format version 1 wrote for its int8 per-token quantization
KIVI = 2
FP8 = 3
KIND_NAMES = {RAW: "raw", INT8: "int8", KIVI: "kivi", FP8: "fp8"}


@dataclass(frozen=True)
class Codec:
    """A named way of storing chunk KV.

    ``k_bits`` / ``v_bits`` (kivi only) give the bit widths by depth: ``((upto, bits), ...)``
    where a layer at relative depth ``layer / num_layers < upto`` takes ``bits`` (the first
    pair that matches)."""

    name: str
    kind: int
    k_bits: tuple[tuple[float, int], ...] = ()
    v_bits: tuple[tuple[float, int], ...] = ()
    k_group: int = 0
    v_group: int = 0
    v_rotate: bool = False  # V turned by a Hadamard matrix before quantizing (recorded)
    clip: bool = True  # each group's range chosen for the least error (encoder only)

    def layer_bits(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """(K bits, V bits) of each layer; (0, 0) for the kinds that have no bit widths."""
        if self.kind != KIVI:
            return tuple((0, 0) for _ in range(num_layers))
        return tuple(
            (_bits_at(self.k_bits, i / num_layers), _bits_at(self.v_bits, i / num_layers))
            for i in range(num_layers)
        )

    @property
    def quantized(self) -> bool:
        return self.kind != RAW


def _bits_at(schedule: Sequence[tuple[float, int]], depth: float) -> int:
    for upto, bits in schedule:
        if depth < upto:
            return bits
    return schedule[-1][1]


def kivi(
    name: str,
    k_bits,
    v_bits,
    *,
    k_group: int = 64,
    v_group: int = 64,
    v_rotate: bool = False,
    clip: bool = True,
) -> Codec:
    """A kivi codec; ``k_bits``/``v_bits`` an int (every layer) or a depth schedule."""

    def schedule(bits) -> tuple[tuple[float, int], ...]:
        return ((1.0, bits),) if isinstance(bits, int) else tuple(bits)

    return Codec(name, KIVI, schedule(k_bits), schedule(v_bits), k_group, v_group, v_rotate, clip)


FP16 = Codec("fp16", RAW)
# python -m bench.codec on tuning examples 0-9 (six passages, blend at 0.15), bytes per token
# of the bundled SmolLM2-135M's objects (fp16: 23,045) and mean tf_kl minus fp16's, blend /
# reuse: K4 V2 5,066 B +0.0116 / +0.0356; V turned +0.0078 / +0.0296; and clipped +0.0032 /
# +0.0283; K3 V2 turned 4,346 B +0.0207 / +0.0613; K4 (128-token groups) V3 turned 5,598 B
# +0.0039 / +0.0162, and clipped +0.0033 / -0.0025: kivi4k3v, the least bytes within +0.005
# of fp16 for both modes on tuning, but reuse +0.0069 on validation (20-39). Its ~160 bytes a
# token of headroom, spent where the error is (tuning 0-9, V at 4 bits in one fifth of the
# layers at a time, reuse): the first fifth -0.0067 (kivi4k3v -0.0024), the others -0.0018 to
# -0.0034, K at 5 bits in the first fifth +0.0016; the first eighth alone -0.0062 at 5,694 B.
# That one, kivi4k3v-v4early, is the default: tuning 0-19 blend +0.0007 / reuse -0.0031
# (kivi4k3v +0.0016 / +0.0006), validation 20-39 +0.0036 / +0.0034 at 5,699 B (kivi4k3v
# +0.0041 / +0.0069). Objects stored in kivi4k3v decode as they were written.
CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        FP16,
        Codec("int8", INT8),
        Codec("fp8", FP8),
        kivi("kivi4", 4, 4),
        kivi("kivi3", 3, 3),
        kivi("kivi2", 2, 2),
        kivi("kivi4k2v", 4, 2, v_rotate=True),
        kivi("kivi3k2v", 3, 2),
        kivi("kivi4k3v", 4, 3, k_group=128, v_rotate=True),
        kivi("kivi4k3v-v4early", 4, ((0.125, 4), (1.0, 3)), k_group=128, v_rotate=True),
    )
}
DEFAULT_CODEC = "kivi4k3v-v4early"


def codec_by_name(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown KV codec {name!r} (known: {', '.join(CODECS)})") from None


def configured_codec(codec: str | None, quantize: bool) -> str:
    """The codec new objects are written in: ``KV_CODEC``'s (``codec``), else ``int8`` where
    ``KV_QUANTIZE`` is on (``quantize``), else :data:`DEFAULT_CODEC`; a ValueError naming
    ``KV_CODEC`` for a name no codec has."""
    name = codec if codec is not None else ("int8" if quantize else DEFAULT_CODEC)
    try:
        codec_by_name(name)
    except ValueError as err:
        raise ValueError(f"KV_CODEC: {err}") from err
    return name


# --------------------------------------------------------------------------------------------
# The bytes of one layer block of each kind (what a reader of a chunk object's header needs to
# find its layers; the values themselves are coded by ``kvservice.store.codec``, in torch)

SECTION_ALIGN = 16  # inside a layer block: enough for any element type to be viewed in place


def packed_size(count: int, bits: int) -> int:
    """Bytes of ``count`` codes of ``bits`` bits packed 8 values to ``bits`` bytes."""
    return math.ceil(count / 8) * bits


def k_groups(tokens: int, group: int) -> int:
    """Groups of ``group`` tokens a kivi K section has (the last one may be short)."""
    return math.ceil(tokens / group) if tokens else 0


def v_group_size(codec_v_group: int, dim: int) -> int:
    """Channels a kivi V group spans: the codec's, or the whole head where it does not divide."""
    return codec_v_group if codec_v_group and dim % codec_v_group == 0 else dim


def section_sizes(
    kind: int,
    bits: tuple[int, int],
    heads: int,
    tokens: int,
    dim: int,
    *,
    itemsize: int,
    k_group: int,
    v_group: int,
) -> list[int]:
    """Byte sizes of one layer block's sections, in order (``itemsize``: bytes of a raw value)."""
    values = heads * tokens * dim
    if kind == RAW:
        return [values * itemsize] * 2
    if kind == INT8:
        return [values, heads * tokens * 4] * 2
    if kind == FP8:
        return [values, heads * tokens * 2] * 2
    k_bits, v_bits = bits
    k_params = heads * k_groups(tokens, k_group) * dim * 2
    v_params = heads * tokens * (dim // v_group_size(v_group, dim)) * 2
    return [
        packed_size(values, k_bits),
        k_params,
        k_params,
        packed_size(values, v_bits),
        v_params,
        v_params,
    ]
