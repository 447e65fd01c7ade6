"""8-bit per-token quantization of K and V (the CacheGen idea, without its entropy coding).

Each (head, token) vector of ``D`` values gets its own scale ``absmax / 127`` and is
rounded to int8, so an outlier token cannot blur its neighbours. The error of every
element is at most half a step: ``|x - dequantize(quantize(x))| <= absmax(x_token) / 254``.
"""

from __future__ import annotations

import torch

QMAX = 127


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., T, D] float -> (q: [..., T, D] int8, scale: [..., T] float32)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / QMAX  # [..., T]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_per_token(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_per_token`: [..., T, D] int8 and [..., T] -> [..., T, D] dtype."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)
