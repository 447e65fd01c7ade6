"""CPU-memory tier: objects held as bytearrays; reads are zero-copy memoryview slices."""

from __future__ import annotations

from kvservice.store.format import Buffer
from kvservice.store.keys import ChunkKey
from kvservice.store.lru import LRUTier


class MemoryTier(LRUTier):
    name = "cpu"
    trusted = True  # bytes were verified (or freshly encoded) when they came in

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._objects: dict[ChunkKey, bytearray] = {}

    def _store(self, key: ChunkKey, data: Buffer) -> None:
        # Keep a bytearray we own (no copy when handed one): torch views need writable memory.
        if isinstance(data, bytearray):
            self._objects[key] = data
        elif hasattr(data, "numpy"):  # a torch uint8 tensor
            self._objects[key] = bytearray(data.cpu().numpy().tobytes())
        else:
            self._objects[key] = bytearray(data)

    def _load_range(self, key: ChunkKey, start: int, length: int | None) -> Buffer | None:
        data = self._objects.get(key)
        if data is None:
            return None
        end = len(data) if length is None else min(len(data), start + length)
        return memoryview(data)[start:end]

    def _remove(self, key: ChunkKey) -> None:
        self._objects.pop(key, None)
