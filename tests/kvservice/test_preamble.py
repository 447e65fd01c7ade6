"""Chunk KV computed after the retrieval preamble (``KV_PREAMBLE``, ``storage_ids``)."""

from __future__ import annotations

import pytest
import torch

from kvservice.blend.prefill import blend_prefill
from kvservice.model.transformer import head_hash, precompute_chunks, precompute_head
from kvservice.protocol.prompt import PromptFormat, preamble_from_env, preamble_passages
from kvservice.serve.engine import Engine

PASSAGES = ["Paris is the capital of France.", "The Eiffel Tower was completed in 1889."]


def test_without_a_preamble_chunks_are_keyed_by_the_head_as_before(smollm2_tokenizer):
    fmt = PromptFormat.for_tokenizer(smollm2_tokenizer, preamble=False)
    assert fmt.storage_ids == fmt.head_ids and fmt.storage_hash == fmt.head_hash


def test_the_preamble_is_laid_out_as_numbered_passages_before_the_chunks_place(
    smollm2_tokenizer,
):
    fmt = PromptFormat.for_tokenizer(smollm2_tokenizer, preamble=True)
    plain = PromptFormat.for_tokenizer(smollm2_tokenizer, preamble=False)
    assert fmt.head_ids == plain.head_ids  # the prompt itself does not change
    assert fmt.storage_ids[: len(fmt.head_ids)] == fmt.head_ids
    assert fmt.storage_hash != fmt.head_hash
    text = smollm2_tokenizer.decode(fmt.storage_ids[len(fmt.head_ids) :])
    first, second = preamble_passages()
    assert text.startswith("[1]\n" + first[:40]) and f"\n\n[2]\n{second[:40]}" in text
    assert text.endswith("\n\n[3]\n")  # a stored chunk is computed where passage 3 would be


def test_kv_preamble_is_read_from_the_environment():
    assert preamble_from_env({}) is False  # off by default
    assert preamble_from_env({"KV_PREAMBLE": " On "}) is True
    assert preamble_from_env({"KV_PREAMBLE": "off"}) is False
    with pytest.raises(ValueError, match="KV_PREAMBLE must be 'on' or 'off', not 'yes'"):
        preamble_from_env({"KV_PREAMBLE": "yes"})


def test_precomputing_after_a_given_context_kv_equals_computing_it(tiny_llama):
    gen = torch.Generator().manual_seed(3)
    context = torch.randint(0, 128, (40,), generator=gen).tolist()
    chunks = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 13)]
    fresh = precompute_chunks(tiny_llama, context, chunks)
    given = precompute_chunks(
        tiny_llama, context, chunks, head_kv=precompute_head(tiny_llama, context)
    )
    for a, b in zip(fresh, given, strict=True):
        torch.testing.assert_close(a.k, b.k, atol=0, rtol=0)
        assert a.head_hash == b.head_hash == head_hash(context)
    with pytest.raises(ValueError, match="not the KV of head_ids"):
        precompute_chunks(
            tiny_llama, context[:-1], chunks, head_kv=precompute_head(tiny_llama, context)
        )


def test_chunks_stored_after_the_preamble_are_all_candidates_and_blend_at_one_is_full(tiny_llama):
    """The first chunk is no longer exact (it was not computed right after the head): blend
    recomputes it too, so at ratio 1.0 it still equals full prefill."""
    gen = torch.Generator().manual_seed(5)
    head = torch.randint(0, 128, (6,), generator=gen).tolist()
    preamble = torch.randint(0, 128, (30,), generator=gen).tolist()
    chunks = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (11, 8, 14)]
    question = torch.randint(0, 128, (5,), generator=gen).tolist()
    stored = precompute_chunks(tiny_llama, head + preamble, chunks)
    full = blend_prefill(tiny_llama, head, stored, question, mode="full", chunk_ids=chunks)
    every = blend_prefill(
        tiny_llama, head, stored, question, mode="blend", recompute_ratio=1.0, chunk_ids=chunks
    )
    torch.testing.assert_close(every.logits, full.logits, atol=1e-4, rtol=1e-4)
    assert every.recompute_ratio_effective == 1.0  # the first chunk counted and recomputed
    reuse = blend_prefill(tiny_llama, head, stored, question, mode="reuse")
    assert not torch.allclose(reuse.logits, full.logits, atol=1e-3)


def test_the_engine_computes_and_keys_chunks_after_the_preamble(smollm2, smollm2_tokenizer):
    fmt = PromptFormat.for_tokenizer(smollm2_tokenizer, preamble=True)
    engine = Engine(smollm2, smollm2_tokenizer, fmt)
    try:
        chunk_ids = [fmt.chunk_ids(PASSAGES[0])]
        (chunk,) = engine.precompute(chunk_ids)
        assert chunk.head_hash == fmt.storage_hash
        # one cache of heads: the prompt's head and the one chunks are stored after
        assert engine.producer.head_kv.token_ids == fmt.storage_ids
        assert engine.head_kv.token_ids == fmt.head_ids
        assert engine.head_kv is engine.producer.heads.get(fmt.head_ids)
        (expected,) = precompute_chunks(smollm2, fmt.storage_ids, chunk_ids)
        torch.testing.assert_close(chunk.k, expected.k, atol=0, rtol=0)
    finally:
        engine.close()


def test_the_products_format_follows_kv_preamble(smollm2_tokenizer, monkeypatch):
    monkeypatch.setenv("KV_PREAMBLE", "on")
    on = PromptFormat.for_tokenizer(smollm2_tokenizer)
    assert on.storage_hash != on.head_hash
    monkeypatch.delenv("KV_PREAMBLE", raising=False)
    off = PromptFormat.for_tokenizer(smollm2_tokenizer)
    assert off.storage_hash == off.head_hash == on.head_hash
