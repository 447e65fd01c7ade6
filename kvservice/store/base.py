"""One interface for every tier: device memory, CPU memory, local disk, S3.

A tier stores encoded chunk objects (:mod:`kvservice.store.format`) by :class:`ChunkKey`
and can read a byte range of one, so a loader can fetch one layer at a time. Query methods
(``contains``, ``stats``) have no side effects; ``get``/``read_range`` count hits and misses
and refresh LRU order.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.objects import Readable
from kvservice.store.format import Buffer


@dataclass(frozen=True)
class TierStats:
    """A snapshot of one tier, plain data for the dashboard (``asdict`` gives a dict)."""

    name: str
    entries: int | None  # None where counting would cost a listing (S3)
    bytes: int | None
    capacity_bytes: int | None  # None: unbounded
    hits: int
    misses: int
    evictions: int
    bytes_read: int
    read_busy_s: float  # wall time with at least one read in flight
    read_bandwidth_bytes_per_s: float | None  # bytes_read / read_busy_s; None before any read
    errors: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ReadMeter:
    """Counts bytes read and the wall time during which any read was in flight, so that
    parallel reads measure the tier's aggregate bandwidth rather than one stream's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self.busy_s = 0.0
        self.bytes_read = 0

    def start(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1

    def stop(self, nbytes: int) -> None:
        with self._lock:
            self._in_flight -= 1
            self.bytes_read += nbytes
            if self._in_flight == 0:
                self.busy_s += time.perf_counter() - self._busy_since

    @property
    def bandwidth(self) -> float | None:
        with self._lock:
            return self.bytes_read / self.busy_s if self.busy_s > 0 else None


class Tier(ABC):
    """An abstract tier. ``name`` is one of ``device``, ``cpu``, ``disk``, ``s3``."""

    name: str = "tier"
    # Bytes held by a trusted tier were verified when they entered it: reads skip checksums.
    trusted: bool = False
    # The tier implements ``open_stream``: a loader reads a chunk's layers from one request.
    streams: bool = False

    def __init__(self) -> None:
        self._meter = ReadMeter()
        self._counter_lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.errors = 0

    # -- single-item operations -------------------------------------------------------------

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool: ...

    @abstractmethod
    def get(self, key: ChunkKey) -> Buffer | None:
        """The whole object, or None when the tier does not hold it."""

    @abstractmethod
    def read_range(self, key: ChunkKey, start: int, length: int) -> Buffer | None:
        """``length`` bytes from ``start`` (fewer at the object's end), or None when missing."""

    def read_into(self, key: ChunkKey, start: int, out: memoryview) -> int | None:
        """Read ``len(out)`` bytes from ``start`` into ``out``; bytes read, or None if missing.
        Tiers that can (disk, S3) override this to read without an intermediate copy."""
        data = self.read_range(key, start, len(out))
        if data is None:
            return None
        if hasattr(data, "numpy"):  # a torch tensor (device tier)
            data = data.cpu().numpy()
        n = buffer_nbytes(data)
        out[:n] = memoryview(data).cast("B")
        return n

    def open_stream(self, key: ChunkKey, start: int) -> AbstractContextManager[Readable | None]:
        """The object from ``start`` to its end as one sequential read: a context giving a
        reader (``readinto``), or None when the tier does not hold the object. A loader
        then reads a chunk layer after layer from one request instead of one request per
        layer. Tiers that can (``streams = True``: S3) override it."""
        raise NotImplementedError(f"the {self.name} tier does not stream")

    @abstractmethod
    def put(self, key: ChunkKey, data: Buffer) -> None: ...

    @abstractmethod
    def delete(self, key: ChunkKey) -> bool:
        """Remove the object; True when it was there."""

    @abstractmethod
    def stats(self) -> TierStats: ...

    # -- helpers for subclasses ------------------------------------------------------------

    def _count(self, *, hit: bool) -> None:
        with self._counter_lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def _count_error(self) -> None:
        with self._counter_lock:
            self.errors += 1

    def _snapshot(
        self, *, entries: int | None, nbytes: int | None, capacity: int | None
    ) -> TierStats:
        return TierStats(
            name=self.name,
            entries=entries,
            bytes=nbytes,
            capacity_bytes=capacity,
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            bytes_read=self._meter.bytes_read,
            read_busy_s=self._meter.busy_s,
            read_bandwidth_bytes_per_s=self._meter.bandwidth,
            errors=self.errors,
        )


def buffer_nbytes(data: Buffer) -> int:
    if hasattr(data, "nbytes") and not isinstance(data, (bytes, bytearray)):
        return int(data.nbytes)  # memoryview, torch.Tensor
    return len(data)
