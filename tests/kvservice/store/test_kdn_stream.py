"""The knowledge delivery stream (kvservice.protocol.kdn_stream, kvservice.kdn.stream):
objects read from the real S3 gateway a layer at a time, written as one stream, and read back
to the stored tensors."""

from __future__ import annotations

import io
import struct

import pytest
import torch

from kvservice.kdn.stream import StreamReader
from kvservice.protocol.codecs import codec_by_name
from kvservice.protocol.errors import ChunkCorrupt, ChunkTruncated
from kvservice.protocol.kdn_stream import MAGIC, PREAMBLE, ObjectStreams, StreamMissing
from kvservice.protocol.keys import ChunkKey
from kvservice.store.format import decode_chunk
from tests.kvservice.store.conftest import L, make_chunk


def _stored(store, chunks, codec: str = "fp16") -> list[ChunkKey]:
    keys = []
    for chunk in chunks:
        key = ChunkKey.of(chunk, scope="u7")
        store.durable.put(key, store.encode(chunk, codec_by_name(codec)))
        keys.append(key)
    return keys


def _stream_bytes(streams: ObjectStreams) -> bytes:
    with_parts = [bytes(part) for step in streams.parts() for part in step]
    streams.close()
    return b"".join(with_parts)


@pytest.mark.parametrize("codec", ["fp16", "kivi4k3v"])
def test_a_stream_reads_back_to_the_stored_tensors(store, codec) -> None:
    chunks = [make_chunk(1, tokens=17), make_chunk(2, tokens=40)]
    keys = _stored(store, chunks, codec)
    streams = ObjectStreams(store.durable, keys).open()
    assert (streams.num_layers, streams.num_tokens) == (L, 57)
    body = _stream_bytes(streams)
    assert len(body) == streams.content_length

    reader = StreamReader(io.BytesIO(body))
    headers = reader.read_headers()
    assert [h.tokens_sha256 for h in headers] == [k.tokens_sha256 for k in keys]
    layers = [reader.read_layer(i) for i in range(reader.num_layers)]
    token_ids = reader.read_token_ids()
    for j, key in enumerate(keys):
        stored = decode_chunk(store.durable.get(key), key.unscoped())
        assert token_ids[j] == stored.token_ids
        for i in range(L):
            assert torch.equal(layers[i][j][0], stored.k[i])
            assert torch.equal(layers[i][j][1], stored.v[i])
    # an engine that asks for its cache's dtype gets it, the same values rounded once
    as_cache = StreamReader(io.BytesIO(body), torch.bfloat16)
    as_cache.read_headers()
    first = as_cache.read_layer(0)
    for j in range(len(keys)):
        assert first[j][0].dtype == first[j][1].dtype == torch.bfloat16
        assert torch.allclose(first[j][1].float(), layers[0][j][1].float(), rtol=2**-8, atol=1e-4)


def test_layers_come_in_the_order_an_engine_uses_them(store) -> None:
    """Preamble, both headers, then layer 0 of chunk 0 and of chunk 1, layer 1 ...: the bytes
    after the headers are each object's layer blocks, interleaved by layer."""
    chunks = [make_chunk(3), make_chunk(4, tokens=9)]
    keys = _stored(store, chunks)
    streams = ObjectStreams(store.durable, keys).open()
    headers = streams.headers
    body = _stream_bytes(streams)
    magic, version, _, count, layers = PREAMBLE.unpack_from(body)
    assert (magic, version, count, layers) == (MAGIC, 1, 2, L)
    objects = [bytes(store.durable.get(key)) for key in keys]
    at = PREAMBLE.size
    for header, obj in zip(headers, objects, strict=True):
        assert body[at : at + header.header_len] == obj[: header.header_len]
        at += header.header_len
    for i in range(L):
        for header, obj in zip(headers, objects, strict=True):
            start, size = header.layer_offset(i), header.layer_size(i)
            assert body[at : at + size] == obj[start : start + size]
            at += size
    for header, obj in zip(headers, objects, strict=True):
        assert body[at : at + 4 * header.num_tokens] == obj[header.tokens_offset :]
        at += 4 * header.num_tokens
    assert at == len(body)


def test_a_missing_object_is_named_before_anything_is_sent(store) -> None:
    keys = _stored(store, [make_chunk(5)])
    absent = ChunkKey.of(make_chunk(6), scope="u7")
    with pytest.raises(StreamMissing) as missing:
        ObjectStreams(store.durable, [keys[0], absent]).open()
    assert missing.value.index == 1


def test_a_damaged_or_cut_stream_is_refused(store) -> None:
    keys = _stored(store, [make_chunk(8)])
    body = bytearray(_stream_bytes(ObjectStreams(store.durable, keys).open()))
    reader = StreamReader(io.BytesIO(bytes(body[:-10])))
    reader.read_headers()
    for i in range(L):
        reader.read_layer(i)
    with pytest.raises(ChunkTruncated):
        reader.read_token_ids()
    header_len = struct.unpack_from("<I", body, PREAMBLE.size + 8)[0]
    body[PREAMBLE.size + header_len + 5] ^= 0xFF  # a byte of layer 0
    reader = StreamReader(io.BytesIO(bytes(body)))
    reader.read_headers()
    with pytest.raises(ChunkCorrupt, match="layer 0 checksum"):
        reader.read_layer(0)
