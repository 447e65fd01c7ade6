"""Chunk KV stored after its document predecessor, as a bench measures it (offline KV
editing, docs/blend.md: measured on product-like retrieval, not built into the product).

A chunk's stored KV is computed after the prompt's storage context alone, so it has never
seen the passage before it. Where the chat retrieves consecutive chunks of one document and
puts them together in the document's order (``keep_neighbours_together``), the second of
the pair could read KV computed after the first (``precompute_after_previous``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvservice.chunk import ChunkKV, token_ids_sha256
from kvservice.model.transformer import Transformer, precompute_chunks


def keep_neighbours_together(positions: Sequence[tuple[object, int]]) -> list[int]:
    """An order for retrieved chunks, as indices into ``positions`` (each chunk's document
    and its index there, best first): best first, except that chunks that follow each other
    in one document go together, in the document's order, at the place of the best of them."""
    where = {position: rank for rank, position in enumerate(positions)}

    def run(rank: int) -> list[int]:
        document, index = positions[rank]
        members = [rank]
        while (document, index + len(members)) in where:
            members.append(where[(document, index + len(members))])
        return members

    runs = [
        run(rank) for rank, (doc, index) in enumerate(positions) if (doc, index - 1) not in where
    ]
    return [rank for members in sorted(runs, key=min) for rank in members]


def precompute_after_previous(
    model: Transformer,
    storage_kv: ChunkKV,
    previous: ChunkKV,
    marker_ids: Sequence[int],
    chunk_ids: Sequence[int],
) -> ChunkKV:
    """``chunk_ids``' KV computed after the storage context, ``previous`` and ``marker_ids``.
    ``previous`` is a chunk's plain stored KV (computed after ``storage_kv``'s tokens): K is
    stored before RoPE, so the two together are the exact KV of the storage context and the
    previous chunk, and only the marker and the chunk are computed."""
    if previous.head_hash != token_ids_sha256(storage_kv.token_ids):
        raise ValueError("the previous chunk's KV was not computed after the storage context")
    known = ChunkKV(
        [*storage_kv.token_ids, *previous.token_ids],
        torch.cat([storage_kv.k, previous.k.to(storage_kv.k)], dim=2),
        torch.cat([storage_kv.v, previous.v.to(storage_kv.v)], dim=2),
        storage_kv.model_fingerprint,
        storage_kv.head_hash,
    )
    marked = [*marker_ids, *chunk_ids]
    kv = precompute_chunks(model, known.token_ids, [marked], head_kv=known)[0]
    m = len(marker_ids)
    return ChunkKV(
        list(chunk_ids),
        kv.k[:, :, m:].contiguous(),
        kv.v[:, :, m:].contiguous(),
        kv.model_fingerprint,
        token_ids_sha256([*known.token_ids, *marker_ids]),
    )
