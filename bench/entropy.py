"""Entropy coding on top of the stored kivi codec: bytes it would save, and what it costs to
decode (#31 item 1: "delta or entropy coding on top", CacheGen's idea).

    python -m bench.entropy --data ../shared/data/musique_dev.json --first 0 --examples 20 \\
        --codecs kivi4k3v-v4early,kivi:k=4@0.125/2:v=4@0.125/2:kg=128:vg=64:rot=1 \\
        --threads 1 --json entropy.json

Per example the six passages' KV is precomputed as ``python -m bench.codec`` does and every
chunk is encoded with each codec (``kvservice.store.format.encode_chunk``). Each object is then
split into its codes (one per value, per layer and K/V section) and every other byte (header,
float16 minima and steps, alignment padding, token ids), and measured two ways:

* bounds (no coder run): ``order0`` is ``bench.codec.entropy_bytes`` (one static code table
  per layer and section, its cost not counted); ``channel``, ``prev`` and ``delta`` are what
  an adaptive arithmetic coder (Krichevsky-Trofimov counts, so no table to store) would spend
  with the context of each code's (head, channel), of the previous token's code in the same
  channel, or on the difference to that code (mod 2**bits, restarted at each K group);
* real coders, each checked to give back the object byte for byte: ``zstd`` (the
  ``zstandard`` package) on the object as stored (``object``), and on its other bytes
  shuffled by byte of a float16 followed by its codes as stored (``packed``), one to a byte
  (``codes``) or as bit planes (``planes``);
  and ``ans``, constriction's rANS coder with one categorical model per layer and section
  learned from the object itself (its table of 16-bit frequencies is stored), on the codes
  or on their deltas.

Printed per codec and coder: bytes per token of the whole object, the ratio to the codec's
own bytes, and decoding speed on one thread: MB/s of the codec's object given back, and GB/s
of float16 KV that object holds (comparable with the codec's own decoding, measured in the
same run by ``bench.codec.decode_speed``; ``then`` is both stages one after the other).
Decoding is timed to what a loader would dequantize from (the object for ``zstd-object``, the
codes for the others), best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import constriction
import numpy as np
import torch
import zstandard

from bench.codec import (
    decode_speed,
    entropy_bytes,
    example_arguments,
    parse_codec,
    parse_examples,
    setup,
    write_json,
)
from bench.prefill import example_prompt
from kvservice.model.producer import KVProducer
from kvservice.protocol.codecs import KIVI, Codec
from kvservice.store import codec as codecs
from kvservice.store.format import ChunkHeader, decode_header, encode_chunk

K_SECTION, V_SECTION = 0, 3  # the code sections in a kivi layer block (codecs.section_sizes)
FREQ_MAX = 0xFFFF  # an ans table's frequencies are uint16
LENGTH = struct.Struct("<II")  # a payload's two lengths: stored other bytes, then their own


# --------------------------------------------------------------------------------------------
# An object as its codes and everything else


@dataclass(frozen=True)
class Split:
    """A kivi object as its codes (uint8 ``[H, T, D]``: layer 0's K, its V, layer 1's K, ..)
    and every other byte in order (``rest``: the header first, so it parses on its own)."""

    header: ChunkHeader
    codes: tuple[np.ndarray, ...]
    rest: bytes


@dataclass(frozen=True)
class Section:
    start: int  # offset in the object
    size: int  # packed bytes
    bits: int
    group: int  # tokens a delta runs over before it restarts (K: a group of tokens sharing
    # one minimum and step per channel; V, whose minima and steps are per token: the chunk)


def code_sections(header: ChunkHeader) -> list[Section]:
    """The packed code sections of a kivi object, in object order."""
    if header.codec_kind != KIVI:
        raise ValueError(f"{header.codec_name} objects have no integer codes to entropy code")
    sections, whole = [], max(header.num_tokens, 1)
    for index in range(header.num_layers):
        base, layout = header.layer_offset(index), header.layout(index)
        k_bits, v_bits = header.layer_bits[index]
        for section, bits, group in (
            (K_SECTION, k_bits, header.k_group),
            (V_SECTION, v_bits, whole),
        ):
            at, size = layout.sections[section]
            sections.append(Section(base + at, size, bits, group))
    return sections


def split_object(data: bytearray) -> Split:
    """A kivi object's codes and other bytes (``ValueError`` for the other kinds)."""
    header = decode_header(data)
    raw = torch.frombuffer(data, dtype=torch.uint8)
    shape = (header.num_kv_heads, header.num_tokens, header.head_dim)
    codes, rest, at = [], [], 0
    for section in code_sections(header):
        rest.append(bytes(data[at : section.start]))
        packed = raw[section.start : section.start + section.size]
        unpacked = codecs.unpack_bits(packed, section.bits, math.prod(shape))
        codes.append(unpacked.to(torch.uint8).numpy().reshape(shape))
        at = section.start + section.size
    rest.append(bytes(data[at:]))
    return Split(header, tuple(codes), b"".join(rest))


