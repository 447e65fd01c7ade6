"""The neighbour-aware stored KV the fidelity bench measures (bench/neighbours.py)."""

from __future__ import annotations

import torch

from bench.neighbours import keep_neighbours_together, precompute_after_previous
from kvservice.chunk import token_ids_sha256
from kvservice.model.transformer import precompute_chunks, precompute_head


def test_consecutive_chunks_of_a_document_go_together_in_its_order():
    # best first: a3, b0, a2, c5, a4, b2
    positions = [("a", 3), ("b", 0), ("a", 2), ("c", 5), ("a", 4), ("b", 2)]
    order = keep_neighbours_together(positions)
    assert [positions[i] for i in order] == [
        ("a", 2),
        ("a", 3),
        ("a", 4),
        ("b", 0),
        ("c", 5),
        ("b", 2),
    ]
    assert sorted(order) == list(range(len(positions)))
    assert keep_neighbours_together([("x", 1), ("y", 1)]) == [0, 1]  # nothing to group


def test_kv_after_the_previous_chunk_is_the_kv_of_computing_them_together(tiny_llama):
    gen = torch.Generator().manual_seed(3)
    storage, previous, marker, chunk = (
        torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 9, 3, 11)
    )
    storage_kv = precompute_head(tiny_llama, storage)
    previous_kv = precompute_chunks(tiny_llama, storage, [previous], head_kv=storage_kv)[0]

    got = precompute_after_previous(tiny_llama, storage_kv, previous_kv, marker, chunk)
    context = storage + previous + marker
    want = precompute_chunks(tiny_llama, context, [chunk])[0]

    assert got.token_ids == chunk and got.head_hash == token_ids_sha256(context)
    torch.testing.assert_close(got.k, want.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.v, want.v, atol=1e-5, rtol=1e-5)
    plain = precompute_chunks(tiny_llama, storage, [chunk], head_kv=storage_kv)[0]
    assert (got.v - plain.v).abs().max() > 1e-3  # the previous chunk changed it
