from __future__ import annotations

import torch

from kvservice.store.format import decode_chunk, encode_chunk
from kvservice.store.quant import dequantize_per_token, quantize_per_token

from .conftest import make_chunk


def test_quantization_error_is_at_most_half_a_step_per_token():
    x = torch.randn(2, 33, 64) * torch.logspace(-3, 2, 33).view(1, 33, 1)  # wildly varying tokens
    q, scale = quantize_per_token(x)
    back = dequantize_per_token(q, scale, x.dtype)
    bound = x.abs().amax(dim=-1, keepdim=True) / 254 + 1e-6
    assert q.dtype == torch.int8 and scale.shape == (2, 33)
    assert bool(((back - x).abs() <= bound).all())


def test_zero_tokens_survive_quantization():
    x = torch.zeros(1, 3, 8)
    q, scale = quantize_per_token(x)
    assert torch.equal(dequantize_per_token(q, scale, x.dtype), x)


def test_quantized_objects_are_smaller_and_close():
    for dtype, min_ratio in [(torch.float32, 3.5), (torch.float16, 1.8), (torch.bfloat16, 1.8)]:
        chunk = make_chunk(1, tokens=128, dtype=dtype)
        # SmolLM2-like head dim
        chunk.k = torch.randn(4, 3, 128, 64).to(dtype)
        chunk.v = torch.randn(4, 3, 128, 64).to(dtype)
        plain, quantized = encode_chunk(chunk), encode_chunk(chunk, quantize=True)
        assert len(plain) / len(quantized) >= min_ratio, (dtype, len(plain) / len(quantized))
        back = decode_chunk(quantized)
        assert back.k.dtype == dtype
        rel = (back.k.float() - chunk.k.float()).norm() / chunk.k.float().norm()
        assert rel < 0.01