def join_packed(header: ChunkHeader, packed: Sequence[bytes], rest: bytes) -> bytearray:
    """The object byte for byte from its packed code sections and its other bytes."""
    out, at = bytearray(), 0
    for section, section_bytes in zip(code_sections(header), packed, strict=True):
        between = section.start - len(out)  # the other bytes before this section
        out += rest[at : at + between]
        at += between
        out += section_bytes
    return out + rest[at:]


def join_object(header: ChunkHeader, codes: Sequence[np.ndarray], rest: bytes) -> bytearray:
    """Inverse of :func:`split_object`."""
    packed = [
        codecs.pack_bits(torch.from_numpy(np.array(c, np.uint8)), section.bits).numpy().tobytes()
        for c, section in zip(codes, code_sections(header), strict=True)
    ]
    return join_packed(header, packed, rest)


def shuffle_bytes(data: bytes) -> bytes:
    """Even bytes then odd ones: a float16's exponent bytes side by side (the blosc shuffle)."""
    return data[0::2] + data[1::2]


def unshuffle_bytes(data: bytes) -> bytes:
    out, even = bytearray(len(data)), (len(data) + 1) // 2
    out[0::2], out[1::2] = data[:even], data[even:]
    return bytes(out)


# --------------------------------------------------------------------------------------------
# Bounds: bits a coder with a given context would spend on one section's codes


