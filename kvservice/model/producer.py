"""The one way stored KV is made: each chunk's KV computed after a fixed head, as blending
expects it (``kvservice.model.transformer.precompute_chunks``: K before RoPE, at the chunk's own
positions after the head). The ingest worker (worker/kv.py), the engine (a chunk
whose stored KV is missing, ``Engine.precompute``) and the knowledge delivery API's worker
(webapp/kdn/services.py) all go through ``KVProducer``, so an object one of them stores is
the object the others would have stored.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvservice.chunk import ChunkKV
from kvservice.model.transformer import Transformer, head_hash, precompute_chunks, precompute_head
from kvservice.protocol.keys import ChunkKey


class HeadKVCache:
    """Each prompt head's KV on one model, computed at its first use (a head may be long) and
    kept: the one cache of it, read by the producer (chunks are computed after a head), the
    native engine (a prompt starts with one) and the vLLM connector's blender. A model has
    a head or two (the prompt's, and the one chunks are stored after when ``KV_PREAMBLE``
    differs), so nothing is evicted."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._kv: dict[tuple[int, ...], ChunkKV] = {}
        self._lock = threading.Lock()

    def get(self, head_ids: Sequence[int]) -> ChunkKV:
        head = tuple(head_ids)
        with self._lock:  # held while computing: a second asker waits for the first's
            kv = self._kv.get(head)
            if kv is None:
                kv = self._kv[head] = precompute_head(self.model, list(head))
            return kv


class KVProducer:
    """Chunks' KV after ``head_ids`` on ``model``, and their store keys. The head's own KV
    comes from ``heads`` (its own cache unless one is given)."""

    def __init__(
        self, model: Transformer, head_ids: Sequence[int], heads: HeadKVCache | None = None
    ) -> None:
        self.model = model
        self.head_ids = list(head_ids)
        self.head_hash = head_hash(self.head_ids)
        self.fingerprint: str = model.fingerprint
        self.heads = heads if heads is not None else HeadKVCache(model)

    @property
    def head_kv(self) -> ChunkKV:
        return self.heads.get(self.head_ids)

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
        if list(head_ids) == self.head_ids:
            return self
        return KVProducer(self.model, head_ids, self.heads)


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
