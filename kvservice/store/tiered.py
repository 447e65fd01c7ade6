"""The tier chain: fastest first (device, CPU memory, local disk), then S3 as the durable
store. Writes go to a local tier and through to S3; a read is served by the first tier that
holds a valid copy and promotes the object into every faster tier (each an LRU bounded by
bytes). A fault (missing, truncated, corrupt, another model's object, S3 down) is counted,
logged, and, through :meth:`TieredStore.get_or_recompute`, repaired by recomputing the
chunk from its tokens and writing the object again."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvservice.chunk import ChunkKV
from kvservice.protocol.codecs import Codec, codec_by_name
from kvservice.protocol.errors import (
    ChunkCorrupt,
    ChunkMissing,
    ChunkTruncated,
    ChunkUnavailable,
    FingerprintMismatch,
    StoreUnavailable,
)
from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.objects import HEADER_PROBE_BYTES
from kvservice.store.base import Tier, TierStats
from kvservice.store.config import StoreConfig
from kvservice.store.device import DeviceTier
from kvservice.store.disk import DiskTier
from kvservice.store.format import (
    Buffer,
    ChunkHeader,
    decode_chunk,
    decode_header,
    encode_chunk,
    header_length,
    verify_object,
)
from kvservice.store.memory import MemoryTier
from kvservice.store.s3 import S3Tier

log = logging.getLogger(__name__)

RecomputeFn = Callable[[list[int]], ChunkKV]


def fault_kind(err: BaseException) -> str:
    if isinstance(err, FingerprintMismatch):
        return "wrong_fingerprint"
    if isinstance(err, ChunkTruncated):
        return "truncated"
    if isinstance(err, ChunkCorrupt):
        return "corrupt"
    if isinstance(err, StoreUnavailable):
        return "unavailable"
    if isinstance(err, ChunkMissing):
        return "missing"
    return type(err).__name__


@dataclass(frozen=True)
class StoreStats:
    """Snapshot for the dashboard: per-tier stats (fastest first) and fault counters."""

    tiers: list[TierStats]
    faults: dict[str, int]  # by kind: missing, truncated, corrupt, wrong_fingerprint, unavailable
    recomputes: int
    write_through_failures: int
    quantize: bool
    codec: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Located:
    """Where a chunk was found: the tier, its verified header, and the bytes read so far."""

    tier: Tier
    tier_index: int
    header: ChunkHeader
    head: Buffer  # the first bytes of the object (at least the header)


class TieredStore:
    def __init__(
        self, tiers: Sequence[Tier], *, quantize: bool = False, config: StoreConfig | None = None
    ) -> None:
        self.tiers = list(tiers)
        self.config = config or StoreConfig()
        self.quantize = quantize
        # what put() writes: int8 where asked for (KV_QUANTIZE, or quantize=True), else KV_CODEC
        self.codec = codec_by_name("int8") if quantize else self.config.kv_codec
        self._lock = threading.Lock()
        self._faults: Counter[str] = Counter()
        self.recomputes = 0
        self.write_through_failures = 0

    @classmethod
    def from_config(cls, config: StoreConfig) -> TieredStore:
        tiers: list[Tier] = []
        if config.device_capacity_bytes > 0 and DeviceTier.available():
            tiers.append(DeviceTier(config.device_capacity_bytes))
        if config.cpu_capacity_bytes > 0:
            tiers.append(MemoryTier(config.cpu_capacity_bytes, pinned=config.pin_cpu_tier))
        if config.disk_capacity_bytes > 0:
            tiers.append(DiskTier(config.disk_dir, config.disk_capacity_bytes))
        if config.s3_endpoint:
            tiers.append(S3Tier(config))
        return cls(tiers, quantize=config.quantize, config=config)

    # -- tiers ------------------------------------------------------------------------------

    def tier(self, name: str) -> Tier:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no {name!r} tier (have {[t.name for t in self.tiers]})")

    @property
    def local_tiers(self) -> list[Tier]:
        return [tier for tier in self.tiers if not isinstance(tier, S3Tier)]

    @property
    def durable(self) -> S3Tier | None:
        return next((tier for tier in self.tiers if isinstance(tier, S3Tier)), None)

    # -- writes -----------------------------------------------------------------------------

    def put(
        self,
        chunk: ChunkKV,
        *,
        tiers: Sequence[str] | None = None,
        quantize: bool | None = None,
        codec: Codec | None = None,
        write_through: bool = True,
        scope: str = "",
    ) -> ChunkKey:
        """Encode and store a chunk under its content address in ``scope``; returns the key.

        ``codec`` defaults to the store's (``KV_CODEC``); ``quantize`` True means int8 per
        token, False the unquantized ``fp16`` codec.

        ``tiers`` names the local tiers to fill (default: the fastest local tier); with
        ``write_through`` the object also goes to S3, and a failure there raises
        :class:`StoreUnavailable` after the local copies are in place.
        """
        key = ChunkKey.of(chunk, scope)
        if codec is None and quantize is not None:
            codec = codec_by_name("int8" if quantize else "fp16")
        self.put_encoded(key, self.encode(chunk, codec), tiers=tiers, write_through=write_through)
        return key

    def encode(self, chunk: ChunkKV, codec: Codec | None = None) -> bytearray:
        """The object :meth:`put` stores for ``chunk``: ``codec`` (default the store's), in
        the store's 16-bit type (``KV_STORE_DTYPE``)."""
        return encode_chunk(chunk, codec=codec or self.codec, narrow_to=self.config.narrow_to)

    def put_encoded(
        self,
        key: ChunkKey,
        data: Buffer,
        *,
        tiers: Sequence[str] | None = None,
        write_through: bool = True,
    ) -> None:
        local = self.local_tiers
        targets = local[:1] if tiers is None else [self.tier(name) for name in tiers]
        for tier in targets:
            if not isinstance(tier, S3Tier):
                tier.put(key, data)
        s3 = self.durable
        if s3 is not None and (write_through or s3 in targets):
            try:
                s3.put(key, data)
            except StoreUnavailable:
                with self._lock:
                    self.write_through_failures += 1
                raise

    def promote(self, key: ChunkKey, data: Buffer, found_at: int) -> None:
        """Copy an object found in tier ``found_at`` into every faster local tier."""
        for tier in self.tiers[:found_at]:
            if not isinstance(tier, S3Tier) and not tier.contains(key):
                tier.put(key, data)

    def warm(self, key: ChunkKey, tier: str) -> bool:
        """Copy a chunk into the named tier from the fastest tier with a valid copy (the
        dashboard's "warm" action). False when the tier cannot hold it (capacity)."""
        target = self.tier(tier)
        if target.contains(key):
            return True
        found = self.locate(key)
        data = found.tier.get(key)
        if data is None:
            raise ChunkMissing(f"{key} vanished from the {found.tier.name} tier")
        if not found.tier.trusted:
            try:
                verify_object(data, key)
            except ChunkUnavailable as err:
                self.note_fault(key, found.tier, err)
                raise
        target.put(key, data)
        return target.contains(key)

    def drop_local(self, key: ChunkKey) -> None:
        """Forget the local copies (the S3 object stays): the next read comes from S3."""
        for tier in self.local_tiers:
            tier.delete(key)

    def delete(self, key: ChunkKey) -> None:
        for tier in self.tiers:
            tier.delete(key)

    # -- reads ------------------------------------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        """Whether any tier holds the key (S3: one HEAD request; unreachable counts as no)."""
        for tier in self.tiers:
            try:
                if tier.contains(key):
                    return True
            except StoreUnavailable:
                continue
        return False

    def where(self, key: ChunkKey) -> str | None:
        """Name of the fastest tier holding the key, or None (a query: nothing counted)."""
        for tier in self.tiers:
            try:
                if tier.contains(key):
                    return tier.name
            except StoreUnavailable:
                continue
        return None

    def locate(self, key: ChunkKey, *, start_at: int = 0) -> Located:
        """The fastest tier with a valid header for ``key``; bad copies are counted, logged
        and deleted on the way down. Raises the most telling :class:`ChunkUnavailable`."""
        first_error: ChunkUnavailable | None = None
        for index in range(start_at, len(self.tiers)):
            tier = self.tiers[index]
            try:
                head = tier.read_range(key, 0, HEADER_PROBE_BYTES)
                if head is None:
                    continue
                need = header_length(head)
                if need > len(head):
                    head = tier.read_range(key, 0, need)
                    if head is None:
                        continue
                header = decode_header(head)
                header.check_key(key)
                return Located(tier, index, header, head)
            except ChunkUnavailable as err:
                self.note_fault(key, tier, err)
                first_error = first_error or err
        if first_error is not None:
            raise first_error
        with self._lock:
            self._faults["missing"] += 1
        raise ChunkMissing(f"no tier holds {key}")

    def get(self, key: ChunkKey) -> ChunkKV:
        """The whole chunk, verified, from the fastest tier with a valid copy (promoted)."""
        start_at = 0
        while True:
            found = self.locate(key, start_at=start_at)
            try:
                data = found.tier.get(key)
                if data is None:
                    raise ChunkMissing(f"{key} vanished from {found.tier.name}")
                chunk = decode_chunk(data, key, verify=not found.tier.trusted)
            except ChunkUnavailable as err:
                self.note_fault(key, found.tier, err)
                start_at = found.tier_index + 1
                if start_at >= len(self.tiers):
                    raise
                continue
            self.promote(key, data, found.tier_index)
            return chunk

    def get_or_recompute(
        self, key: ChunkKey, token_ids: Sequence[int], recompute_fn: RecomputeFn
    ) -> ChunkKV:
        """:meth:`get`, or on any fault the chunk recomputed from its tokens and stored again."""
        try:
            return self.get(key)
        except ChunkUnavailable as err:
            return self.recover(key, token_ids, recompute_fn, err)

    def recover(
        self,
        key: ChunkKey,
        token_ids: Sequence[int],
        recompute_fn: RecomputeFn,
        cause: BaseException,
    ) -> ChunkKV:
        log.warning(
            "KV chunk %s unavailable (%s: %s); recomputing its %d tokens and replacing the object",
            key,
            fault_kind(cause),
            cause,
            len(token_ids),
        )
        chunk = recompute_fn(list(token_ids))
        if ChunkKey.of(chunk) != key.unscoped():
            raise ValueError(f"recompute_fn returned chunk {ChunkKey.of(chunk)} for key {key}")
        with self._lock:
            self.recomputes += 1
        try:
            self.put(chunk, scope=key.scope)
        except StoreUnavailable as err:
            log.error(
                "KV chunk %s recomputed but not written to S3 (%s); kept in local tiers", key, err
            )
        return chunk

    def note_fault(self, key: ChunkKey, tier: Tier, err: BaseException) -> None:
        kind = fault_kind(err)
        with self._lock:
            self._faults[kind] += 1
        if isinstance(err, StoreUnavailable):
            return  # the S3 tier already logged it
        log.warning(
            "KV chunk %s: %s copy in the %s tier (%s); dropping it", key, kind, tier.name, err
        )
        try:
            tier.delete(key)
        except StoreUnavailable:
            pass

    # -- stats ------------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._lock:
            faults = dict(self._faults)
            recomputes, failures = self.recomputes, self.write_through_failures
        return StoreStats(
            tiers=[tier.stats() for tier in self.tiers],
            faults=faults,
            recomputes=recomputes,
            write_through_failures=failures,
            quantize=self.quantize,
            codec=self.codec.name,
        )
