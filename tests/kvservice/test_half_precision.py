"""The engine in half precision: blend's identities and RoPE re-positioning hold in bfloat16
and float16 up to rounding, on CPU, and on CUDA where there is one (marked gpu).

Tolerances. A half-precision run cannot equal a float32 one: bfloat16 keeps 8 significant
bits (eps 2^-7), float16 11 (eps 2^-10), and every matrix product and elementwise step
rounds its result to them. So:

* Where two computations are the same math in another order (blend at ratio 1 and full
  prefill; a cached K rotated in place and the K rotated where it is computed), their
  difference is bounded by the rounding error itself, measured on the same prompt as the
  distance of the half-precision full prefill to the float32 one: ``ROUNDING_FACTOR`` times
  it (two results, each about that far from the float32 one and in no shared direction, are
  at most about twice that far apart; 3 leaves room for their independent roundings). Each such
  test also checks that the bound tells a real difference apart (reuse against full; a K
  at its old position), so a tolerance wide enough to hide a wrong result fails.
* For RoPE on its own, the bound is in units of the dtype: a rotation rounds each product
  and the sum once, so a K rotated two ways differs by at most ``ROPE_ULPS`` units in the last
  place of the largest |K| (``eps * max|K|``).
* Where the computation is the same operations in the same order (blend at ratio 0 and
  reuse), the result is equal bit for bit.

Measured on this prompt (CPU): blend at ratio 1 is 0.56x (bfloat16) and 0.76x (float16) the
rounding away from full, every mode at most 1.2x it from its float32 self, reuse 26x and 281x;
rotated K within 0.72 units in the last place, K at its old position 180 and 1,400 away.
"""

from __future__ import annotations

import pytest
import torch

from kvservice.blend.prefill import blend_prefill
from kvservice.model.transformer import (
    Transformer,
    apply_rope,
    precompute_chunks,
    precompute_head,
    rope_cos_sin,
)

HALF = [torch.bfloat16, torch.float16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ROUNDING_FACTOR = 3.0
ROPE_ULPS = 2.0


@pytest.fixture(scope="module")
def prompt():
    """Head, chunks and question; the second chunk is long, so the later chunks sit past
    position 256, where bfloat16 no longer holds every integer (angles must be computed from
    the integer positions in float32)."""
    gen = torch.Generator().manual_seed(19)
    head = torch.randint(0, 128, (5,), generator=gen).tolist()
    chunks = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (12, 300, 9, 14)]
    question = torch.randint(0, 128, (6,), generator=gen).tolist()
    return head, chunks, question


def _load(tiny_checkpoints, device: str, dtype: torch.dtype) -> Transformer:
    return Transformer.from_pretrained(tiny_checkpoints["llama"], device=device, dtype=dtype)