def delta_codes(codes: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Each code minus the previous token's in the same channel, mod 2**bits; the first token
    of each ``group`` (one minimum and step) kept as it is. codes: [H, T, D]."""
    wide = codes.astype(np.int32)
    delta = wide.copy()
    delta[:, 1:] -= wide[:, :-1]
    delta[:, ::group] = wide[:, ::group]
    return (delta & ((1 << bits) - 1)).astype(np.uint8)


def undelta_codes(delta: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Inverse of :func:`delta_codes`: a running sum within each group, mod 2**bits."""
    heads, tokens, dim = delta.shape
    groups = math.ceil(tokens / group)
    padded = np.zeros((heads, groups * group, dim), dtype=np.int32)
    padded[:, :tokens] = delta
    sums = np.cumsum(padded.reshape(heads, groups, group, dim), axis=2, dtype=np.int32)
    return (sums.reshape(heads, -1, dim)[:, :tokens] & ((1 << bits) - 1)).astype(np.uint8)


def adaptive_bits(counts: np.ndarray) -> float:
    """Bits an adaptive arithmetic coder spends on symbols with these counts (``[contexts,
    alphabet]``), each context starting from half a count per symbol (Krichevsky-Trofimov):
    achievable without storing a table, and within ~log2(n)/2 bits a symbol of the best
    static table per context."""
    counts = torch.from_numpy(counts).double()
    half = torch.full((), 0.5, dtype=torch.float64)
    alphabet = counts.shape[-1]
    per_context = (
        torch.lgamma(counts.sum(-1) + alphabet * half)
        - torch.lgamma(alphabet * half)
        - (torch.lgamma(counts + half) - torch.lgamma(half)).sum(-1)
    )
    return float(per_context.sum()) / math.log(2)


def context_counts(symbols: np.ndarray, contexts: np.ndarray, bits: int, num: int) -> np.ndarray:
    """``[num, 2**bits]`` counts of ``symbols`` under each context id (``< num``)."""
    alphabet = 1 << bits
    ids = contexts.astype(np.int64).ravel() * alphabet + symbols.astype(np.int64).ravel()
    return np.bincount(ids, minlength=num * alphabet).reshape(num, alphabet)


def section_bound_bits(codes: np.ndarray, section: Section, context: str) -> float:
    """Adaptive bits for one section's codes ``[H, T, D]`` under ``context``."""
    heads, tokens, dim = codes.shape
    alphabet = 1 << section.bits
    if context == "channel":  # each (head, channel) its own distribution
        ids = np.broadcast_to(np.arange(heads * dim).reshape(heads, 1, dim), codes.shape)
        return adaptive_bits(context_counts(codes, ids, section.bits, heads * dim))
    if context == "prev":  # conditioned on the previous token's code, same channel
        first = context_counts(codes[:, :1], np.zeros((heads, 1, dim)), section.bits, 1)
        later = context_counts(codes[:, 1:], codes[:, :-1], section.bits, alphabet)
        return adaptive_bits(first) + adaptive_bits(later)
    if context == "delta":
        delta = delta_codes(codes, section.bits, section.group)
        return adaptive_bits(context_counts(delta, np.zeros_like(delta), section.bits, 1))
    raise ValueError(f"unknown context {context!r}")


BOUNDS = ("channel", "prev", "delta")


def bound_bytes(data: bytearray, split: Split) -> dict[str, float]:
    """Each bound's bytes for the whole object (its other bytes counted as they are)."""
    out = {"order0": float(entropy_bytes(data))}
    sections = code_sections(split.header)
    for context in BOUNDS:
        bits = sum(
            section_bound_bits(codes, section, context)
            for codes, section in zip(split.codes, sections, strict=True)
        )
        out[context] = len(split.rest) + bits / 8
    return out


# --------------------------------------------------------------------------------------------
# Real coders: encode an object, decode it as far as a loader needs, give it back exactly


@dataclass(frozen=True)
class Coder:
    name: str
    encode: Callable[[bytearray], bytes]
    decode: Callable[[bytes], object]  # timed: up to what a loader would dequantize from
    restore: Callable[[bytes], bytearray]  # the object byte for byte (checked, not timed)


def zstd_object(level: int) -> Coder:
    def encode(data: bytearray) -> bytes:
        return zstandard.ZstdCompressor(level=level).compress(bytes(data))

    def decode(blob: bytes) -> bytes:
        return zstandard.ZstdDecompressor().decompress(blob)

    return Coder(f"zstd{level}-object", encode, decode, lambda blob: bytearray(decode(blob)))


def codes_to_planes(codes: np.ndarray, bits: int) -> bytes:
    """Bit ``j`` of every code, packed, for j = 0..bits-1 (``ceil(n / 8)`` bytes a plane)."""
    flat = codes.ravel()
    return b"".join(np.packbits((flat >> j) & 1).tobytes() for j in range(bits))


def planes_to_codes(planes: memoryview, bits: int, count: int) -> np.ndarray:
    size = (count + 7) // 8
    codes = np.zeros(count, dtype=np.uint8)
    for j in range(bits):
        plane = np.frombuffer(planes[j * size : (j + 1) * size], dtype=np.uint8)
        codes |= np.unpackbits(plane)[:count] << j
    return codes


def zstd_packed(level: int) -> Coder:
    """zstd over the shuffled other bytes then the code sections as stored (packed)."""

    def encode(data: bytearray) -> bytes:
        split = split_object(data)
        body = b"".join(
            bytes(data[s.start : s.start + s.size]) for s in code_sections(split.header)
        )
        payload = LENGTH.pack(len(split.rest), 0) + shuffle_bytes(split.rest) + body
        return zstandard.ZstdCompressor(level=level).compress(payload)

    def decode(blob: bytes) -> tuple[ChunkHeader, list[bytes], bytes]:
        payload = memoryview(zstandard.ZstdDecompressor().decompress(blob))
        rest_len = LENGTH.unpack_from(payload)[0]
        rest = unshuffle_bytes(bytes(payload[LENGTH.size : LENGTH.size + rest_len]))
        header = decode_header(rest)
        at, packed = LENGTH.size + rest_len, []
        for section in code_sections(header):
            packed.append(payload[at : at + section.size])
            at += section.size
        return header, packed, rest

    return Coder(f"zstd{level}-packed", encode, decode, lambda blob: join_packed(*decode(blob)))


def zstd_codes(level: int, layout: str) -> Coder:
    """zstd over the shuffled other bytes then every section's codes, one to a byte
    (``codes``) or as bit planes (``planes``)."""

    def encode(data: bytearray) -> bytes:
        split = split_object(data)
        bits = [section.bits for section in code_sections(split.header)]
        if layout == "codes":
            body = b"".join(codes.tobytes() for codes in split.codes)
        else:
            body = b"".join(codes_to_planes(c, b) for c, b in zip(split.codes, bits, strict=True))
        payload = LENGTH.pack(len(split.rest), 0) + shuffle_bytes(split.rest) + body
        return zstandard.ZstdCompressor(level=level).compress(payload)

    def decode(blob: bytes) -> tuple[ChunkHeader, list[np.ndarray], bytes]:
        payload = memoryview(zstandard.ZstdDecompressor().decompress(blob))
        rest_len = LENGTH.unpack_from(payload)[0]
        rest = unshuffle_bytes(bytes(payload[LENGTH.size : LENGTH.size + rest_len]))
        header = decode_header(rest)
        shape = (header.num_kv_heads, header.num_tokens, header.head_dim)
        count, at, codes = math.prod(shape), LENGTH.size + rest_len, []
        for section in code_sections(header):
            if layout == "codes":
                codes.append(np.frombuffer(payload[at : at + count], np.uint8).reshape(shape))
                at += count
            else:
                codes.append(planes_to_codes(payload[at:], section.bits, count).reshape(shape))
                at += section.bits * ((count + 7) // 8)
        return header, codes, rest

    return Coder(f"zstd{level}-{layout}", encode, decode, lambda blob: join_object(*decode(blob)))


def ans_table(symbols: np.ndarray, bits: int) -> np.ndarray:
    """uint16 frequencies of ``symbols`` scaled to at most FREQ_MAX, none that occurs at 0."""
    counts = np.bincount(symbols.ravel(), minlength=1 << bits).astype(np.int64)
    scaled = counts * FREQ_MAX // max(int(counts.max()), 1)
    return np.where(counts > 0, np.maximum(scaled, 1), 0).astype(np.uint16)


def ans_model(table: np.ndarray) -> constriction.stream.model.Categorical:
    """The same model from the same table in the encoder and the decoder."""
    probabilities = table.astype(np.float64)
    return constriction.stream.model.Categorical(probabilities / probabilities.sum(), perfect=False)


def ans_symbols(split: Split, delta: bool) -> list[np.ndarray]:
    sections = code_sections(split.header)
    if not delta:
        return list(split.codes)
    return [delta_codes(c, s.bits, s.group) for c, s in zip(split.codes, sections, strict=True)]


def ans_encode(split: Split, delta: bool, rest_level: int | None) -> bytes:
    """Other bytes (zstd'd after a shuffle if ``rest_level``), every section's table, then the
    rANS words of every section's codes under its own table."""
    symbols = ans_symbols(split, delta)
    sections = code_sections(split.header)
    tables = [ans_table(s, section.bits) for s, section in zip(symbols, sections, strict=True)]
    coder = constriction.stream.stack.AnsCoder()
    for section_symbols, table in zip(reversed(symbols), reversed(tables), strict=True):
        coder.encode_reverse(section_symbols.ravel().astype(np.int32), ans_model(table))
    rest = split.rest
    if rest_level is not None:
        rest = zstandard.ZstdCompressor(level=rest_level).compress(shuffle_bytes(rest))
    words = coder.get_compressed().astype("<u4").tobytes()
    return (
        LENGTH.pack(len(rest), len(split.rest))
        + rest
        + b"".join(t.astype("<u2").tobytes() for t in tables)
        + words
    )


def ans_decode(blob: bytes, delta: bool) -> tuple[ChunkHeader, list[np.ndarray], bytes]:
    stored_len, rest_len = LENGTH.unpack_from(blob)
    rest = blob[LENGTH.size : LENGTH.size + stored_len]
    if stored_len != rest_len:
        rest = unshuffle_bytes(zstandard.ZstdDecompressor().decompress(rest))
    header = decode_header(rest)
    shape = (header.num_kv_heads, header.num_tokens, header.head_dim)
    sections = code_sections(header)
    at = LENGTH.size + stored_len
    tables = []
    for section in sections:
        tables.append(np.frombuffer(blob, "<u2", 1 << section.bits, at))
        at += 2 << section.bits
    coder = constriction.stream.stack.AnsCoder(np.frombuffer(blob, "<u4", offset=at).copy())
    codes = []
    for section, table in zip(sections, tables, strict=True):
        symbols = coder.decode(ans_model(table), math.prod(shape)).reshape(shape)
        if delta:
            symbols = undelta_codes(symbols, section.bits, section.group)
        codes.append(symbols)
    return header, codes, rest


def ans_coder(delta: bool, rest_level: int | None = None) -> Coder:
    name = "ans" + ("-delta" if delta else "") + (f"+zstd{rest_level}" if rest_level else "")

    def restore(blob: bytes) -> bytearray:
        header, codes, rest = ans_decode(blob, delta)
        return join_object(header, [c.astype(np.uint8) for c in codes], rest)

    return Coder(
        name,
        lambda data: ans_encode(split_object(data), delta, rest_level),
        lambda blob: ans_decode(blob, delta),
        restore,
    )


CODERS = (
    zstd_object(3),
    zstd_object(19),
    zstd_packed(3),
    zstd_packed(19),
    zstd_codes(3, "codes"),
    zstd_codes(19, "codes"),
    zstd_codes(19, "planes"),
    ans_coder(False),
    ans_coder(True),
    ans_coder(False, 19),
)


# --------------------------------------------------------------------------------------------
# The bench


def decode_seconds(coder: Coder, blobs: Sequence[bytes], repeats: int) -> float:
    """Best of ``repeats`` of decoding every blob once."""
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        for blob in blobs:
            coder.decode(blob)
        best = min(best, time.perf_counter() - started)
    return best


def measure_codec(objects: Sequence[bytearray], repeats: int) -> dict:
    """One codec's objects: their bytes, bounds, and each coder's bytes and decode time."""
    headers = [decode_header(data) for data in objects]
    fp16 = sum(4 * h.num_layers * h.num_kv_heads * h.num_tokens * h.head_dim for h in headers)
    bounds = [bound_bytes(data, split_object(data)) for data in objects]
    entry: dict = {
        "bytes": sum(len(data) for data in objects),
        "code_bytes": sum(s.size for h in headers for s in code_sections(h)),
        "fp16_bytes": fp16,
        "codec_decode_gbps": decode_speed(objects, "cpu", repeats),
        "bounds": {name: sum(b[name] for b in bounds) for name in bounds[0]},
        "coders": {},
    }
    for coder in CODERS:
        blobs = [coder.encode(data) for data in objects]
        for data, blob in zip(objects, blobs, strict=True):
            if coder.restore(blob) != data:
                raise AssertionError(f"{coder.name} did not give the object back")
        entry["coders"][coder.name] = {
            "bytes": sum(len(blob) for blob in blobs),
            "decode_s": decode_seconds(coder, blobs, repeats),
        }
    return entry


def summarize(rows: list[dict], names: Sequence[str]) -> dict:
    """Per codec: bytes per token, and per bound and coder bytes per token, ratio to the
    codec's bytes and (coders) decode speed over all examples together."""
    tokens = sum(row["chunk_tokens"] for row in rows)
    summary: dict = {}
    for name in names:
        entries = [row["codecs"][name] for row in rows]
        own, fp16 = sum(e["bytes"] for e in entries), sum(e["fp16_bytes"] for e in entries)
        codec_gbps = statistics.median(e["codec_decode_gbps"] for e in entries)
        out: dict = {
            "bytes_per_token": own / tokens,
            "decode_gbps": codec_gbps,
            "code_bytes_per_token": sum(e["code_bytes"] for e in entries) / tokens,
            "coders": {},
        }
        for bound in entries[0]["bounds"]:
            total = sum(e["bounds"][bound] for e in entries)
            out["coders"][f"bound-{bound}"] = {
                "bytes_per_token": total / tokens,
                "ratio": total / own,
            }
        for coder in entries[0]["coders"]:
            total = sum(e["coders"][coder]["bytes"] for e in entries)
            seconds = sum(e["coders"][coder]["decode_s"] for e in entries)
            out["coders"][coder] = {
                "bytes_per_token": total / tokens,
                "ratio": total / own,
                "decode_mbps": own / seconds / 1e6,
                "decode_fp16_gbps": fp16 / seconds / 1e9,
                "then_codec_fp16_gbps": fp16 / (seconds + fp16 / (codec_gbps * 1e9)) / 1e9,
            }
        summary[name] = out
    return summary


def print_table(summary: dict, examples: int) -> None:
    print(
        f"\n{examples} examples; decoding on one thread: MB/s of the codec's object given "
        "back, GB/s of float16 KV it holds, and that then the codec's own decoding"
    )
    print(
        f"{'codec':48} {'coder':18} {'B/token':>8} {'ratio':>6} {'MB/s':>7} "
        f"{'fp16 GB/s':>9} {'then':>6}"
    )
    for name, s in summary.items():
        print(
            f"{name:48} {'(as stored)':18} {s['bytes_per_token']:8.0f} {1:6.3f} {'':7} "
            f"{s['decode_gbps']:9.2f}"
        )
        for coder, c in s["coders"].items():
            speed = (
                (
                    f"{c['decode_mbps']:7.0f} {c['decode_fp16_gbps']:9.2f} "
                    f"{c['then_codec_fp16_gbps']:6.2f}"
                )
                if "decode_mbps" in c
                else ""
            )
            print(f"{'':48} {coder:18} {c['bytes_per_token']:8.0f} {c['ratio']:6.3f} {speed}")
        other = s["bytes_per_token"] - s["code_bytes_per_token"]
        print(
            f"{'':48} codes {s['code_bytes_per_token']:.0f} B/token, other bytes {other:.0f} "
            "(minima and steps, padding, header, token ids)"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    example_arguments(parser)
    parser.add_argument("--codecs", default="kivi4k3v-v4early")
    parser.add_argument("--repeats", type=int, default=3, help="decode timings, best of")
    return parse_examples(parser, argv)


@torch.no_grad()
def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    codec_list: list[Codec] = [parse_codec(text) for text in args.codecs.split(",") if text]
    model, _tokenizer, fmt, examples = setup(args)
    names = [codec.name for codec in codec_list]
    rows: list[dict] = []
    for index, example in enumerate(examples):
        prompt = example_prompt(fmt, example, args.passages)
        chunks = KVProducer(model, fmt.storage_ids).compute(prompt.chunk_ids)
        row: dict = {"chunk_tokens": sum(chunk.num_tokens for chunk in chunks), "codecs": {}}
        for codec in codec_list:
            objects = [encode_chunk(c, codec=codec, narrow_to=torch.float16) for c in chunks]
            row["codecs"][codec.name] = measure_codec(objects, args.repeats)
        rows.append(row)
        print(f"[{index + 1}/{len(examples)}] {row['chunk_tokens']} chunk tokens", flush=True)
        write_json(args, summarize(rows, names), rows)
    summary = summarize(rows, names)
    print_table(summary, len(rows))
    return summary


if __name__ == "__main__":
    main()
