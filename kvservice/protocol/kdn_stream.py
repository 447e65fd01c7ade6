"""The knowledge delivery stream: the binary body of ``POST /kdn/v1/fetch``.

Several stored chunk objects (``kvservice.store.format``) sent as one stream in the order an
engine consumes them: every chunk's header first, then layer 0 of every chunk, layer 1 of
every chunk, ..., then every chunk's token ids. Each part is the stored object's own bytes,
so the store's codec travels as it is (a default-codec layer is about a quarter of fp16's)
and the client checks every layer against the crc32 its header gives.

```
preamble       16 bytes: magic "RBKD", version (u16, 1), reserved (u16), chunks N (u32),
               layers L (u32); little-endian
headers        for each chunk j, in the request's order: its object's header, verbatim
               (header_len bytes, a multiple of 64: ``format.decode_header`` reads it)
layers         for i in 0..L-1, for j in 0..N-1: layer block i of chunk j
               (``header_j.layer_size(i)`` bytes, its codec's sections; crc32 in the header)
token ids      for each chunk j: 4 * num_tokens_j bytes, int32 little-endian (crc32 and
               sha256 in the header)
```

Every length follows from the preamble and the headers, so the body needs no framing and a
reader knows where it is at every byte; ``content_length`` gives the whole body's size
before the first layer is sent (the HTTP ``Content-Length``).

The server side (:class:`ObjectStreams`, here: bytes only, no torch, so the web app serves
it) reads each object with one streamed GET from S3, a layer at a time, and never holds more
than one layer of one chunk. The client side is ``kvservice.kdn.stream.StreamReader``, which
decodes the layers (``kvservice.kdn.client`` drives it over HTTP).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

from kvservice.protocol.errors import ChunkCorrupt, ChunkTruncated
from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.objects import (
    Header,
    ObjectHeader,
    Readable,
    header_length,
    parse_header,
    read_fully,
)

MAGIC = b"RBKD"
VERSION = 1
PREAMBLE = struct.Struct("<4sHHII")  # magic, version, reserved, chunks, layers
HEADER_START = 128  # a header is at least this long (its fixed part, 64-byte aligned)
OPEN_THREADS = 8  # objects opened at once: each open is a round trip to S3


class StreamMissing(LookupError):
    """A requested object is not in the store; ``index`` is its place in the request."""

    def __init__(self, index: int, key: ChunkKey) -> None:
        super().__init__(f"chunk {index} ({key}) is not stored")
        self.index, self.key = index, key


def content_length(headers: Sequence[ObjectHeader]) -> int:
    """Bytes of the whole stream of these objects."""
    return PREAMBLE.size + sum(h.header_len + h.layers_bytes + 4 * h.num_tokens for h in headers)


def read_exact(stream: Readable, nbytes: int, what: str) -> bytearray:
    buffer = bytearray(nbytes)
    got = read_fully(stream, memoryview(buffer))
    if got < nbytes:
        raise ChunkTruncated(f"{what}: the stream ended after {got} of {nbytes} bytes")
    return buffer


def read_header(
    stream: Readable, what: str, header_type: type[Header] = ObjectHeader
) -> tuple[bytes, Header]:
    """One object's header from the start of ``stream``: (its bytes, parsed and verified into
    ``header_type``: the client's ``format.ChunkHeader`` knows the torch dtype)."""
    start = read_exact(stream, HEADER_START, what)
    header_len = header_length(bytes(start))
    raw = bytes(start) + bytes(read_exact(stream, header_len - HEADER_START, what))
    return raw, parse_header(raw, header_type)


class ObjectStreams:
    """The server side: one streamed read per object (``tier.open_stream``), opened and its
    header read and checked by :meth:`open`, so that a missing object is known before the
    response starts; then :meth:`layers` yields the stream's parts in order. ``close`` ends
    every read (also when the client went away halfway)."""

    def __init__(self, tier, keys: Sequence[ChunkKey]) -> None:
        self.tier, self.keys = tier, list(keys)
        self.headers: list[ObjectHeader] = []
        self._raw_headers: list[bytes] = []
        self._streams: list[Readable] = []
        self._exits = ExitStack()

    def open(self) -> ObjectStreams:
        """Open every object's read and read its header, the objects at once (each open is a
        round trip to S3); raises :class:`StreamMissing` for the first object not stored,
        having closed what it opened."""
        workers = max(1, min(OPEN_THREADS, len(self.keys)))
        with ThreadPoolExecutor(workers, thread_name_prefix="kdn-open") as pool:
            opened = list(pool.map(self._open_one, self.keys))
        for result in opened:
            if not isinstance(result, BaseException):
                self._exits.push(result[0].__exit__)
        try:
            for index, result in enumerate(opened):
                if isinstance(result, BaseException):
                    raise result
                _, stream, raw, header = result
                if stream is None:
                    raise StreamMissing(index, self.keys[index])
                self._streams.append(stream)
                self._raw_headers.append(raw)
                self.headers.append(header)
            layers = {h.num_layers for h in self.headers}
            if len(layers) > 1:
                raise ChunkCorrupt(f"the objects have different layer counts: {sorted(layers)}")
        except BaseException:
            self.close()
            raise
        return self

    def _open_one(self, key: ChunkKey) -> tuple | BaseException:
        """(the read's context manager, the reader or None where missing, header bytes,
        header), or the error; a read whose header failed is closed."""
        manager = self.tier.open_stream(key, 0)
        try:
            stream = manager.__enter__()
        except BaseException as err:
            return err
        if stream is None:
            return manager, None, b"", None
        try:
            raw, header = read_header(stream, str(key))
            header.check_key(key)
        except BaseException as err:
            manager.__exit__(None, None, None)
            return err
        return manager, stream, raw, header

    @property
    def num_layers(self) -> int:
        return self.headers[0].num_layers if self.headers else 0

    @property
    def num_tokens(self) -> int:
        return sum(h.num_tokens for h in self.headers)

    @property
    def content_length(self) -> int:
        return content_length(self.headers)

    def preamble_and_headers(self) -> bytes:
        preamble = PREAMBLE.pack(MAGIC, VERSION, 0, len(self.headers), self.num_layers)
        return preamble + b"".join(self._raw_headers)

    def layer(self, index: int) -> list[bytearray]:
        """Layer ``index`` of every object, in the request's order (one read each)."""
        return [
            read_exact(stream, header.layer_size(index), f"{header.key} layer {index}")
            for stream, header in zip(self._streams, self.headers, strict=True)
        ]

    def token_sections(self) -> list[bytearray]:
        return [
            read_exact(stream, 4 * header.num_tokens, f"{header.key} token ids")
            for stream, header in zip(self._streams, self.headers, strict=True)
        ]

    def parts(self) -> Iterator[list[bytes | bytearray]]:
        """The stream after :meth:`open`, one list of parts per step: preamble and headers,
        each layer of every object, the token ids."""
        yield [self.preamble_and_headers()]
        for index in range(self.num_layers):
            yield self.layer(index)
        yield self.token_sections()

    def close(self) -> None:
        self._exits.close()
