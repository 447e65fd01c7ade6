"""The unit of precomputed knowledge: one chunk's per-layer K and V.

This is the contract between the engine (which computes and consumes chunk KV) and the
store (which serializes, tiers and loads it). Both sides import it; neither defines its own.

Layout: K and V are ``[L, H_kv, T, D]`` tensors (layers, KV heads, tokens, head dim).
K is stored *before* RoPE, so a cached chunk can be placed at any position of a new prompt
by rotating it there (``kvservice.model.transformer.apply_rope`` at the new positions).

A chunk is precomputed *after* the deployment's fixed prompt head (BOS, chat-template
opening, system prompt): the chunk's tokens attend to the head as they will in the real
prompt, and only the chunk's part is kept. ``head_hash`` names that head, so a change of
system prompt never serves stale KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvservice.protocol.keys import token_ids_sha256

__all__ = ["ChunkKV", "LayeredKV", "token_ids_sha256"]


class LayeredKV(Protocol):
    """Anything that hands out one layer of a chunk's KV at a time (in memory, or a
    store-backed loader that prefetches layer i+1 while layer i is being used)."""

    num_tokens: int

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K (pre-RoPE) and V of one layer, each ``[H_kv, T, D]``."""
        ...


@dataclass
class ChunkKV:
    """One chunk's KV for every layer, held in memory."""

    token_ids: list[int]
    k: torch.Tensor  # [L, H_kv, T, D], before RoPE
    v: torch.Tensor  # [L, H_kv, T, D]
    model_fingerprint: str
    head_hash: str

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(
                f"K and V must both be [L, H_kv, T, D]; got {self.k.shape}, {self.v.shape}"
            )
        if self.k.shape[2] != len(self.token_ids):
            raise ValueError(f"KV has {self.k.shape[2]} tokens but {len(self.token_ids)} token ids")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def tokens_sha256(self) -> str:
        return token_ids_sha256(self.token_ids)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]
