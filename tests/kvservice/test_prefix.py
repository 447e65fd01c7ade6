"""A follow-up reads the previous prompt's KV as it stands (kvservice.serve.prefix)."""

from __future__ import annotations

import pytest
import torch

from kvservice.blend.prefill import blend_prefill
from kvservice.model.transformer import precompute_chunks
from kvservice.serve.prefix import PrefixCache, PrefixKV, boundaries

ATOL = 1e-4


@pytest.fixture(scope="module")
def turn(tiny_llama):
    gen = torch.Generator().manual_seed(11)
    head = torch.randint(0, 128, (5,), generator=gen).tolist()
    chunks = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (12, 17, 9, 14)]
    first, second = (torch.randint(0, 128, (n,), generator=gen).tolist() for n in (6, 8))
    return head, chunks, first, second, precompute_chunks(tiny_llama, head, chunks)


def _prefix_after(model, head, chunks, question, kvs, upto, mode="full"):
    """The KV of ``head + chunks[:upto]`` as a prefill of that turn left it."""
    result = blend_prefill(model, head, kvs, question, mode=mode, recompute_ratio=0.5)
    length = len(head) + sum(map(len, chunks[:upto]))
    return PrefixKV.from_cache(result.cache, length, torch.float32)


def test_a_follow_up_over_an_exact_prefix_equals_full_prefill(tiny_llama, turn):
    """The previous turn's full-prefill KV of head and every chunk, read as is: the follow-up
    computes only its question and gets full prefill's logits (fp32 prefix: no rounding)."""
    head, chunks, first, second, kvs = turn
    prefix = _prefix_after(tiny_llama, head, chunks, first, kvs, upto=len(chunks))
    full = blend_prefill(tiny_llama, head, kvs, second, mode="full")
    for mode in ("reuse", "blend"):
        follow = blend_prefill(
            tiny_llama,
            head,
            [None] * len(chunks),
            second,
            mode=mode,
            chunk_ids=chunks,
            cached_prefix=prefix,
        )
        torch.testing.assert_close(follow.logits, full.logits, atol=ATOL, rtol=ATOL)
        assert follow.recomputed_per_layer[0] == len(second)  # the question alone
        assert follow.recompute_ratio_effective == 0.0


def test_a_partial_prefix_leaves_the_other_chunks_to_blend(tiny_llama, turn):
    """Two chunks from the prefix, two cached: at ratio 1 the cached ones are recomputed and
    the result is full prefill; at ratio 0 it is reuse of those two, and not full."""
    head, chunks, first, second, kvs = turn
    prefix = _prefix_after(tiny_llama, head, chunks, first, kvs, upto=2)
    sources = [None, None, *kvs[2:]]
    full = blend_prefill(tiny_llama, head, kvs, second, mode="full")
    whole = blend_prefill(
        tiny_llama,
        head,
        sources,
        second,
        mode="blend",
        recompute_ratio=1.0,
        chunk_ids=chunks,
        cached_prefix=prefix,
    )
    torch.testing.assert_close(whole.logits, full.logits, atol=ATOL, rtol=ATOL)
    reused = blend_prefill(
        tiny_llama, head, sources, second, mode="reuse", chunk_ids=chunks, cached_prefix=prefix
    )
    assert not torch.allclose(reused.logits, full.logits, atol=1e-3)
    assert reused.recomputed_per_layer[0] == len(second)


def test_a_prefix_must_end_at_a_segment_boundary(tiny_llama, turn):
    head, chunks, first, second, kvs = turn
    prefix = _prefix_after(tiny_llama, head, chunks, first, kvs, upto=2).truncated(len(head) + 3)
    with pytest.raises(ValueError, match="segment boundary"):
        blend_prefill(tiny_llama, head, kvs, second, mode="reuse", cached_prefix=prefix)
    with pytest.raises(ValueError, match="no cached prefix"):
        blend_prefill(tiny_llama, head, kvs, second, mode="full", cached_prefix=prefix)


def _kv(tokens: int) -> PrefixKV:
    k = torch.zeros(2, 1, tokens, 4, dtype=torch.float16)
    return PrefixKV(k, k.clone(), tokens)


def test_the_longest_stored_run_of_segments_is_found_and_scopes_keep_users_apart():
    cache = PrefixCache(capacity_bytes=1 << 20)
    segments = [[1, 2], [3], [4, 5, 6]]
    keys, lengths = boundaries([7, 8, 9], segments, ["", "alice", ""])
    assert lengths == [5, 6, 9]
    assert cache.match(keys, lengths) is None
    assert cache.put(keys, lengths, _kv(9))
    kv, covered = cache.match(keys, lengths)
    assert covered == 3 and kv.num_tokens == 9
    other_tail, other_lengths = boundaries([7, 8, 9], [[1, 2], [3], [4, 0]], ["", "alice", ""])
    kv, covered = cache.match(other_tail, other_lengths)  # shares the first two segments
    assert covered == 2 and kv.num_tokens == 6
    bob, _ = boundaries([7, 8, 9], segments, ["", "bob", ""])  # same text, bob's scope
    kv, covered = cache.match(bob, lengths)
    assert covered == 1 and kv.num_tokens == 5
    assert cache.stats()["hits"] == 3 and cache.stats()["misses"] == 1


def test_the_cache_keeps_to_its_bytes_least_recently_used_first_out():
    one = _kv(9).nbytes
    cache = PrefixCache(capacity_bytes=2 * one)
    prompts = [boundaries([1], [[i]], [""])[0] for i in range(3)]
    assert cache.put(prompts[0], [2], _kv(9)) and cache.put(prompts[1], [2], _kv(9))
    assert cache.match(prompts[0], [2]) is not None  # 0 is now the most recent
    assert cache.put(prompts[2], [2], _kv(9))
    assert cache.match(prompts[1], [2]) is None  # 1 went out
    assert cache.match(prompts[0], [2]) is not None and cache.used_bytes == 2 * one
    assert not PrefixCache(capacity_bytes=one - 1).put(prompts[0], [2], _kv(9))
