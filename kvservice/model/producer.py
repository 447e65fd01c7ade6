"""The one way stored KV is made: each chunk's KV computed after a fixed head, as blending
expects it (``kvservice.model.transformer.precompute_chunks``: K before RoPE, at the chunk's own
positions after the head). The ingest worker (webapp/documents/kv.py), the engine (a chunk
whose stored KV is missing, ``Engine.precompute``) and the knowledge delivery API's worker
(webapp/kdn/services.py) all go through ``KVProducer``, so an object one of them stores is
the object the others would have stored.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvservice.chunk import ChunkKV
from kvservice.model.transformer import Transformer, head_hash, precompute_chunks, precompute_head
from kvservice.store.keys import ChunkKey


class KVProducer:
    """Chunks' KV after ``head_ids`` on ``model``, and their store keys. The head's own KV
    is computed once, at the first chunks (it may be long), and kept."""

    def __init__(self, model: Transformer, head_ids: Sequence[int]) -> None:
        self.model = model
        self.head_ids = list(head_ids)
        self.head_hash = head_hash(self.head_ids)
        self.fingerprint: str = model.fingerprint
        self._head_kv: ChunkKV | None = None
        self._head_lock = threading.Lock()

    @property
    def head_kv(self) -> ChunkKV:
        with self._head_lock:
            if self._head_kv is None:
                self._head_kv = precompute_head(self.model, self.head_ids)
            return self._head_kv

    def key(self, token_ids: Sequence[int], scope: str = "") -> ChunkKey:
        return ChunkKey.for_tokens(self.fingerprint, self.head_hash, list(token_ids), scope)

    def compute(self, chunks_ids: Sequence[Sequence[int]]) -> list[ChunkKV]:
        """Each chunk's KV (``ChunkKV``) computed after the head, in order, in batches of
        similar lengths (``length_groups``)."""
        out: list[ChunkKV | None] = [None] * len(chunks_ids)
        for group in length_groups([len(ids) for ids in chunks_ids]):
            group_ids = [list(chunks_ids[i]) for i in group]
            kvs = precompute_chunks(self.model, self.head_ids, group_ids, head_kv=self.head_kv)
            for index, kv in zip(group, kvs, strict=True):
                out[index] = kv
        return out  # type: ignore[return-value]

    def after(self, head_ids: Sequence[int]) -> KVProducer:
        """The producer for another head on the same model (itself for its own head)."""
        return self if list(head_ids) == self.head_ids else KVProducer(self.model, head_ids)


def length_groups(lengths: Sequence[int], *, min_fill: float = 0.8) -> list[list[int]]:
    """Indices grouped so each group's chunks are within ``min_fill`` of its longest.

    One forward pads every chunk of a batch to the longest; a document's last chunk is
    often short, and padding it to 512 tokens would waste most of its compute."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    groups: list[list[int]] = []
    for index in order:
        if groups and lengths[index] >= min_fill * lengths[groups[-1][0]]:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups
