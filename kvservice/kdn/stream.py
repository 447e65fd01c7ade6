"""The knowledge delivery stream's client side: :class:`StreamReader` parses the body of
``POST /kdn/v1/fetch`` and decodes each layer into tensors. The stream's format and its
server side (bytes only) are in ``kvservice.protocol.kdn_stream``."""

from __future__ import annotations

import torch

from kvservice.protocol.errors import ChunkCorrupt
from kvservice.protocol.kdn_stream import MAGIC, PREAMBLE, VERSION, read_exact, read_header
from kvservice.protocol.objects import Readable
from kvservice.store.format import ChunkHeader, decode_layer, decode_token_ids


class StreamReader:
    """The client side: parses a stream from anything with ``readinto`` (an HTTP body).

    ``read_headers`` first (preamble and headers), then ``read_layer(i)`` for i = 0.. in
    order, each giving every chunk's K and V of that layer decoded (and checked against its
    crc32) into ``dtype`` (default each object's own; an engine's cache dtype saves it a
    conversion), then ``read_token_ids``."""

    def __init__(self, body: Readable, dtype: torch.dtype | None = None) -> None:
        self.body = body
        self.dtype = dtype
        self.headers: list[ChunkHeader] = []
        self.num_layers = 0
        self._next_layer = 0

    def read_headers(self) -> list[ChunkHeader]:
        magic, version, _, count, layers = PREAMBLE.unpack(
            bytes(read_exact(self.body, PREAMBLE.size, "the stream's preamble"))
        )
        if magic != MAGIC:
            raise ChunkCorrupt(f"not a knowledge delivery stream (magic {magic!r})")
        if version != VERSION:
            raise ChunkCorrupt(f"stream version {version}; this reader knows {VERSION}")
        self.headers = [read_header(self.body, f"header {j}", ChunkHeader)[1] for j in range(count)]
        if any(h.num_layers != layers for h in self.headers):
            raise ChunkCorrupt("a header's layer count differs from the preamble's")
        self.num_layers = layers
        return self.headers

    def read_layer(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if index != self._next_layer:
            raise ValueError(f"layers are read in order: {self._next_layer} next, not {index}")
        out = []
        for header in self.headers:
            block = read_exact(self.body, header.layer_size(index), f"{header.key} layer {index}")
            out.append(decode_layer(header, index, block, verify=True, dtype=self.dtype))
        self._next_layer += 1
        return out

    def read_token_ids(self) -> list[list[int]]:
        if self._next_layer != self.num_layers:
            raise ValueError("the token ids come after every layer")
        return [
            decode_token_ids(h, read_exact(self.body, 4 * h.num_tokens, f"{h.key} token ids"))
            for h in self.headers
        ]
