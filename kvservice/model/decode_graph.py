"""A batch's decode step recorded as a CUDA graph and replayed, step after step.

A decode step of a small batch reads every weight once (Llama-3-8B's 16 GB: ~5 ms at an
H100's bandwidth) but launches ~30 kernels a layer, ~1,000 a step, so on a GPU the host's
launches, not the memory, set its pace. ``DecodeGraph`` records one batch cache's step once
the batch has stayed the same for ``STABLE_STEPS`` steps (a batch that changes every step
would pay for a recording each time), then replays it for every later step of that cache.

``static_decode_step`` is the step with nothing read back on the host and every shape fixed
by the cache: the new tokens' KV is written at the cache's next slot by index, and attention
reads every slot of the cache, the ones not yet written masked as invalid (at 4,096 cached
tokens and 512 to come, ~6 % more KV read than ``Transformer.forward`` reads). It computes
what ``Transformer.forward`` computes for one new token a row; on the CPU the tests hold it
to that, on CUDA ``DecodeGraph`` records it. The inference worker's batcher and
``bench.decode`` step through it where passes are recorded (CUDA, ``ENGINE_COMPILE`` on).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvservice.model import cuda_graph
from kvservice.model.transformer import KVCache, Transformer, position_mask

log = logging.getLogger(__name__)

STABLE_STEPS = 2  # steps of one batch cache run as they are before its step is recorded


@dataclass(frozen=True)
class DecodeInputs:
    tokens: torch.Tensor  # [B] each row's last token
    positions: torch.Tensor  # [B] its position
    slot: torch.Tensor  # [1] the cache slot it goes to (the cache's length)

    @classmethod
    def empty(cls, rows: int, device) -> DecodeInputs:
        longs = dict(dtype=torch.long, device=device)
        return cls(torch.zeros(rows, **longs), torch.zeros(rows, **longs), torch.zeros(1, **longs))


@torch.no_grad()
def static_decode_step(model: Transformer, cache: KVCache, inputs: DecodeInputs) -> torch.Tensor:
    """One token a row through the model over ``cache`` (its KV written at ``inputs.slot``,
    which the caller then counts as used): the next-token logits ``[B, V]``. No value is read
    back on the host and every shape is the cache's: a CUDA graph records it as is. Running it
    twice for the same inputs writes the same slot with the same values."""
    config, slot = model.config, inputs.slot
    cache.positions.index_copy_(1, slot, inputs.positions[:, None])
    cache.valid.index_fill_(1, slot, True)
    query_pos = inputs.positions[:, None]  # [B, 1]
    x = model.embed(inputs.tokens)[:, None]  # [B, 1, dim]
    ropes = model.ropes(query_pos)
    masks: dict[int | None, torch.Tensor] = {}  # per sliding window: [B, 1, C]
    for i, layer in enumerate(model.layers):
        window = config.window(i)
        if window not in masks:
            masks[window] = position_mask(query_pos, cache.positions, cache.valid, window)
        cos, sin = ropes[i]
        q, k, v, _ = layer.project(x, cos, sin, cache.k.dtype)
        cache.k[i].index_copy_(2, slot, k)
        cache.v[i].index_copy_(2, slot, v)
        x = layer.attend_and_mlp(x, q, cache.k[i], cache.v[i], masks[window])
    return model.logits(x[:, -1])


class DecodeGraph:
    """The decode steps of one batch ``cache``: run as they are, then recorded once the batch
    has stayed for ``STABLE_STEPS`` (on CUDA, unless ``record`` is False) and replayed. A
    cache whose tensors are replaced (rows dropped) needs a new ``DecodeGraph``."""

    failed: str | None = None  # why recording stopped for every cache, if it did

    def __init__(self, model: Transformer, cache: KVCache, record: bool | None = None):
        self.model, self.cache = model, cache
        self.inputs = DecodeInputs.empty(cache.batch_size, model.device)
        self.record = model.device.type == "cuda" if record is None else record
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the recorded step's output
        self.steps = self.replays = 0
        self._tensors = self._addresses()

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``tokens [B]`` at ``positions [B]`` into the cache's next slot: their logits."""
        cache = self.cache
        if cache.length + 1 > cache.capacity:
            raise RuntimeError(f"decode cache full: capacity {cache.capacity}")
        if self._addresses() != self._tensors:
            raise RuntimeError("the batch cache's tensors were replaced: make a new DecodeGraph")
        self.inputs.tokens.copy_(tokens)
        self.inputs.positions.copy_(positions)
        self.inputs.slot.fill_(cache.length)
        self.steps += 1
        if self.graph is None and self.record and self.steps > STABLE_STEPS:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
            logits = self.logits.clone()
        else:
            logits = static_decode_step(self.model, cache, self.inputs)
        cache.length += 1
        return logits

    def _addresses(self) -> tuple[int, ...]:
        cache = self.cache
        return tuple(t.data_ptr() for t in (cache.k, cache.v, cache.positions, cache.valid))

    def _capture(self) -> None:
        """Record the step with this step's inputs (the runs before the recording write the
        same slot with the same values the replay then writes)."""
        if DecodeGraph.failed is not None:
            self.record = False
            return
        try:
            self.graph, self.logits = cuda_graph.record(
                lambda: static_decode_step(self.model, self.cache, self.inputs), self.model.device
            )
        except Exception as exc:  # noqa: BLE001 - any failure: the step as it is, from now on
            DecodeGraph.failed = f"{type(exc).__name__}: {exc}"
            self.record = False
            log.warning("decode graphs off, recording failed: %s", DecodeGraph.failed)
