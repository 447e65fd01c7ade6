"""Device-memory tier: objects held as uint8 tensors on an accelerator (CUDA when present).

The store builds it only when ``device_capacity_bytes > 0`` and CUDA is available; a read
returns a device tensor slice that the decoder views as K/V without leaving the device.
"""

from __future__ import annotations

import torch

from kvservice.protocol.keys import ChunkKey
from kvservice.store.format import Buffer, as_uint8
from kvservice.store.lru import LRUTier


class DeviceTier(LRUTier):
    name = "device"
    trusted = True

    def __init__(self, capacity_bytes: int, device: torch.device | str = "cuda") -> None:
        super().__init__(capacity_bytes)
        self.device = torch.device(device)
        self._objects: dict[ChunkKey, torch.Tensor] = {}

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available()

    def _store(self, key: ChunkKey, data: Buffer) -> None:
        tensor = as_uint8(data)
        self._objects[key] = tensor.to(self.device, copy=True)

    def _load_range(self, key: ChunkKey, start: int, length: int | None) -> Buffer | None:
        data = self._objects.get(key)
        if data is None:
            return None
        end = data.numel() if length is None else min(data.numel(), start + length)
        return data[start:end]

    def _remove(self, key: ChunkKey) -> None:
        self._objects.pop(key, None)
