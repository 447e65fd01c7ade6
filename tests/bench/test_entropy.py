"""The entropy-coding bench's coders give kivi objects back exactly, and its bounds hold."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bench.codec import entropy_bytes, parse_codec
from bench.entropy import (
    CODERS,
    adaptive_bits,
    bound_bytes,
    delta_codes,
    split_object,
    undelta_codes,
)
from kvservice.chunk import ChunkKV
from kvservice.store.format import encode_chunk

# 4-bit K / 3-bit V with a 2-bit tail (3 bits: codes straddle bytes), 16-token K groups so a
# 37-token chunk has a partial last group
SPECS = ("kivi:k=4:v=4@0.5/3:kg=16:vg=8:rot=1", "kivi:k=4@0.5/2:v=2:kg=16:vg=16")


def tiny_chunk(tokens: int = 37, seed: int = 0) -> ChunkKV:
    """Random KV: 2 layers, 2 heads, head dim 16, K with two large channels as keys have."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 2, tokens, 16, generator=gen)
    k[..., :2] *= 20.0
    v = torch.randn(2, 2, tokens, 16, generator=gen)
    return ChunkKV(list(range(100, 100 + tokens)), k, v, "tiny@test", "head")


def tiny_object(spec: str) -> bytearray:
    return encode_chunk(tiny_chunk(), codec=parse_codec(spec), narrow_to=torch.float16)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("coder", CODERS, ids=lambda coder: coder.name)
def test_every_coder_gives_the_object_back_byte_for_byte(coder, spec):
    data = tiny_object(spec)
    assert coder.restore(coder.encode(data)) == data


@pytest.mark.parametrize("spec", SPECS)
def test_bounds_are_below_the_codecs_bytes_and_order0_below_the_ans_coder(spec):
    data = tiny_object(spec)
    bounds = bound_bytes(data, split_object(data))
    assert bounds["order0"] == entropy_bytes(data)
    assert bounds["order0"] < len(data)  # Gaussian codes are not uniform
    ans = next(coder for coder in CODERS if coder.name == "ans")
    assert bounds["order0"] <= len(ans.encode(data))  # a static table cannot beat entropy


def test_deltas_restart_at_each_group_and_undo_exactly():
    codes = np.random.default_rng(0).integers(0, 8, size=(2, 37, 16)).astype(np.uint8)
    delta = delta_codes(codes, bits=3, group=16)
    assert np.array_equal(delta[:, [0, 16, 32]], codes[:, [0, 16, 32]])
    assert np.array_equal(delta[:, 1], (codes[:, 1].astype(int) - codes[:, 0]) % 8)
    assert np.array_equal(undelta_codes(delta, bits=3, group=16), codes)


def test_adaptive_bits_are_krichevsky_trofimovs():
    assert adaptive_bits(np.array([[1, 0]])) == pytest.approx(1.0)  # 1/2
    assert adaptive_bits(np.array([[2, 0]])) == pytest.approx(math.log2(8 / 3))  # 1/2 * 3/4
    assert adaptive_bits(np.array([[1, 0], [0, 1]])) == pytest.approx(2.0)  # contexts add up


def test_an_fp16_object_has_no_codes_to_entropy_code():
    data = encode_chunk(tiny_chunk(), codec=parse_codec("fp16"), narrow_to=torch.float16)
    with pytest.raises(ValueError, match="no integer codes"):
        split_object(data)
