"""One KV producer: what the ingest worker, the engine and the KDN worker store is the same
object for the same tokens, and batching chunks of different lengths changes no chunk's KV."""

from __future__ import annotations

import torch

from kvservice.model.producer import HeadKVCache, KVProducer
from kvservice.model.transformer import precompute_chunks, precompute_head
from kvservice.protocol.keys import ChunkKey


def test_chunks_batched_by_length_get_the_kv_each_gets_alone(tiny_llama) -> None:
    head = [5, 6, 7, 8]
    vocab = tiny_llama.config.vocab_size
    chunks = [[(9 + 7 * t) % vocab for t in range(n)] for n in (40, 12, 38)]
    producer = KVProducer(tiny_llama, head)
    batched = producer.compute(chunks)
    for ids, kv in zip(chunks, batched, strict=True):
        (alone,) = precompute_chunks(tiny_llama, head, [ids])
        assert kv.token_ids == ids
        torch.testing.assert_close(kv.k, alone.k, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(kv.v, alone.v, rtol=1e-4, atol=1e-5)


def test_the_key_names_the_model_the_head_and_the_scope(tiny_llama) -> None:
    producer = KVProducer(tiny_llama, [5, 6, 7, 8])
    key = producer.key([1, 2, 3], "u7")
    assert key == ChunkKey.for_tokens(tiny_llama.fingerprint, producer.head_hash, [1, 2, 3], "u7")
    assert producer.after([5, 6, 7, 8]) is producer
    other = producer.after([5, 6])
    assert other.head_hash != producer.head_hash and other.model is tiny_llama


def test_a_head_is_computed_once_and_kept_for_every_producer_on_the_model(tiny_llama) -> None:
    heads = HeadKVCache(tiny_llama)
    producer = KVProducer(tiny_llama, [5, 6, 7, 8], heads)
    first = producer.head_kv
    assert heads.get([5, 6, 7, 8]) is first  # the producer's head is the cache's entry
    torch.testing.assert_close(first.k, precompute_head(tiny_llama, [5, 6, 7, 8]).k)
    other = producer.after([5, 6])
    assert other.heads is heads  # another head on the same model: the same cache
    assert other.head_kv is heads.get((5, 6)) and other.head_kv.token_ids == [5, 6]
