"""Large CPU buffers kept for the next request: a request's KV cache and the buffers its
chunks are decoded into (``store.joined``), allocated once.

A 3,700-token SmolLM2 prompt's KV cache is two 42 MB tensors. glibc hands memory that large
back to the system when it is freed (anything over its 32 MB heap ceiling), so every request's
cache used to be fresh pages, each faulted in on its first write: on the 2-core AMD EPYC,
filling two such tensors took 29-31 ms fresh against 6-7 ms into ones already touched
(docs/kernels.md, "Fresh memory"), a tenth of a reuse's time-to-first-token.

``BufferPool.empty`` is ``torch.empty`` that keeps what it hands out and hands a buffer out
again once nothing else holds its storage (the storage's use count is the pool's own), so
there is no release call to forget, and a view that outlives its cache keeps its buffer out
of the pool. On a GPU, PyTorch's caching allocator already reuses freed blocks: the pool
serves the CPU only.
"""

from __future__ import annotations

import math
import threading

import torch

# What the pool holds at most (buffers in use included); beyond it, new ones are not kept.
DEFAULT_LIMIT_BYTES = 1 << 30
# Below this, glibc's heap reuses freed memory itself (its threshold for mapping fresh pages
# rises to 32 MB as large blocks are freed): not worth a pool's bookkeeping.
MIN_BYTES = 4 << 20
# A free buffer serves a request at most this many times smaller than itself.
MAX_WASTE = 2


# How many tensors and storage objects hold a storage: PyTorch's own (its tests use it), not
# a public API; without it (another torch) the pool hands out plain tensors.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unused(buffer: torch.Tensor) -> bool:
    """Whether only the pool holds ``buffer``'s storage: one reference from the pool's tensor
    and one from the storage object this call makes (no tensor or view of anyone else's)."""
    return _use_count(buffer.untyped_storage()._cdata) <= 2


class BufferPool:
    """Reusable uninitialized CPU tensors (``empty``), at most ``limit_bytes`` kept."""

    def __init__(self, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []  # flat uint8, least recently handed out first
        self.handed = 0  # tensors handed out from the pool ...
        self.reused = 0  # ... of them, buffers handed out before

    def empty(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """An uninitialized tensor, as ``torch.empty`` gives, in a kept buffer where it is
        a large CPU one."""
        nbytes = math.prod(shape) * dtype.itemsize
        pooled = _use_count is not None and self.limit_bytes > 0 and nbytes >= MIN_BYTES
        if not pooled or torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        with self._lock:  # a buffer found unused here is handed out before another look
            buffer = self._free_buffer(nbytes)
            if buffer is None:
                buffer = torch.empty(nbytes, dtype=torch.uint8)
                if not self._make_room(nbytes):
                    return buffer.view(dtype).view(shape)  # not kept: the pool is full
            else:
                self._drop(buffer)
                self.reused += 1
            self._buffers.append(buffer)
            self.handed += 1
            return buffer[:nbytes].view(dtype).view(shape)

    def _free_buffer(self, nbytes: int) -> torch.Tensor | None:
        """The smallest unused buffer that holds ``nbytes`` without wasting more than
        ``MAX_WASTE`` times it."""
        fits = [b for b in self._buffers if nbytes <= b.numel() <= MAX_WASTE * nbytes]
        free = [b for b in fits if _unused(b)]
        return min(free, key=torch.Tensor.numel, default=None)

    def _make_room(self, nbytes: int) -> bool:
        """Drop unused buffers, least recently handed out first, until ``nbytes`` more fit
        under the limit; False if they cannot."""
        for buffer in list(self._buffers):
            if self.held_bytes + nbytes <= self.limit_bytes:
                break
            if _unused(buffer):
                self._drop(buffer)
        return self.held_bytes + nbytes <= self.limit_bytes

    def _drop(self, buffer: torch.Tensor) -> None:
        """Forget ``buffer`` (by identity: ``list.remove`` would compare tensors' values)."""
        self._buffers = [b for b in self._buffers if b is not buffer]

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "buffers": len(self._buffers),
                "held_bytes": self.held_bytes,
                "handed": self.handed,
                "reused": self.reused,
            }


# The process's pool: every KV cache the engine makes (kvservice.model.transformer.KVCache).
KV_BUFFERS = BufferPool()
