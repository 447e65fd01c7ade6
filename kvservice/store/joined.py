"""A request's chunks decoded together: a run of layers that a trusted tier (memory, GPU)
serves is decoded for every chunk of the request that can join it in one call
(:class:`JoinedChunks`); where they are decoded one by one, a request's quantized chunks go
side by side into one K and one V buffer (:func:`joint_slots`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvservice.protocol.codecs import KIVI
from kvservice.protocol.errors import ChunkUnavailable
from kvservice.store.buffers import KV_BUFFERS
from kvservice.store.format import ChunkHeader, as_uint8, decode_chunk_runs, decode_layers
from kvservice.store.tiered import Located

if TYPE_CHECKING:
    from kvservice.store.batch import LoadClock
    from kvservice.store.layered import LayerKV, StoreLayeredKV


@dataclass
class RunClaim:
    """One chunk's run of layers in a joined decode: its futures, and the copy they read."""

    source: StoreLayeredKV
    found: Located
    futures: dict[int, Future[LayerKV]]
    generation: int

    def read(self) -> torch.Tensor:
        """The run's stored bytes on the loader's device: a view of a trusted tier's copy
        (checked when it entered the tier), copied once where the tier is the host's."""
        header, source = self.found.header, self.source
        first, last = min(self.futures), max(self.futures)
        start = header.layer_offset(first)
        size = header.layer_offset(last) + header.layer_size(last) - start
        block = self.found.tier.read_range(source.key, start, size)
        if block is None:
            raise ChunkUnavailable(f"{source.key} vanished from the {self.found.tier.name} tier")
        raw = as_uint8(block)
        device = source.loader.device
        return raw if raw.device == device else raw.to(device, non_blocking=True)

    def settle(self, layers: Sequence[LayerKV] | None, error: BaseException | None = None) -> None:
        """Resolve each future with its layer, or every one with ``error``."""
        for n, future in enumerate(self.futures.values()):
            settle_future(future, None if layers is None else layers[n], error)
        if error is None:
            for _ in self.futures:
                self.source.layer_done(self.found, self.generation)


class JoinedChunks:
    """The chunks of one request (``KVLoader.open``): a run of layers that a trusted tier
    (memory, GPU) serves is decoded for every chunk that can join it in one call
    (``format.decode_chunk_runs``) where ``KVLoader.join_chunks`` (on a GPU; see
    ``loader.JOIN_ON_CPU``), else chunk by chunk. On a 2-core CPU (SmolLM2, validation example
    20, 6 passages) decoding each chunk's runs apart was ~19 of reuse's 64 operators a
    layer. Until ``start``, while the chunks are still being located, nothing is decoded, so
    that the first runs find every chunk."""

    def __init__(self, sources: list[StoreLayeredKV], started: bool = True) -> None:
        self.sources = sources
        self.started = started
        self._lock = threading.Lock()  # one joined decode at a time; chunk locks taken inside
        # where decoded chunk by chunk: each quantized chunk's slots in one K and one V
        # buffer of the request, ``[L, H_kv, T, D]`` (``JointSlot``)
        self.slots: dict[StoreLayeredKV, JointSlot] = {}

    def start(self) -> None:
        """Every chunk located: lay out the joint buffers, then decode the first layers of
        each (``StoreLayeredKV.schedule_first``)."""
        self.started = True
        if self.sources and not self.sources[0].loader.join_chunks:
            self.slots = joint_slots(self.sources)
        for source in self.sources:
            source.schedule_first()

    def fetch(self, asker: StoreLayeredKV, first: int) -> None:
        """Decode the run of layers from ``first`` of ``asker`` and of every chunk that can
        join it (``StoreLayeredKV.claim_run``); nothing if ``asker``'s is scheduled."""
        if not self.started:
            return
        with self._lock:
            lead = asker.claim_run(first, None)
            if lead is None:
                return
            claims = [lead]
            for source in self.sources if asker.loader.join_chunks else ():
                claim = None if source is asker else source.claim_run(first, lead)
                if claim is not None:
                    claims.append(claim)
            _decode_claims(claims, first, asker.clock)


@dataclass(frozen=True)
class JointSlot:
    """A chunk's tokens in its request's joint K and V buffers (``joint_slots``)."""

    k: torch.Tensor  # [L, H_kv, T, D], every such chunk's tokens side by side in order
    v: torch.Tensor
    start: int
    header: ChunkHeader

    def into(self, header: ChunkHeader, first: int, count: int):
        """Layers ``first .. first+count`` of the chunk's slots (``[count, H_kv, n, D]``
        views), for ``format.decode_layers(into=...)``; None for another copy's header."""
        if header != self.header:
            return None
        at = slice(self.start, self.start + header.num_tokens)
        return self.k[first : first + count, :, at], self.v[first : first + count, :, at]


def joint_slots(sources: Sequence[StoreLayeredKV]) -> dict[StoreLayeredKV, JointSlot]:
    """Where the located quantized chunks of a request decoded one by one go: side by side,
    in request order, in one K and one V buffer (``KV_BUFFERS``: kept for the next request).
    The blender then reads a run of neighbouring chunks' layer as one view
    (``placing.joined_view``): no copy to join them before re-rotating their keys. A chunk
    stored otherwise (another shape or dtype, not quantized) or read from a tier that is not
    trusted (disk, S3: decoded as its bytes are checked) decodes into its own tensors."""
    found = [(s, s.located) for s in sources if s.located is not None]
    quantized = [(s, f.header) for s, f in found if f.tier.trusted and f.header.codec_kind == KIVI]
    if len(quantized) < 2:
        return {}
    loader, first = quantized[0][0].loader, quantized[0][1]

    def shape(header: ChunkHeader) -> tuple:
        dtype = loader.dtype or header.dtype
        return header.num_layers, header.num_kv_heads, header.head_dim, dtype

    alike = [(s, h) for s, h in quantized if shape(h) == shape(first)]
    layers, heads, dim, dtype = shape(first)
    size = (layers, heads, sum(h.num_tokens for _, h in alike), dim)
    k = KV_BUFFERS.empty(size, dtype, loader.device)
    v = KV_BUFFERS.empty(size, dtype, loader.device)
    slots, start = {}, 0
    for source, header in alike:
        slots[source] = JointSlot(k, v, start, header)
        start += header.num_tokens
    return slots


def _decode_claims(claims: list[RunClaim], first: int, clock: LoadClock) -> None:
    """Read each claim's run (one that fails gets its error) and decode them together."""
    read, blocks, got = [], [], 0
    clock.fetch.start()
    try:
        for claim in claims:
            try:
                blocks.append(claim.read())
            except BaseException as err:
                claim.settle(None, err)
                continue
            read.append(claim)
            got += blocks[-1].numel()
        if not read:
            return
        count, dtype = len(read[0].futures), read[0].source.loader.dtype
        headers = [claim.found.header for claim in read]
        if len(read) == 1:  # one chunk (not joined; raw layers: views of the tier's copy)
            slot = read[0].source.joint_slot
            into = None if slot is None else slot.into(headers[0], first, count)
            runs = [decode_layers(headers[0], first, count, blocks[0], dtype=dtype, into=into)]
        else:
            runs = decode_chunk_runs(headers, first, count, blocks, dtype=dtype)
    except BaseException as err:
        for claim in read:
            claim.settle(None, err)
        return
    finally:
        clock.fetch.stop(got)
    for claim, (k, v) in zip(read, runs, strict=True):
        claim.settle([(k[n], v[n]) for n in range(count)])


def settle_future(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless it was cancelled meanwhile (the chunk was skipped)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
