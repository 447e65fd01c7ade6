"""The chunk object: a self-describing binary layout in which one layer is one ranged read.

```
offset 0             header (header_len bytes, a multiple of 64)
  fixed part         magic "RBKV", format version, header_len, dtype, K storage (pre-RoPE,
                     or post-RoPE with its base position), codec kind, flags (V
                     rotated), layers, KV heads,
                     head dim, tokens, sha256 of the token ids, tokens_offset, total_bytes,
                     lengths of the two strings below, K group and V group (kivi)
  model fingerprint  utf-8
  head hash          utf-8
  layer_bits[L]      K bits and V bits of each layer (one byte each; 0 for non-kivi kinds)
  layer_crc32[L]     crc32 of each layer block
  tokens_crc32       crc32 of the token-id section
  header_crc32       crc32 of every header byte before it
header_len + sum(layer_size[:i])  layer i: its codec's sections (``codecs.section_sizes``),
                                  each 16-byte aligned; the block 64-byte aligned. raw: K then
                                  V [H_kv, T, D]; kivi: K codes, K steps, K minima, V codes,
                                  V steps, V minima
tokens_offset                     token ids, int32 little-endian (to recompute after a fault)
```

The codec kinds are in ``kvservice.protocol.codecs``; a layer's size follows from the header,
so a reader never trusts a length it cannot check. The header is read, without torch, by
``kvservice.protocol.objects`` (the web app streams objects as bytes); this module writes
objects and decodes their layers. All integers are little-endian. A reader
fetches the first ``HEADER_PROBE_BYTES`` (or ``header_len`` if longer), then any layer by
itself and checks it against its crc32.

Version 1 (every object written before the codecs; fp16 or int8 per token, every layer the
same size, ``layer_bytes`` in the fixed part, no bit table, sections 64-byte aligned) is
still read; only version 2 is written.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

from kvservice.chunk import ChunkKV, token_ids_sha256
from kvservice.protocol import objects
from kvservice.protocol.codecs import CODECS, FP8, FP16, KIVI, RAW, Codec
from kvservice.protocol.errors import ChunkCorrupt, ChunkTruncated
from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.objects import (
    FIXED,
    FIXED_V1,
    FLAG_V_ROTATED,
    FORMAT_VERSION,
    K_PRE_ROPE,
    MAGIC,
    ObjectHeader,
    align,
    layer_layout,
)
from kvservice.store import codec as codecs

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

Buffer = Union[bytes, bytearray, memoryview, torch.Tensor]  # noqa: UP007 (a runtime alias)


def as_uint8(buf: Buffer) -> torch.Tensor:
    """A 1-D uint8 tensor over ``buf`` without copying (tensors are returned as they are)."""
    if isinstance(buf, torch.Tensor):
        return buf
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    if isinstance(buf, bytes):  # immutable: torch wants a writable buffer to share memory
        buf = bytearray(buf)
    return torch.frombuffer(buf, dtype=torch.uint8)


def _crc(buf: Buffer) -> int:
    if isinstance(buf, torch.Tensor):
        buf = buf.cpu().numpy()  # a view on CPU, one copy from a device
    return zlib.crc32(buf)


@dataclass(frozen=True)
class ChunkHeader(ObjectHeader):
    """The object's header (``kvservice.protocol.objects``) with the torch dtype its K and V
    decode to."""

    @property
    def dtype(self) -> torch.dtype:
        return _CODE_DTYPES[self.dtype_code]

    @property
    def codec_name(self) -> str:
        """What the object is stored as (``codec.describe``: ``fp16``, ``kivi k4v2``..)."""
        return codecs.describe(self.codec_kind, self.layer_bits, self.dtype)


def _stored_codec(chunk: ChunkKV, codec: Codec, narrow_to: torch.dtype | None):
    """(chunk in the dtype it is stored or decoded in, that dtype, codec): float32 narrowed
    to ``narrow_to`` where every value fits; a chunk that cannot be quantized (values beyond
    float16) is stored raw."""
    dtype = chunk.k.dtype
    if narrow_to is not None and dtype == torch.float32 and codec.kind in (RAW, KIVI, FP8):
        narrow_k, narrow_v = chunk.k.to(narrow_to), chunk.v.to(narrow_to)
        if bool(narrow_k.isfinite().all()) and bool(narrow_v.isfinite().all()):
            if codec.kind == RAW:
                chunk = ChunkKV(
                    chunk.token_ids, narrow_k, narrow_v, chunk.model_fingerprint, chunk.head_hash
                )
            dtype = narrow_to
        elif codec.kind != RAW:
            codec = FP16
    return chunk, dtype, codec


def encode_chunk(
    chunk: ChunkKV,
    *,
    codec: Codec | None = None,
    quantize: bool = False,
    k_storage: int = K_PRE_ROPE,
    rope_base_position: int = 0,
    narrow_to: torch.dtype | None = None,
) -> bytearray:
    """Serialize a chunk into one contiguous object (see the module docstring) with ``codec``
    (default: raw, or int8 per token with ``quantize``). The values are quantized on the
    chunk's device (the same codes on CPU and CUDA up to float rounding at a step's edge).

    ``narrow_to`` (float16 or bfloat16) is the type a float32 chunk is stored in (raw) or
    decoded to (kivi, fp8); a chunk already in 16 bits, or one whose values do not fit the
    narrower type, is kept in its own (and stored raw)."""
    if chunk.k.dtype not in _DTYPE_CODES:
        raise ValueError(
            f"unsupported KV dtype {chunk.k.dtype}; store float32, float16 or bfloat16"
        )
    if narrow_to is not None and narrow_to not in (torch.float16, torch.bfloat16):
        raise ValueError(f"KV can be narrowed to float16 or bfloat16, not {narrow_to}")
    if codec is None:
        codec = CODECS["int8"] if quantize else FP16
    chunk, dtype, codec = _stored_codec(chunk, codec, narrow_to)
    num_layers, heads, tokens, dim = chunk.k.shape
    # quantized where the chunk is (a GPU encodes at its speed); sections cross to the host
    k, v = chunk.k.detach().contiguous(), chunk.v.detach().contiguous()
    layer_bits = codec.layer_bits(num_layers)
    try:
        blocks = [codecs.encode_layer(codec, layer_bits[i], k[i], v[i]) for i in range(num_layers)]
    except OverflowError:  # a value beyond float16: kept exactly instead
        return encode_chunk(
            chunk, codec=FP16, k_storage=k_storage, rope_base_position=rope_base_position
        )
    layouts = [
        layer_layout(
            FORMAT_VERSION,
            codec.kind,
            layer_bits[i],
            heads,
            tokens,
            dim,
            itemsize=dtype.itemsize,
            k_group=codec.k_group,
            v_group=codec.v_group,
        )
        for i in range(num_layers)
    ]
    return _assemble(
        chunk,
        codec,
        dtype,
        layer_bits,
        layouts,
        blocks,
        k_storage=k_storage,
        rope_base_position=rope_base_position,
    )


def _assemble(
    chunk: ChunkKV,
    codec: Codec,
    dtype: torch.dtype,
    layer_bits,
    layouts,
    blocks,
    *,
    k_storage: int,
    rope_base_position: int,
) -> bytearray:
    """The object's bytes: the header (fixed fields, fingerprint, head hash, per-layer bits
    and CRCs), the layers' encoded sections in order, then the token ids."""
    num_layers, heads, tokens, dim = chunk.k.shape
    fingerprint = chunk.model_fingerprint.encode()
    head_hash = chunk.head_hash.encode()
    if len(fingerprint) > 0xFFFF or len(head_hash) > 0xFFFF:
        raise ValueError("model fingerprint and head hash must be shorter than 64 KiB")
    bits_at = FIXED.size + len(fingerprint) + len(head_hash)
    header_len = align(bits_at + 2 * num_layers + 4 * num_layers + 8)
    tokens_offset = header_len + sum(layout.size for layout in layouts)
    total_bytes = tokens_offset + 4 * tokens

    out = bytearray(total_bytes)
    view = memoryview(out)
    whole = torch.frombuffer(out, dtype=torch.uint8)
    layer_crcs = []
    base = header_len
    for layout, parts in zip(layouts, blocks, strict=True):
        for (offset, size), part in zip(layout.sections, parts, strict=True):
            start = base + offset
            whole[start : start + size].view(part.dtype).view(part.shape).copy_(part)
        layer_crcs.append(zlib.crc32(view[base : base + layout.size]))
        base += layout.size
    token_bytes = b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk.token_ids)
    view[tokens_offset:total_bytes] = token_bytes
    fixed = FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        header_len,
        _DTYPE_CODES[dtype],
        k_storage,
        codec.kind,
        FLAG_V_ROTATED if codecs.rotates_v(codec, dim) else 0,
        num_layers,
        heads,
        dim,
        tokens,
        rope_base_position,
        bytes.fromhex(chunk.tokens_sha256),
        tokens_offset,
        total_bytes,
        len(fingerprint),
        len(head_hash),
        codec.k_group,
        codec.v_group,
    )
    header = fixed + fingerprint + head_hash
    header += bytes(b for pair in layer_bits for b in pair)
    header += struct.pack(f"<{num_layers}I", *layer_crcs) + struct.pack(
        "<I", zlib.crc32(token_bytes)
    )
    header += struct.pack("<I", zlib.crc32(header))
    view[: len(header)] = header
    return out