def _run(model, prompt, mode: str, **options):
    head, chunks, question = prompt
    kvs = precompute_chunks(model, head, chunks)
    head_kv = precompute_head(model, head)
    return blend_prefill(model, head, kvs, question, mode=mode, head_kv=head_kv, **options)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_is_kept_from_weights_to_cache_and_logits_are_float32(
    tiny_checkpoints, prompt, device, dtype
):
    model = _load(tiny_checkpoints, device, dtype)
    head, chunks, _ = prompt
    kvs = precompute_chunks(model, head, chunks)
    assert all(c.k.dtype == dtype and c.v.dtype == dtype for c in kvs)
    for mode in ("full", "reuse", "blend"):
        result = _run(model, prompt, mode, recompute_ratio=0.3)
        assert result.cache.k.dtype == dtype and result.cache.v.dtype == dtype
        assert result.cache.k.device.type == device and result.logits.device.type == device
        assert result.logits.dtype == torch.float32 and bool(result.logits.isfinite().all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
def test_blend_at_ratio_one_equals_full_up_to_rounding(tiny_checkpoints, prompt, device, dtype):
    full32 = _run(_load(tiny_checkpoints, device, torch.float32), prompt, "full")
    model = _load(tiny_checkpoints, device, dtype)
    full = _run(model, prompt, "full")
    blended = _run(model, prompt, "blend", recompute_ratio=1.0)
    reuse = _run(model, prompt, "reuse")
    rounding = _max_diff(full.logits, full32.logits)
    # the rounding is half precision's: more than float32's, within a few eps of the logits
    assert 0 < rounding < 8 * torch.finfo(dtype).eps * full32.logits.abs().max().item()
    bound = ROUNDING_FACTOR * rounding
    assert _max_diff(blended.logits, full.logits) <= bound
    assert _max_diff(reuse.logits, full.logits) > bound  # the bound tells reuse from full
    # ...and the whole KV cache, against the cache's own rounding
    n = full.num_tokens
    for name in ("k", "v"):
        half, ref = getattr(full.cache, name)[:, :, :, :n], getattr(full32.cache, name)[:, :, :, :n]
        cache_bound = ROUNDING_FACTOR * _max_diff(half, ref)
        assert _max_diff(getattr(blended.cache, name)[:, :, :, :n], half) <= cache_bound


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
def test_blend_at_ratio_zero_is_reuse_bit_for_bit(tiny_checkpoints, prompt, device, dtype):
    model = _load(tiny_checkpoints, device, dtype)
    reuse = _run(model, prompt, "reuse")
    blended = _run(model, prompt, "blend", recompute_ratio=0.0)
    torch.testing.assert_close(blended.logits, reuse.logits, atol=0, rtol=0)
    n = reuse.num_tokens
    torch.testing.assert_close(
        blended.cache.k[..., :n, :], reuse.cache.k[..., :n, :], atol=0, rtol=0
    )
    assert blended.recompute_ratio_effective == 0.0
    full = _run(model, prompt, "full")
    assert _max_diff(reuse.logits, full.logits) > 1e-2  # reuse is not full (0.09 here)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
def test_every_mode_in_half_precision_tracks_float32(tiny_checkpoints, prompt, device, dtype):
    """No mode has a half-precision path of its own that goes wrong: each is as close to
    the same mode in float32 as full prefill is (the recomputed slots are fixed, so both
    dtypes recompute the same tokens)."""
    model32 = _load(tiny_checkpoints, device, torch.float32)
    model = _load(tiny_checkpoints, device, dtype)
    rounding = _max_diff(_run(model, prompt, "full").logits, _run(model32, prompt, "full").logits)
    slots = dict(recompute_slots=list(range(20, 60)) + list(range(318, 326)))
    for mode, options in [("reuse", {}), ("prefix", {}), ("blend", slots)]:
        half = _run(model, prompt, mode, **options).logits
        ref = _run(model32, prompt, mode, **options).logits
        assert _max_diff(half, ref) <= ROUNDING_FACTOR * rounding, mode


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
def test_cached_chunk_k_moved_to_a_new_place_equals_k_computed_there(
    tiny_checkpoints, prompt, device, dtype
):
    """Layer-0 K does not depend on context: a cached chunk's K placed by reuse (rotated in
    the cache, in half precision) equals the K full prefill computes at that place. The
    third chunk was cached at positions 5-13 and sits at 317-325 here."""
    model = _load(tiny_checkpoints, device, dtype)
    head, chunks, question = prompt
    reuse = _run(model, prompt, "reuse")
    ids = torch.tensor([head + sum(chunks, []) + question], device=device)
    positions = torch.arange(ids.shape[1], device=device)
    _, kv = model(ids, positions[None], collect_kv=True)
    k0 = apply_rope(kv[0][0][0], *rope_cos_sin(model.inv_freq, positions))  # [H_kv, T, D]
    start = len(head) + len(chunks[0]) + len(chunks[1])
    span = slice(start, start + len(chunks[2]))
    placed = reuse.cache.k[0, 0, :, span]
    ulp = torch.finfo(dtype).eps * k0[:, span].abs().max().item()
    assert _max_diff(placed, k0[:, span]) <= ROPE_ULPS * ulp
    cached_at = torch.arange(len(head), len(head) + len(chunks[2]), device=device)
    k_pre = precompute_chunks(model, head, [chunks[2]])[0].k[0].to(device)  # [H_kv, n, D]
    where_cached = apply_rope(k_pre, *rope_cos_sin(model.inv_freq, cached_at))
    assert _max_diff(where_cached, k0[:, span]) > 10 * ROPE_ULPS * ulp  # placing it matters
