"""A stored chunk object's header, read from its bytes without torch.

The object's layout is documented in ``kvservice.store.format``, which writes objects and
decodes their layers (torch). The header alone says where every layer lies and whose chunk it
is, so whoever moves objects as bytes (the web app's knowledge delivery stream) reads it
here; ``format.ChunkHeader`` is this header with the torch dtype its values decode to.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvservice.protocol import codecs
from kvservice.protocol.errors import ChunkCorrupt, ChunkTruncated, FingerprintMismatch
from kvservice.protocol.keys import ChunkKey

MAGIC = b"RBKV"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
ALIGN = 64
HEADER_PROBE_BYTES = 16 << 10

FLAG_V_ROTATED = 1  # version 2's flags byte: V stored turned by a Hadamard matrix
K_PRE_ROPE = 0  # the header's k_storage: the one kind written (the loader refuses others)

# the header's dtype code: what K and V decode to, and a raw value's bytes
DTYPE_NAMES = {1: "float32", 2: "float16", 3: "bfloat16"}
DTYPE_ITEMSIZES = {1: 4, 2: 2, 3: 2}

START = struct.Struct("<4sHHI")  # magic, version, reserved, header_len: every version
# version 1: magic, version, reserved, header_len, dtype, k_storage, quant, reserved, layers,
# kv heads, head dim, tokens, rope base position, tokens sha256, layer_bytes, tokens_offset,
# total_bytes, fingerprint length, head hash length
FIXED_V1 = struct.Struct("<4sHHIBBBBIIIIq32sQQQHH")
# version 2: as version 1 without layer_bytes (layers differ in size), a flags byte where
# version 1 had a reserved one, and the K and V group sizes at the end
FIXED = struct.Struct("<4sHHIBBBBIIIIq32sQQHHHH")


class Readable(Protocol):
    def readinto(self, buffer: memoryview) -> int | None: ...


def read_fully(stream: Readable, out: memoryview) -> int:
    """Fill ``out`` from ``stream``; fewer bytes only at the end of the stream."""
    got = 0
    while got < len(out):
        n = stream.readinto(out[got:])
        if not n:
            break
        got += n
    return got


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class LayerLayout:
    """Where one layer's sections lie in its block: (offset, nbytes) each, and the block's
    size (64-byte aligned)."""

    sections: tuple[tuple[int, int], ...]
    size: int


def layer_layout(
    version: int,
    kind: int,
    bits: tuple[int, int],
    heads: int,
    tokens: int,
    dim: int,
    *,
    itemsize: int,
    k_group: int,
    v_group: int,
) -> LayerLayout:
    sizes = codecs.section_sizes(
        kind, bits, heads, tokens, dim, itemsize=itemsize, k_group=k_group, v_group=v_group
    )
    inner = ALIGN if version == 1 else codecs.SECTION_ALIGN
    sections, offset = [], 0
    for size in sizes:
        sections.append((offset, size))
        offset = align(offset + size, inner)
    return LayerLayout(tuple(sections), align(offset))


@dataclass(frozen=True)
class ObjectHeader:
    version: int
    dtype_code: int  # what K and V decode to (DTYPE_NAMES)
    k_storage: int
    rope_base_position: int
    codec_kind: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    tokens_sha256: str
    model_fingerprint: str
    head_hash: str
    header_len: int
    k_group: int
    v_group: int
    v_rotated: bool
    layer_bits: tuple[tuple[int, int], ...]
    layer_sizes: tuple[int, ...]
    tokens_offset: int
    total_bytes: int
    layer_crc32: tuple[int, ...]
    tokens_crc32: int

    @property
    def key(self) -> ChunkKey:
        return ChunkKey(self.model_fingerprint, self.head_hash, self.tokens_sha256)

    @property
    def quantized(self) -> bool:
        return self.codec_kind != codecs.RAW

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype_code]

    @property
    def layers_bytes(self) -> int:
        """Bytes of every layer block together (what a load moves)."""
        return sum(self.layer_sizes)

    def layer_offset(self, index: int) -> int:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} of {self.num_layers}")
        return self.header_len + sum(self.layer_sizes[:index])

    def layer_size(self, index: int) -> int:
        return self.layer_sizes[index]

    def layout(self, index: int) -> LayerLayout:
        return layer_layout(
            self.version,
            self.codec_kind,
            self.layer_bits[index],
            self.num_kv_heads,
            self.num_tokens,
            self.head_dim,
            itemsize=DTYPE_ITEMSIZES[self.dtype_code],
            k_group=self.k_group,
            v_group=self.v_group,
        )

    def check_key(self, key: ChunkKey) -> None:
        """Raise :class:`FingerprintMismatch` unless this object is the one ``key`` names."""
        if self.model_fingerprint != key.model_fingerprint:
            raise FingerprintMismatch(
                f"object {key} was written by model {self.model_fingerprint!r}, "
                f"expected {key.model_fingerprint!r}"
            )
        if self.head_hash != key.head_hash:
            raise FingerprintMismatch(f"object {key} has prompt head {self.head_hash!r}")
        if self.tokens_sha256 != key.tokens_sha256:
            raise FingerprintMismatch(f"object {key} holds tokens {self.tokens_sha256}")


def header_length(data: bytes) -> int:
    """``header_len`` from the first bytes of an object (at least the fixed part)."""
    if len(data) < FIXED_V1.size:
        raise ChunkTruncated(f"object is {len(data)} bytes, shorter than the fixed header")
    if data[:4] != MAGIC:
        raise ChunkCorrupt(f"bad magic {data[:4]!r}: not a chunk object")
    return START.unpack_from(data)[3]


Header = TypeVar("Header", bound="ObjectHeader")


def parse_header(data: bytes, header_type: type[Header] = ObjectHeader) -> Header:
    """Parse and verify the header at the start of ``data`` (which may hold more bytes) into
    ``header_type`` (``format.ChunkHeader`` adds the torch dtype)."""
    header_len = header_length(data)
    data = bytes(data[:header_len])
    if len(data) < header_len:
        raise ChunkTruncated(f"object is {len(data)} bytes, header says {header_len}")
    version = START.unpack_from(data)[1]
    if version not in READABLE_VERSIONS:
        raise ChunkCorrupt(
            f"chunk format version {version}; this reader knows "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    if version == 1:
        (
            _,
            _,
            _,
            _,
            dtype_code,
            k_storage,
            kind,
            _,
            num_layers,
            heads,
            dim,
            tokens,
            rope_base,
            tokens_sha,
            layer_bytes,
            tokens_offset,
            total_bytes,
            fp_len,
            head_len,
        ) = FIXED_V1.unpack_from(data)
        k_group = v_group = flags = 0
        at = FIXED_V1.size
    else:
        (
            _,
            _,
            _,
            _,
            dtype_code,
            k_storage,
            kind,
            flags,
            num_layers,
            heads,
            dim,
            tokens,
            rope_base,
            tokens_sha,
            tokens_offset,
            total_bytes,
            fp_len,
            head_len,
            k_group,
            v_group,
        ) = FIXED.unpack_from(data)
        at = FIXED.size
    fingerprint = data[at : at + fp_len].decode(errors="replace")
    head_hash = data[at + fp_len : at + fp_len + head_len].decode(errors="replace")
    at += fp_len + head_len
    bits_len = 2 * num_layers if version >= 2 else 0
    if at + bits_len + 4 * num_layers + 8 > header_len:
        raise ChunkCorrupt("header too short for its checksum table")
    flat_bits = data[at : at + bits_len]
    layer_bits = (
        tuple(zip(flat_bits[0::2], flat_bits[1::2], strict=True))
        if bits_len
        else (((0, 0),) * num_layers)
    )
    at += bits_len
    layer_crcs = struct.unpack_from(f"<{num_layers}I", data, at)
    at += 4 * num_layers
    tokens_crc, header_crc = struct.unpack_from("<II", data, at)
    if zlib.crc32(data[: at + 4]) != header_crc:
        raise ChunkCorrupt("header checksum mismatch")
    known = (codecs.RAW, codecs.INT8) if version == 1 else tuple(codecs.KIND_NAMES)
    if dtype_code not in DTYPE_NAMES or kind not in known:
        raise ChunkCorrupt(f"unknown dtype code {dtype_code} or codec kind {kind}")
    if kind == codecs.KIVI and (
        k_group < 1 or v_group < 1 or any(not (1 <= b <= 8) for pair in layer_bits for b in pair)
    ):
        raise ChunkCorrupt("kivi object with bad group sizes or bit widths")
    itemsize = DTYPE_ITEMSIZES[dtype_code]
    sizes = tuple(
        layer_layout(
            version,
            kind,
            bits,
            heads,
            tokens,
            dim,
            itemsize=itemsize,
            k_group=k_group,
            v_group=v_group,
        ).size
        for bits in layer_bits
    )
    if version == 1 and any(size != layer_bytes for size in sizes):
        raise ChunkCorrupt("header sizes are inconsistent")
    if tokens_offset != header_len + sum(sizes) or total_bytes != tokens_offset + 4 * tokens:
        raise ChunkCorrupt("header sizes are inconsistent")
    return header_type(
        version=version,
        dtype_code=dtype_code,
        k_storage=k_storage,
        rope_base_position=rope_base,
        codec_kind=kind,
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=dim,
        num_tokens=tokens,
        tokens_sha256=tokens_sha.hex(),
        model_fingerprint=fingerprint,
        head_hash=head_hash,
        header_len=header_len,
        k_group=k_group,
        v_group=v_group,
        v_rotated=bool(flags & FLAG_V_ROTATED),
        layer_bits=layer_bits,
        layer_sizes=sizes,
        tokens_offset=tokens_offset,
        total_bytes=total_bytes,
        layer_crc32=tuple(layer_crcs),
        tokens_crc32=tokens_crc,
    )
