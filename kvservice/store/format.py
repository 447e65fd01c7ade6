"""The chunk object: a self-describing binary layout in which one layer is one ranged read.

```
offset 0             header (header_len bytes, a multiple of 64)
  fixed part         magic "RBKV", format version, header_len, dtype, K storage (pre-RoPE,
                     or post-RoPE with its base position), quantization, layers, KV heads,
                     head dim, tokens, sha256 of the token ids, layer_bytes, tokens_offset,
                     total_bytes, lengths of the two strings below
  model fingerprint  utf-8
  head hash          utf-8
  layer_crc32[L]     crc32 of each layer block
  tokens_crc32       crc32 of the token-id section
  header_crc32       crc32 of every header byte before it
header_len + i * layer_bytes      layer i: K then V, each [H_kv, T, D] (64-byte aligned);
                                  quantized: K int8, K scales f32 [H_kv, T], V int8, V scales
tokens_offset                     token ids, int32 little-endian (to recompute after a fault)
```

All integers are little-endian. A reader fetches the first ``HEADER_PROBE_BYTES`` (or
``header_len`` if longer), then any layer by itself and checks it against its crc32.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Union

import torch

from kvservice.chunk import ChunkKV, token_ids_sha256
from kvservice.store.errors import ChunkCorrupt, ChunkTruncated, FingerprintMismatch
from kvservice.store.keys import ChunkKey
from kvservice.store.quant import dequantize_per_token, quantize_per_token

MAGIC = b"RBKV"
FORMAT_VERSION = 1
ALIGN = 64
HEADER_PROBE_BYTES = 16 << 10

K_PRE_ROPE = 0
K_POST_ROPE = 1
QUANT_NONE = 0
QUANT_INT8_PER_TOKEN = 1

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

# magic, version, reserved, header_len, dtype, k_storage, quant, reserved, layers, kv heads,
# head dim, tokens, rope base position, tokens sha256, layer_bytes, tokens_offset,
# total_bytes, fingerprint length, head hash length
_FIXED = struct.Struct("<4sHHIBBBBIIIIq32sQQQHH")

Buffer = Union[bytes, bytearray, memoryview, torch.Tensor]  # noqa: UP007 (a runtime alias)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
class ChunkHeader:
    version: int
    dtype: torch.dtype
    k_storage: int
    rope_base_position: int
    quantization: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    tokens_sha256: str
    model_fingerprint: str
    head_hash: str
    header_len: int
    layer_bytes: int
    tokens_offset: int
    total_bytes: int
    layer_crc32: tuple[int, ...]
    tokens_crc32: int

    @property
    def key(self) -> ChunkKey:
        return ChunkKey(self.model_fingerprint, self.head_hash, self.tokens_sha256)

    @property
    def quantized(self) -> bool:
        return self.quantization != QUANT_NONE

    def layer_offset(self, index: int) -> int:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} of {self.num_layers}")
        return self.header_len + index * self.layer_bytes

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


def _sections(
    dtype: torch.dtype, quantized: bool, heads: int, tokens: int, dim: int
) -> list[tuple[int, int]]:
    """(offset, nbytes) of the sections of one layer block: [K, V] or [Kq, Ks, Vq, Vs]."""
    if quantized:
        sizes = [heads * tokens * dim, heads * tokens * 4] * 2
    else:
        sizes = [heads * tokens * dim * dtype.itemsize] * 2
    sections, offset = [], 0
    for size in sizes:
        sections.append((offset, size))
        offset = _align(offset + size)
    return sections


def _block_bytes(sections: list[tuple[int, int]]) -> int:
    offset, size = sections[-1]
    return _align(offset + size)


def encode_chunk(
    chunk: ChunkKV,
    *,
    quantize: bool = False,
    k_storage: int = K_PRE_ROPE,
    rope_base_position: int = 0,
    narrow_to: torch.dtype | None = None,
) -> bytearray:
    """Serialize a chunk into one contiguous object (see the module docstring).

    ``narrow_to`` (float16 or bfloat16) stores a float32 chunk at half the bytes; a chunk
    already in 16 bits, or one whose values do not fit the narrower type, is stored as is."""
    if chunk.k.dtype not in _DTYPE_CODES:
        raise ValueError(
            f"unsupported KV dtype {chunk.k.dtype}; store float32, float16 or bfloat16"
        )
    if narrow_to is not None and narrow_to not in (torch.float16, torch.bfloat16):
        raise ValueError(f"KV can be narrowed to float16 or bfloat16, not {narrow_to}")
    num_layers, heads, tokens, dim = chunk.k.shape
    dtype = chunk.k.dtype
    if narrow_to is not None and dtype == torch.float32 and not quantize:
        narrow_k, narrow_v = chunk.k.to(narrow_to), chunk.v.to(narrow_to)
        if bool(narrow_k.isfinite().all()) and bool(narrow_v.isfinite().all()):
            chunk = ChunkKV(chunk.token_ids, narrow_k, narrow_v, chunk.model_fingerprint,
                            chunk.head_hash)  # fmt: skip
            dtype = narrow_to
    sections = _sections(dtype, quantize, heads, tokens, dim)
    layer_bytes = _block_bytes(sections)
    fingerprint = chunk.model_fingerprint.encode()
    head_hash = chunk.head_hash.encode()
    if len(fingerprint) > 0xFFFF or len(head_hash) > 0xFFFF:
        raise ValueError("model fingerprint and head hash must be shorter than 64 KiB")
    crc_table_at = _FIXED.size + len(fingerprint) + len(head_hash)
    header_len = _align(crc_table_at + 4 * num_layers + 8)
    tokens_offset = header_len + num_layers * layer_bytes
    total_bytes = tokens_offset + 4 * tokens

    out = bytearray(total_bytes)
    view = memoryview(out)
    whole = torch.frombuffer(out, dtype=torch.uint8)
    k_cpu = chunk.k.detach().to("cpu").contiguous()
    v_cpu = chunk.v.detach().to("cpu").contiguous()
    layer_crcs = []
    for layer in range(num_layers):
        base = header_len + layer * layer_bytes
        if quantize:
            kq, ks = quantize_per_token(k_cpu[layer])
            vq, vs = quantize_per_token(v_cpu[layer])
            parts = [kq, ks, vq, vs]
        else:
            parts = [k_cpu[layer], v_cpu[layer]]
        for (offset, size), part in zip(sections, parts, strict=True):
            start = base + offset
            dest = whole[start : start + size].view(part.dtype).view(part.shape)
            dest.copy_(part)
        layer_crcs.append(zlib.crc32(view[base : base + layer_bytes]))
    token_bytes = b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk.token_ids)
    view[tokens_offset:total_bytes] = token_bytes
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, 0, header_len, _DTYPE_CODES[dtype], k_storage,
        QUANT_INT8_PER_TOKEN if quantize else QUANT_NONE, 0, num_layers, heads, dim, tokens,
        rope_base_position, bytes.fromhex(chunk.tokens_sha256), layer_bytes, tokens_offset,
        total_bytes, len(fingerprint), len(head_hash),
    )  # fmt: skip
    header = fixed + fingerprint + head_hash
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
    data = _host_bytes(buf, _FIXED.size)
    if len(data) < _FIXED.size:
        raise ChunkTruncated(f"object is {len(data)} bytes, shorter than the fixed header")
    if data[:4] != MAGIC:
        raise ChunkCorrupt(f"bad magic {data[:4]!r}: not a chunk object")
    return _FIXED.unpack(data)[3]


def decode_header(buf: Buffer) -> ChunkHeader:
    """Parse and verify the header at the start of ``buf`` (which may hold more bytes)."""
    header_len = header_length(buf)
    data = _host_bytes(buf, header_len)
    if len(data) < header_len:
        raise ChunkTruncated(f"object is {len(data)} bytes, header says {header_len}")
    (_, version, _, _, dtype_code, k_storage, quantization, _, num_layers, heads, dim, tokens,
     rope_base, tokens_sha, layer_bytes, tokens_offset, total_bytes, fp_len, head_len,
     ) = _FIXED.unpack_from(data)  # fmt: skip
    if version != FORMAT_VERSION:
        raise ChunkCorrupt(f"chunk format version {version}; this reader knows {FORMAT_VERSION}")
    at = _FIXED.size
    fingerprint = data[at : at + fp_len].decode(errors="replace")
    head_hash = data[at + fp_len : at + fp_len + head_len].decode(errors="replace")
    at += fp_len + head_len
    if at + 4 * num_layers + 8 > header_len:
        raise ChunkCorrupt("header too short for its checksum table")
    layer_crcs = struct.unpack_from(f"<{num_layers}I", data, at)
    at += 4 * num_layers
    tokens_crc, header_crc = struct.unpack_from("<II", data, at)
    if zlib.crc32(data[: at + 4]) != header_crc:
        raise ChunkCorrupt("header checksum mismatch")
    if dtype_code not in _CODE_DTYPES or quantization not in (QUANT_NONE, QUANT_INT8_PER_TOKEN):
        raise ChunkCorrupt(f"unknown dtype code {dtype_code} or quantization {quantization}")
    dtype = _CODE_DTYPES[dtype_code]
    expected_layer = _block_bytes(_sections(dtype, quantization != QUANT_NONE, heads, tokens, dim))
    if (layer_bytes != expected_layer or tokens_offset != header_len + num_layers * layer_bytes
            or total_bytes != tokens_offset + 4 * tokens):  # fmt: skip
        raise ChunkCorrupt("header sizes are inconsistent")
    return ChunkHeader(
        version=version, dtype=dtype, k_storage=k_storage, rope_base_position=rope_base,
        quantization=quantization, num_layers=num_layers, num_kv_heads=heads, head_dim=dim,
        num_tokens=tokens, tokens_sha256=tokens_sha.hex(), model_fingerprint=fingerprint,
        head_hash=head_hash, header_len=header_len, layer_bytes=layer_bytes,
        tokens_offset=tokens_offset, total_bytes=total_bytes, layer_crc32=tuple(layer_crcs),
        tokens_crc32=tokens_crc,
    )  # fmt: skip


def decode_layer(
    header: ChunkHeader, index: int, block: Buffer, *, verify: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[H_kv, T, D]`` of layer ``index`` from its block (``layer_bytes`` long, or
    longer: extra bytes are ignored). Unquantized layers are views of ``block``, no copy."""
    raw = as_uint8(block)
    if raw.numel() < header.layer_bytes:
        raise ChunkTruncated(f"layer {index}: got {raw.numel()} of {header.layer_bytes} bytes")
    raw = raw[: header.layer_bytes]
    if verify and _crc(raw) != header.layer_crc32[index]:
        raise ChunkCorrupt(f"layer {index} checksum mismatch in {header.key}")
    shape = (header.num_kv_heads, header.num_tokens, header.head_dim)
    sections = _sections(header.dtype, header.quantized, *shape)
    if not header.quantized:
        (k_at, k_size), (v_at, v_size) = sections
        k = raw[k_at : k_at + k_size].view(header.dtype).view(shape)
        v = raw[v_at : v_at + v_size].view(header.dtype).view(shape)
        return k, v
    (kq_at, kq_size), (ks_at, ks_size), (vq_at, vq_size), (vs_at, vs_size) = sections
    kq = raw[kq_at : kq_at + kq_size].view(torch.int8).view(shape)
    ks = raw[ks_at : ks_at + ks_size].view(torch.float32).view(shape[:2])
    vq = raw[vq_at : vq_at + vq_size].view(torch.int8).view(shape)
    vs = raw[vs_at : vs_at + vs_size].view(torch.float32).view(shape[:2])
    return dequantize_per_token(kq, ks, header.dtype), dequantize_per_token(vq, vs, header.dtype)


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
        if _crc(raw[start : start + header.layer_bytes]) != header.layer_crc32[index]:
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
    num_layers: int, heads: int, tokens: int, dim: int, dtype: torch.dtype, *, quantize: bool
) -> int:
    """Bytes of the layer blocks (what a load moves), without header and tokens."""
    return num_layers * _block_bytes(_sections(dtype, quantize, heads, tokens, dim))