def _host_bytes(buf: Buffer, length: int) -> bytes:
    if isinstance(buf, torch.Tensor):
        return bytes(buf[:length].cpu().numpy())
    return bytes(buf[:length])


def header_length(buf: Buffer) -> int:
    """``header_len`` from the first bytes of an object (at least the fixed part)."""
    return objects.header_length(_host_bytes(buf, FIXED_V1.size))


def decode_header(buf: Buffer) -> ChunkHeader:
    """Parse and verify the header at the start of ``buf`` (which may hold more bytes)."""
    return objects.parse_header(_host_bytes(buf, header_length(buf)), ChunkHeader)


def decode_layer(
    header: ChunkHeader,
    index: int,
    block: Buffer,
    *,
    verify: bool = True,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[H_kv, T, D]`` of layer ``index`` from its block (``layer_size(index)``
    long, or longer: extra bytes are ignored), decoded on the block's device, in ``dtype``
    (default the object's). Raw layers in their own dtype are views of ``block``, no copy."""
    raw = layer_bytes(header, index, block, verify=verify)
    shape = (header.num_kv_heads, header.num_tokens, header.head_dim)
    sections = [raw[at : at + n] for at, n in header.layout(index).sections]
    return codecs.decode_sections(
        header.codec_kind,
        header.layer_bits[index],
        sections,
        shape,
        header.dtype,
        k_group=header.k_group,
        v_group=header.v_group,
        v_rotated=header.v_rotated,
        out_dtype=dtype,
    )


def layer_run(header: ChunkHeader, first: int, most: int) -> int:
    """How many layers from ``first`` (at most ``most``) :func:`decode_layers` can decode in
    one call: those stored alike (same bit widths, so the same layout), whose packed codes
    end on a byte run (a multiple of 8 values a layer), else 1."""
    values = header.num_kv_heads * header.num_tokens * header.head_dim
    if values % 8:
        return 1
    end = min(header.num_layers, first + max(1, most))
    count = 1
    while first + count < end and header.layer_bits[first + count] == header.layer_bits[first]:
        count += 1
    return count


def decode_layers(
    header: ChunkHeader,
    first: int,
    count: int,
    blocks: Buffer,
    *,
    dtype: torch.dtype | None = None,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[count, H_kv, T, D]`` of layers ``first .. first+count`` (a
    :func:`layer_run`) from their blocks, back to back in ``blocks``: decoded as one layer
    with ``count`` times the heads, so that decoding costs one call's kernel launches for the
    run instead of one per layer (on a GPU most of a layer's decoding time; not verified:
    for trusted bytes). ``into``: K and V tensors of that shape, in ``dtype`` (views of a
    request's joint buffers: ``joined.joint_slots``), that a quantized object's layers are
    decoded into and returned."""
    size = header.layer_size(first)
    raw = as_uint8(blocks)
    if raw.numel() < count * size:
        raise ChunkTruncated(f"layers {first}+{count}: got {raw.numel()} of {count * size} bytes")
    rows = raw[: count * size].view(count, size)
    # each section of every layer in the run, [count, section size]: a quantized codec reads
    # the layers' rows where they lie (its first operators widen them into new tensors);
    # the others' sections are gathered into one contiguous tensor each
    sections = [rows[:, at : at + n] for at, n in header.layout(first).sections]
    if header.codec_kind != KIVI:
        sections = [section.reshape(-1) for section in sections]
    heads, tokens, dim = header.num_kv_heads, header.num_tokens, header.head_dim
    shape = (count * heads, tokens, dim)
    k, v = codecs.decode_sections(
        header.codec_kind,
        header.layer_bits[first],
        sections,
        shape,
        header.dtype,
        k_group=header.k_group,
        v_group=header.v_group,
        v_rotated=header.v_rotated,
        out_dtype=dtype,
        into=None if into is None else (into[0].view(shape), into[1].view(shape)),
    )
    return k.view(count, heads, tokens, dim), v.view(count, heads, tokens, dim)


def joinable(a: ChunkHeader, b: ChunkHeader, layer: int) -> bool:
    """Whether layer ``layer`` of objects ``a`` and ``b`` decodes in one call
    (:func:`decode_chunk_runs`): the same codec, bit widths, groups and shape but for the
    token count."""

    def stored_as(h: ChunkHeader) -> tuple:
        return (
            h.codec_kind,
            h.layer_bits[layer],
            h.k_group,
            h.v_group,
            h.v_rotated,
            h.dtype,
            h.num_kv_heads,
            h.head_dim,
        )

    return stored_as(a) == stored_as(b)


def decode_chunk_runs(
    headers: Sequence[ChunkHeader],
    first: int,
    count: int,
    blocks: Sequence[Buffer],
    *,
    dtype: torch.dtype | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K and V ``[count, H_kv, T, D]`` of layers ``first .. first+count`` of several chunks
    (a :func:`layer_run` of each, :func:`joinable`; ``blocks``: each chunk's layer blocks back
    to back), decoded by one set of operators for all of them: a request's chunks decoded one
    by one dispatched ~19 operators a layer on the CPU (SmolLM2, 6 chunks, issue #47), about
    as many as the rest of a reuse pass. Each section of every layer block is gathered
    layer-major (layer, then chunk) into one tensor, decoded as one block
    (``codec.decode_joined``), and each chunk's layers are views of the result. Not verified:
    for trusted bytes. Each value is the one :func:`decode_layers` gives for its chunk."""
    header = headers[0]
    runs = []  # per chunk: its run's layer blocks [count, layer size]
    for chunk, block in zip(headers, blocks, strict=True):
        size, raw = chunk.layer_size(first), as_uint8(block)
        if raw.numel() < count * size:
            got = f"got {raw.numel()} of {count * size} bytes"
            raise ChunkTruncated(f"{chunk.key} layers {first}+{count}: {got}")
        runs.append(raw[: count * size].view(count, size))
    layouts = [chunk.layout(first).sections for chunk in headers]
    sections = []  # each: [count, the chunks' section sizes summed], flat
    for parts in zip(*layouts, strict=True):
        pieces = [rows[:, at : at + n] for rows, (at, n) in zip(runs, parts, strict=True)]
        sections.append(torch.cat(pieces, 1).view(-1))
    heads, dim = header.num_kv_heads, header.head_dim
    tokens = [chunk.num_tokens for chunk in headers]
    k, v = codecs.decode_joined(
        header.codec_kind,
        header.layer_bits[first],
        sections,
        tokens * count,
        heads,
        dim,
        header.dtype,
        k_group=header.k_group,
        v_group=header.v_group,
        v_rotated=header.v_rotated,
        out_dtype=dtype,
    )
    return _split_layers(k, v, heads, tokens, dim, count)


def _split_layers(
    k: torch.Tensor, v: torch.Tensor, heads: int, tokens: Sequence[int], dim: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each chunk's ``[count, H_kv, T, D]`` K and V: views of the joined rows (layer, chunk,
    head, token), no copy."""
    k, v = k.view(count, -1), v.view(count, -1)  # [count, every chunk's values of a layer]
    out, at = [], 0
    for n in tokens:
        size = heads * n * dim
        shape = (count, heads, n, dim)
        out.append((k[:, at : at + size].view(shape), v[:, at : at + size].view(shape)))
        at += size
    return out


def layer_bytes(
    header: ChunkHeader, index: int, block: Buffer, *, verify: bool = True
) -> torch.Tensor:
    """Layer ``index``'s stored bytes (uint8, ``layer_size(index)`` long) from its block,
    checked against the header's checksum when ``verify``; ``ChunkTruncated`` when short."""
    raw = as_uint8(block)
    size = header.layer_size(index)
    if raw.numel() < size:
        raise ChunkTruncated(f"layer {index}: got {raw.numel()} of {size} bytes")
    raw = raw[:size]
    if verify and _crc(raw) != header.layer_crc32[index]:
        raise ChunkCorrupt(f"layer {index} checksum mismatch in {header.key}")
    return raw


def decode_token_ids(header: ChunkHeader, section: Buffer, *, verify: bool = True) -> list[int]:
    """Token ids from the token section (``4 * num_tokens`` bytes at ``tokens_offset``)."""
    raw = as_uint8(section)
    size = 4 * header.num_tokens
    if raw.numel() < size:
        raise ChunkTruncated(f"token section: got {raw.numel()} of {size} bytes")
    raw = raw[:size]
    if verify and _crc(raw) != header.tokens_crc32:
        raise ChunkCorrupt(f"token section checksum mismatch in {header.key}")
    token_ids = raw.cpu().view(torch.int32).tolist() if size else []
    if verify and token_ids_sha256(token_ids) != header.tokens_sha256:
        raise ChunkCorrupt(f"token ids do not hash to {header.tokens_sha256}")
    return token_ids


def verify_object(buf: Buffer, key: ChunkKey | None = None) -> ChunkHeader:
    """Check a whole object (header, every layer's and the tokens' checksums, and that it is
    the object ``key`` names) without decoding tensors; returns its header."""
    raw = as_uint8(buf)
    header = decode_header(raw)
    if key is not None:
        header.check_key(key)
    if raw.numel() < header.total_bytes:
        raise ChunkTruncated(f"object {header.key} is {raw.numel()} of {header.total_bytes} bytes")
    for index in range(header.num_layers):
        start = header.layer_offset(index)
        if _crc(raw[start : start + header.layer_size(index)]) != header.layer_crc32[index]:
            raise ChunkCorrupt(f"layer {index} checksum mismatch in {header.key}")
    decode_token_ids(header, raw[header.tokens_offset :])
    return header


def decode_chunk(buf: Buffer, key: ChunkKey | None = None, *, verify: bool = True) -> ChunkKV:
    """A whole object back to a :class:`ChunkKV` (K and V stacked; dequantized if needed)."""
    raw = as_uint8(buf)
    header = decode_header(raw)
    if key is not None:
        header.check_key(key)
    if raw.numel() < header.total_bytes:
        raise ChunkTruncated(f"object {header.key} is {raw.numel()} of {header.total_bytes} bytes")
    token_ids = decode_token_ids(header, raw[header.tokens_offset :], verify=verify)
    layers = [
        decode_layer(header, i, raw[header.layer_offset(i) :], verify=verify)
        for i in range(header.num_layers)
    ]
    k = (
        torch.stack([k for k, _ in layers])
        if layers
        else torch.empty(
            0, header.num_kv_heads, header.num_tokens, header.head_dim, dtype=header.dtype
        )
    )
    v = torch.stack([v for _, v in layers]) if layers else torch.empty_like(k)
    return ChunkKV(token_ids, k, v, header.model_fingerprint, header.head_hash)


def encoded_size(
    num_layers: int,
    heads: int,
    tokens: int,
    dim: int,
    dtype: torch.dtype,
    *,
    quantize: bool = False,
    codec: Codec | None = None,
) -> int:
    """Bytes of the layer blocks (what a load moves), without header and tokens."""
    if codec is None:
        codec = CODECS["int8"] if quantize else FP16
    return sum(
        layer_layout(
            FORMAT_VERSION,
            codec.kind,
            bits,
            heads,
            tokens,
            dim,
            itemsize=dtype.itemsize,
            k_group=codec.k_group,
            v_group=codec.v_group,
        ).size
        for bits in codec.layer_bits(num_layers)
    )
