"""Byte-capacity LRU bookkeeping shared by the local tiers (device, CPU memory, disk)."""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections import OrderedDict

from kvservice.protocol.keys import ChunkKey
from kvservice.store.base import Tier, TierStats, buffer_nbytes
from kvservice.store.format import Buffer

log = logging.getLogger(__name__)


class LRUTier(Tier):
    """A tier bounded by ``capacity_bytes``; the least recently used objects go first."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self._sizes: OrderedDict[ChunkKey, int] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.RLock()

    # -- storage primitives of the subclass ---------------------------------------------------

    @abstractmethod
    def _store(self, key: ChunkKey, data: Buffer) -> None: ...

    @abstractmethod
    def _load_range(self, key: ChunkKey, start: int, length: int | None) -> Buffer | None:
        """None when the object vanished underneath (e.g. a deleted file)."""

    @abstractmethod
    def _remove(self, key: ChunkKey) -> None: ...

    # -- Tier ------------------------------------------------------------------------------

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity_bytes

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._sizes

    def keys(self) -> list[ChunkKey]:
        """Held keys, least recently used first (a query: no side effects)."""
        with self._lock:
            return list(self._sizes)

    def get(self, key: ChunkKey) -> Buffer | None:
        return self._read(key, 0, None)

    def read_range(self, key: ChunkKey, start: int, length: int) -> Buffer | None:
        return self._read(key, start, length)

    def _read(self, key: ChunkKey, start: int, length: int | None) -> Buffer | None:
        with self._lock:
            present = key in self._sizes
            if present:
                self._sizes.move_to_end(key)
        if not present:
            self._count(hit=False)
            return None
        self._meter.start()
        data = None
        try:
            data = self._load_range(key, start, length)
        finally:
            self._meter.stop(buffer_nbytes(data) if data is not None else 0)
        if data is None:  # vanished: forget it
            self._forget(key)
            self._count(hit=False)
            return None
        self._count(hit=True)
        return data

    def footprint(self, nbytes: int) -> int:
        """The memory an object of ``nbytes`` takes in this tier (what capacity counts)."""
        return nbytes

    def put(self, key: ChunkKey, data: Buffer) -> None:
        nbytes = self.footprint(buffer_nbytes(data))
        if not self.fits(nbytes):
            log.debug(
                "%s tier: %s (%d bytes) exceeds capacity %d",
                self.name,
                key,
                nbytes,
                self.capacity_bytes,
            )
            return
        with self._lock:
            if key in self._sizes:
                self._bytes -= self._sizes.pop(key)
            self._evict_for(nbytes)
            self._store(key, data)
            self._sizes[key] = nbytes
            self._bytes += nbytes

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            if key not in self._sizes:
                return False
            self._bytes -= self._sizes.pop(key)
            self._remove(key)
            return True

    def clear(self) -> None:
        with self._lock:
            for key in list(self._sizes):
                self.delete(key)

    def stats(self) -> TierStats:
        with self._lock:
            return self._snapshot(
                entries=len(self._sizes), nbytes=self._bytes, capacity=self.capacity_bytes
            )

    def _evict_for(self, nbytes: int) -> None:
        while self._sizes and self._bytes + nbytes > self.capacity_bytes:
            oldest, size = self._sizes.popitem(last=False)
            self._bytes -= size
            self._remove(oldest)
            self.evictions += 1
            log.debug("%s tier: evicted %s (%d bytes)", self.name, oldest, size)

    def _forget(self, key: ChunkKey) -> None:
        with self._lock:
            if key in self._sizes:
                self._bytes -= self._sizes.pop(key)

    def _adopt(self, key: ChunkKey, nbytes: int) -> None:
        """Index an object already present in the backing storage (disk after a restart)."""
        with self._lock:
            self._sizes[key] = nbytes
            self._bytes += nbytes
            self._evict_for(0)
