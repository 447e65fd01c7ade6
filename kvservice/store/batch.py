"""What one request's load is measured by: the clock its chunks' fetches run on
(:class:`LoadClock`), the batch of its sources :meth:`KVLoader.open` returns
(:class:`LoadBatch`), and the figures the batch reports (:class:`LoadStats`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvservice.store.base import ReadMeter

if TYPE_CHECKING:
    from kvservice.store.layered import StoreLayeredKV


@dataclass(frozen=True)
class LoadStats:
    chunks: int
    tiers: list[str]  # the tier that served each chunk, or "recomputed"
    bytes_read: int
    load_s: float  # wall time with at least one fetch in flight
    wait_s: float  # time the consumer was blocked waiting for KV
    hidden_load_fraction: float  # 1 - wait_s / load_s, in [0, 1]
    pipelined: bool
    faults: int
    tier_bytes: dict[str, int] = field(default_factory=dict)  # layer bytes to move, per tier

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LoadClock:
    """The batch's fetch clock (union of in-flight intervals) and the consumer's wait."""

    def __init__(self) -> None:
        self.fetch = ReadMeter()
        self._lock = threading.Lock()
        self.wait_s = 0.0
        self.faults = 0

    def add_wait(self, seconds: float) -> None:
        with self._lock:
            self.wait_s += seconds

    def add_fault(self) -> None:
        with self._lock:
            self.faults += 1


class LoadBatch:
    """The sources of one request, in the order of the keys given to :meth:`KVLoader.open`."""

    def __init__(self, sources: list[StoreLayeredKV], clock: LoadClock, pipelined: bool) -> None:
        self.sources = sources
        self._clock = clock
        self.pipelined = pipelined

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, index: int) -> StoreLayeredKV:
        return self.sources[index]

    def __iter__(self) -> Iterator[StoreLayeredKV]:
        return iter(self.sources)

    @property
    def tiers(self) -> list[str]:
        return [source.tier for source in self.sources]

    @property
    def read(self) -> list[bool]:
        """Per chunk: its KV is read (False: skipped by ``open(choose=...)``, recompute it)."""
        return [not source.skipped for source in self.sources]

    def tier_bytes(self) -> dict[str, int]:
        """Layer bytes to move per serving tier (what the controller prices)."""
        totals: dict[str, int] = {}
        for source in self.sources:
            totals[source.tier] = totals.get(source.tier, 0) + source.loaded_bytes()
        return totals

    def stats(self) -> LoadStats:
        load_s, wait_s = self._clock.fetch.busy_s, self._clock.wait_s
        hidden = 1.0 - wait_s / load_s if load_s > 0 else 1.0
        return LoadStats(
            chunks=len(self.sources),
            tiers=self.tiers,
            bytes_read=self._clock.fetch.bytes_read,
            load_s=load_s,
            wait_s=wait_s,
            hidden_load_fraction=min(1.0, max(0.0, hidden)),
            pipelined=self.pipelined,
            faults=self._clock.faults,
            tier_bytes=self.tier_bytes(),
        )
