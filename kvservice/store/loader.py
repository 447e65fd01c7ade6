"""Pipelined per-layer loading of chunk KV from the store.

:meth:`KVLoader.open` locates every chunk (in parallel) and returns a :class:`LoadBatch` of
:class:`StoreLayeredKV` sources, one per chunk, each a ``LayeredKV``. While the engine uses
layer ``i`` of a chunk, layers ``i+1 .. i+prefetch_depth`` of that chunk are already being
fetched by background threads: one ranged read per layer per chunk (an S3 ranged GET, a
disk ``pread``, a memory slice), verified against the layer's crc32 and viewed as K/V
without a copy. Objects read from disk or S3 are assembled in one buffer as they arrive and
promoted into the faster tiers once complete.

Timing: ``load_s`` is the wall time during which any fetch was in flight (what loading
would cost un-hidden), ``wait_s`` the time the engine was blocked in ``.layer()``; the
hidden fraction is ``1 - wait_s / load_s``. With ``pipeline=False`` every layer of every
chunk is loaded before ``open`` returns (the load-then-compute baseline): nothing hidden.

A fault while loading (missing, corrupt, truncated, another model's object, S3 down) falls
back to the next tier holding a valid copy, else to ``recompute_fn(token_ids)`` through
:meth:`TieredStore.recover` (counted, logged, object replaced), else raises.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvservice.chunk import ChunkKV
from kvservice.model.buffers import KV_BUFFERS
from kvservice.serve.compute_threads import single_threaded
from kvservice.store import codec as codecs
from kvservice.store.base import ReadMeter, read_fully
from kvservice.store.errors import ChunkCorrupt, ChunkMissing, ChunkTruncated, ChunkUnavailable
from kvservice.store.format import (
    K_PRE_ROPE,
    Buffer,
    ChunkHeader,
    as_uint8,
    decode_chunk_runs,
    decode_layer,
    decode_layers,
    decode_token_ids,
    joinable,
    layer_bytes,
    layer_run,
)
from kvservice.store.keys import ChunkKey
from kvservice.store.tiered import Located, RecomputeFn, TieredStore

LayerKV = tuple[torch.Tensor, torch.Tensor]

# Layers of a chunk decoded in one call on CUDA, where a layer's decoding was launch-bound:
# 12 chunks of 1,360 tokens of Llama-3-8B on an H100, the default codec decoded at 11 GB/s of
# fp16 KV layer by layer (0.33 s of a 0.47 s reuse), 53 GB/s in runs of 8 (README). Runs of
# up to 32 (a run still ends where the bits change: the default codec's two widths make two
# runs of a 32-layer chunk) on an H200, 12 chunks: reuse at 4,096 tokens 0.135 -> 0.098-0.105 s,
# blend 0.15 at 16,384 0.35-0.38 -> 0.30-0.31 s. A run's decoded layers are held until the
# pass has read them all: at most the chunk's KV at the cache's width, as its fp16 object is.
# On the CPU too (2-core AMD EPYC, SmolLM2, validation examples 20-21, 6 passages, memory
# tier): layer by layer, reuse dispatched 330 operators a layer (full prefill 49-53: the
# decoder's bit unpacking per chunk and layer), in runs 79, with the same logits.
DECODE_LAYERS = 32
# ... and from disk, at most this many stored bytes a run: a run's first layer waits for the
# whole run's read, checksums and copy. With runs of 32 (an H200, 4,096 tokens, 6 chunks),
# the default codec's 22 MB runs took reuse from disk 0.465 -> 0.126 s, while fp16's 87 MB
# runs took it 0.199 -> 0.431 s (full prefill 0.12). Measured on an H100 (stop 45,
# docs/long_context_gpu/h100_2026-11-26b_disk_cap.txt): against no cap, 16 MiB took fp16 from disk
# 0.457 -> 0.28-0.31 s at 4,096 tokens and 1.72 -> 0.68-0.78 s at 16,384; 4 MiB was better
# for fp16 (0.23-0.25 / 0.57 s) but worse for the default codec at 16,384 (0.56 s / 0.34 s).
DISK_RUN_BYTES = 16 << 20

# Whether the chunks of a request are decoded together (``_Joined``) where the layers are decoded
# on the host. Their operators fall, but on the CPU the time rises: one call over every
# chunk streams its tensors through memory where a chunk's fit in the cache (2-core AMD EPYC,
# 32 MiB L3, 6 chunks of ~630 tokens of SmolLM2, the default codec, bfloat16, 2 threads,
# quiet: layers 4-29 in 276 ms joined against 80 ms chunk by chunk, layers 0-3 12.6 against
# 6.6 ms; reuse's operators a layer 67.2 -> 50.5 with the same logits). On a GPU a decode's
# operators are launches and its time (issue #47): there they are joined.
JOIN_ON_CPU = False

# What every fetch task runs inside, when set (None: nothing): how a bench counts the operators
# a request dispatches on the loader's threads as well as its own (bench.opcount; a dispatch
# mode or the profiler sees only the thread it was entered on).
task_context: Callable[[], AbstractContextManager[Any]] | None = None


def _in_task_context(fn: Callable[..., Any], *args: Any) -> Any:
    if task_context is None:
        return fn(*args)
    with task_context():
        return fn(*args)


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


class _Clock:
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


class StoreLayeredKV:
    """One chunk's KV, served layer by layer from the store with prefetch."""

    def __init__(
        self,
        loader: KVLoader,
        key: ChunkKey,
        token_ids: Sequence[int] | None,
        recompute_fn: RecomputeFn | None,
        clock: _Clock,
        joined: _Joined | None = None,
    ) -> None:
        self.key = key
        self.head_hash = key.head_hash  # the blender checks it against its prompt head
        self.model_fingerprint = key.model_fingerprint
        self._loader = loader
        self._store = loader.store
        self._token_ids = None if token_ids is None else list(token_ids)
        self._recompute_fn = recompute_fn
        self._clock = clock
        self._joined = _Joined([self]) if joined is None else joined
        self._lock = threading.RLock()  # the located copy and the futures
        self._ready = threading.Event()  # set once located (or recomputed)
        self._located: Located | None = None
        self._chunk: ChunkKV | None = None  # after a fault: the recomputed chunk
        self._futures: dict[int, Future[LayerKV]] = {}
        self._generation = 0  # bumped when switching to another source after a fault
        self._buffer: bytearray | None = None  # the whole object, for promotion
        self._pending_stream: Iterator[None] | None = None  # located, not yet being read
        self._layers_done = 0
        self._error: BaseException | None = None
        self.skipped = False  # the loading controller chose to recompute it (skip)
        self.num_layers = 0
        self.tier = "?"
        if self._token_ids is not None:
            self.token_ids = self._token_ids  # what the blender recomputes from
            self.num_tokens = len(self._token_ids)

    # -- LayeredKV ----------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name == "num_tokens":  # unknown until the header arrives
            self._wait_ready()
            return self.__dict__["num_tokens"]
        raise AttributeError(name)

    def layer_ready(self, index: int) -> bool:
        """Whether ``layer(index)`` would return without waiting for the store: a prefill
        asks first, and pauses while it would (the batch's decode steps go on meanwhile)."""
        if not self._ready.is_set():
            return False
        if self._chunk is not None or self._error is not None:
            return True
        self._schedule(range(index, min(self.num_layers, index + 1 + self._loader.prefetch_depth)))
        future = self._futures.get(index)
        return future is None or future.done()

    def layer(self, index: int) -> LayerKV:
        self._wait_ready()
        if self._chunk is not None:
            return self._chunk.layer(index)
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} of {self.num_layers}")
        self._schedule(range(index, min(self.num_layers, index + 1 + self._loader.prefetch_depth)))
        future = self._futures[index]
        started = time.perf_counter()
        try:
            return future.result()
        except ChunkUnavailable as err:
            self._fail_over(err)
        finally:
            self._clock.add_wait(time.perf_counter() - started)
        return self.layer(index)

    # -- locating -----------------------------------------------------------------------------

    def _wait_ready(self) -> None:
        if not self._ready.is_set():
            started = time.perf_counter()
            self._ready.wait()
            self._clock.add_wait(time.perf_counter() - started)
        if self._error is not None:
            raise self._error

    def _locate(self, start_at: int = 0) -> None:
        """Find the chunk (worker thread at open, or the consumer after a fault)."""
        self._clock.fetch.start()
        nbytes = 0
        try:
            found = self._store.locate(self.key, start_at=start_at)
            if found.header.k_storage != K_PRE_ROPE:
                raise ChunkCorrupt(f"{self.key} stores post-RoPE K; the engine wants pre-RoPE K")
            nbytes = found.header.header_len
            self._use(found)
        except ChunkUnavailable as err:
            self._clock.fetch.stop(nbytes)
            self._recover(err)
            return
        except BaseException as err:  # surface unexpected errors to the consumer
            self._clock.fetch.stop(nbytes)
            self._error = err
            self._ready.set()
            return
        self._clock.fetch.stop(nbytes)
        self._ready.set()

    def _use(self, found: Located) -> None:
        header = found.header
        with self._lock:
            self._generation += 1
            self._futures = {}
            self._located = found
            self._layers_done = 0
            self.num_layers = header.num_layers
            self.num_tokens = header.num_tokens
            self.tier = found.tier.name
            self._buffer = None
            if not found.tier.trusted and self._loader.promote:
                self._buffer = bytearray(header.total_bytes)
                head = memoryview(found.head).cast("B")[: header.header_len]
                self._buffer[: header.header_len] = head
        if found.tier.streams and not found.tier.trusted:
            self._start_stream(found)
            return
        self._schedule_first()

    def _schedule_first(self) -> None:
        """Schedule the layers wanted as soon as the chunk is located: all of them without
        pipelining, else the first and those prefetched behind it."""
        loader = self._loader
        depth = self.num_layers if not loader.pipeline else 1 + loader.prefetch_depth
        self._schedule(range(min(self.num_layers, depth)))

    def _recover(self, err: ChunkUnavailable) -> None:
        self._clock.add_fault()
        if self._recompute_fn is None or self._token_ids is None:
            self._error = err
            self._ready.set()
            return
        try:
            self._chunk = self._store.recover(self.key, self._token_ids, self._recompute_fn, err)
            self.num_layers = self._chunk.num_layers
            self.num_tokens = self._chunk.num_tokens
            self.tier = "recomputed"
        except BaseException as recompute_err:
            self._error = recompute_err
        self._ready.set()

    def _fail_over(self, err: ChunkUnavailable) -> None:
        """A layer failed mid-stream: drop that copy, continue from the next tier or recompute."""
        with self._lock:
            located = self._located
            if located is None:
                return
            self._located = None
        self._store.note_fault(self.key, located.tier, err)
        self._ready.clear()
        self._locate(start_at=located.tier_index + 1)
        self._loader.read_streams([self])
        self._wait_ready()

    # -- fetching -----------------------------------------------------------------------------

    def _schedule(self, layers: range) -> None:
        with self._lock:
            found, generation = self._located, self._generation
            if found is None:
                return
            if not found.tier.trusted:  # disk: read and checked on a fetch thread
                for index in layers:
                    if index not in self._futures:
                        run = self._run_futures(found.header, index, DISK_RUN_BYTES)
                        self._futures.update(run)
                        self._loader.executor.submit(
                            _in_task_context, self._fetch_run, found, run, generation
                        )
                return
        # memory / device: a view, no thread hop worth paying; read inline with the other
        # chunks of the request (outside this chunk's lock: the group takes each in turn)
        for index in layers:
            self._joined.fetch(self, index)

    def _start_stream(self, found: Located) -> None:
        """Every layer's future now, resolved in order by one sequential read that a stream
        reader of the loader advances (``take_stream``)."""
        with self._lock:
            futures: dict[int, Future[LayerKV]] = {i: Future() for i in range(self.num_layers)}
            self._futures = futures
            generation, buffer = self._generation, self._buffer
            self._pending_stream = self._stream(found, generation, futures, buffer)

    def take_stream(self) -> Iterator[None] | None:
        """The located chunk's stream, for the loader to read (once), or None."""
        with self._lock:
            stream, self._pending_stream = self._pending_stream, None
        return stream

    def _stream(
        self,
        found: Located,
        generation: int,
        futures: dict[int, Future[LayerKV]],
        buffer: bytearray | None,
    ) -> Iterator[None]:
        """Read the chunk's layers from one request (``Tier.open_stream``), resolving each
        layer's future as soon as its bytes are in and verified: the engine starts on layer
        0 while later layers arrive, as with per-layer reads, without a signed request (and
        a server round trip) per layer per chunk. Yields after each layer, so that one
        reader thread can take several chunks' streams in turn, layer by layer
        (``KVLoader.read_streams``). A fault fails that layer and every later one; the
        consumer then fails over as after a per-layer read."""
        header, tier = found.header, found.tier
        if buffer is None:  # not promoting: a buffer for the layers only, never zero-filled
            view = memoryview(torch.empty(header.total_bytes, dtype=torch.uint8).numpy())
        else:
            view = memoryview(buffer)
        last = header.num_layers - 1
        self._clock.fetch.start()
        got, timing = 0, True
        try:
            with tier.open_stream(self.key, header.layer_offset(0)) as stream:
                if stream is None:
                    raise ChunkMissing(f"{self.key} vanished from the {tier.name} tier")
                for index in range(header.num_layers):
                    start = header.layer_offset(index)
                    block = view[start : start + header.layer_size(index)]
                    n = read_fully(stream, block)
                    got += n
                    if n < header.layer_size(index):
                        raise ChunkTruncated(f"{self.key}: layer {index} ended after {n} bytes")
                    if index == last and buffer is not None:  # the token ids that follow
                        tokens = view[header.tokens_offset : header.total_bytes]
                        got += read_fully(stream, tokens)
                        decode_token_ids(header, tokens)
                    kv = self._decode(header, index, block)
                    if index == last:  # the load is over before the consumer can see it is
                        self._clock.fetch.stop(got)
                        timing = False
                    futures[index].set_result(kv)
                    yield
        except BaseException as err:  # GeneratorExit too: what is not read fails, never hangs
            for future in futures.values():
                if not future.done():
                    future.set_exception(err)
            return
        finally:
            if timing:
                self._clock.fetch.stop(got)
        with self._lock:
            current = generation == self._generation
        if buffer is not None and current:  # whole and verified: into the faster tiers
            self._store.promote(self.key, buffer, found.tier_index)

    def _decode(self, header: ChunkHeader, index: int, block: Buffer) -> LayerKV:
        """Layer ``index`` of a tier that is not trusted (disk, S3: checksums checked) as K,
        V on the loader's device, in its dtype. The layer's bytes
        cross to the device as they are stored (a quarter of float16's with the default codec)
        and are decoded there, on this fetch thread, straight into the cache's dtype: the
        compute thread then places them with a plain copy. Checksums are checked where the
        bytes arrived (the host)."""
        raw = layer_bytes(header, index, block, verify=True)
        if raw.device != self._loader.device:
            raw = raw.to(self._loader.device, non_blocking=True)
        return decode_layer(header, index, raw, verify=False, dtype=self._loader.dtype)

    def _run_futures(
        self, header: ChunkHeader, first: int, max_bytes: int | None = None
    ) -> dict[int, Future[LayerKV]]:
        """A future for each layer of the run from ``first`` that decodes in one call
        (``layer_run``, at most the loader's ``decode_layers``, and, with
        ``max_bytes``, as many stored bytes), up to one already scheduled."""
        most = self._loader.decode_layers
        if max_bytes is not None:
            most = min(most, max(1, max_bytes // header.layer_size(first)))
        count = layer_run(header, first, most)
        count = next((n for n in range(1, count) if first + n in self._futures), count)
        return {first + n: Future() for n in range(count)}

    def _fetch_run(
        self, found: Located, futures: dict[int, Future[LayerKV]], generation: int
    ) -> None:
        """A run of layers (``_run_futures``) of an untrusted tier (disk): one read on a fetch
        thread (``_read_into``), each layer's checksum checked where the bytes arrived (the
        host), one copy to the device, one decode, each future then resolved (a trusted
        tier's runs are decoded with the request's other chunks: :class:`_Joined`). On a GPU
        disk's layers read and decoded one by one were 3.9x full prefill's time (Llama-3-8B's
        shape, 4,096 tokens, 6 chunks, an H200): a layer's decode is kernel launches, and the
        fetch threads' contend with the prefill's for the GIL."""
        header, tier = found.header, found.tier
        first, last = min(futures), max(futures)
        start = header.layer_offset(first)
        self._clock.fetch.start()
        got = 0
        try:
            block, got = self._read_into(found, first, last)
            if block is not None:  # checked where the bytes arrived
                for index in futures:
                    layer_bytes(header, index, block[header.layer_offset(index) - start :])
                if last == header.num_layers - 1 and self._buffer is not None:
                    tokens = memoryview(self._buffer)[header.tokens_offset :]
                    decode_token_ids(header, tokens)
            if block is None:
                raise ChunkUnavailable(f"{self.key} vanished from the {tier.name} tier")
            raw = as_uint8(block)
            if raw.device != self._loader.device:  # from pinned memory: not waited for
                raw = raw.to(self._loader.device, non_blocking=True)
            k, v = decode_layers(header, first, len(futures), raw, dtype=self._loader.dtype)
        except BaseException as err:
            for future in futures.values():
                _settle(future, error=err)
            return  # not done: a copy that failed a check is never promoted
        finally:
            self._clock.fetch.stop(got)
        for n, future in enumerate(futures.values()):
            _settle(future, (k[n], v[n]))
        for _ in futures:
            self._layer_done(found, generation)

    def _claim_run(self, first: int, lead: _Claim | None) -> _Claim | None:
        """This chunk's run of layers from ``first`` (``_run_futures``), its futures now
        registered, if a trusted tier serves it, it is not yet scheduled, and, with ``lead``
        (the run another chunk claimed), it decodes with it: as long a run, stored alike
        (``joinable``) and quantized (raw layers in the cache's dtype are views, no work to
        share). Else None."""
        with self._lock:
            found = self._located
            if found is None or not found.tier.trusted or first in self._futures:
                return None
            if not 0 <= first < self.num_layers:
                return None
            header = found.header
            futures = self._run_futures(header, first)
            if lead is not None and not (
                len(futures) == len(lead.futures)
                and header.quantized
                and lead.found.header.quantized
                and joinable(lead.found.header, header, first)
            ):
                return None
            self._futures.update(futures)
            return _Claim(self, found, futures, self._generation)

    def _read_into(self, found: Located, first: int, last: int) -> tuple[Buffer | None, int]:
        """An untrusted tier's layers ``first..last`` (None if the object vanished) and the
        bytes read: into the promotion buffer when there is one, with the token ids that
        follow the last layer."""
        header = found.header
        start = header.layer_offset(first)
        stop = header.layer_offset(last) + header.layer_size(last)
        promoting = self._buffer is not None
        end = header.total_bytes if last == header.num_layers - 1 and promoting else stop
        buffer = self._buffer if promoting else bytearray(end - start)
        offset = start if promoting else 0
        out = memoryview(buffer)[offset : offset + end - start]
        n = found.tier.read_into(self.key, start, out)
        return (None, 0) if n is None else (out[: stop - start], n)

    def _layer_done(self, found: Located, generation: int) -> None:
        with self._lock:
            if generation != self._generation:
                return
            self._layers_done += 1
            complete = self._layers_done == found.header.num_layers
            buffer = self._buffer
        if complete and buffer is not None:
            self._store.promote(self.key, buffer, found.tier_index)

    def loaded_bytes(self) -> int:
        found = self._located
        return 0 if found is None else found.header.layers_bytes

    def skip(self) -> None:
        """Read nothing more of this chunk: the loading controller chose to recompute it
        whole (``KVLoader.open(choose=...)``). Fetches already queued are cancelled."""
        with self._lock:
            self._generation += 1
            self._located, self._pending_stream, self._buffer = None, None, None
            futures, self._futures = self._futures, {}
            self.tier, self.skipped = "recomputed", True
        for future in futures.values():
            future.cancel()


@dataclass
class _Claim:
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
        device = source._loader.device
        return raw if raw.device == device else raw.to(device, non_blocking=True)

    def settle(self, layers: Sequence[LayerKV] | None, error: BaseException | None = None) -> None:
        """Resolve each future with its layer, or every one with ``error``."""
        for n, future in enumerate(self.futures.values()):
            _settle(future, None if layers is None else layers[n], error)
        if error is None:
            for _ in self.futures:
                self.source._layer_done(self.found, self.generation)


class _Joined:
    """The chunks of one request (``KVLoader.open``): a run of layers that a trusted tier
    (memory, GPU) serves is decoded for every chunk that can join it in one call
    (``format.decode_chunk_runs``) where ``KVLoader.join_chunks`` (on a GPU; see
    :data:`JOIN_ON_CPU`), else chunk by chunk. On a 2-core CPU (SmolLM2, validation example
    20, 6 passages) decoding each chunk's runs apart was ~19 of reuse's 64 operators a
    layer. Until ``start``, while the chunks are still being located, nothing is decoded, so
    that the first runs find every chunk."""

    def __init__(self, sources: list[StoreLayeredKV], started: bool = True) -> None:
        self.sources = sources
        self.started = started
        self._lock = threading.Lock()  # one joined decode at a time; chunk locks taken inside
        # where decoded chunk by chunk: each quantized chunk's slots in one K and one V
        # buffer of the request, ``[L, H_kv, T, D]`` (``_JointSlot``)
        self.slots: dict[StoreLayeredKV, _JointSlot] = {}

    def start(self) -> None:
        """Every chunk located: lay out the joint buffers, then decode the first layers of
        each (``_schedule_first``)."""
        self.started = True
        if self.sources and not self.sources[0]._loader.join_chunks:
            self.slots = _joint_slots(self.sources)
        for source in self.sources:
            source._schedule_first()

    def fetch(self, asker: StoreLayeredKV, first: int) -> None:
        """Decode the run of layers from ``first`` of ``asker`` and of every chunk that can
        join it (``StoreLayeredKV._claim_run``); nothing if ``asker``'s is scheduled."""
        if not self.started:
            return
        with self._lock:
            lead = asker._claim_run(first, None)
            if lead is None:
                return
            claims = [lead]
            for source in self.sources if asker._loader.join_chunks else ():
                claim = None if source is asker else source._claim_run(first, lead)
                if claim is not None:
                    claims.append(claim)
            _decode_claims(claims, first, asker._clock)


@dataclass(frozen=True)
class _JointSlot:
    """A chunk's tokens in its request's joint K and V buffers (``_joint_slots``)."""

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


def _joint_slots(sources: Sequence[StoreLayeredKV]) -> dict[StoreLayeredKV, _JointSlot]:
    """Where the located quantized chunks of a request decoded one by one go: side by side,
    in request order, in one K and one V buffer (``KV_BUFFERS``: kept for the next request).
    The blender then reads a run of neighbouring chunks' layer as one view
    (``placing.joined_view``): no copy to join them before re-rotating their keys. A chunk
    stored otherwise (another shape or dtype, not quantized) or read from a tier that is not
    trusted (disk, S3: decoded as its bytes are checked) decodes into its own tensors."""
    found = [(s, s._located) for s in sources if s._located is not None]
    quantized = [
        (s, f.header) for s, f in found if f.tier.trusted and f.header.codec_kind == codecs.KIVI
    ]
    if len(quantized) < 2:
        return {}
    loader, first = quantized[0][0]._loader, quantized[0][1]

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
        slots[source] = _JointSlot(k, v, start, header)
        start += header.num_tokens
    return slots


def _decode_claims(claims: list[_Claim], first: int, clock: _Clock) -> None:
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
        count, dtype = len(read[0].futures), read[0].source._loader.dtype
        headers = [claim.found.header for claim in read]
        if len(read) == 1:  # one chunk (not joined; raw layers: views of the tier's copy)
            slot = read[0].source._joined.slots.get(read[0].source)
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


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless it was cancelled meanwhile (the chunk was skipped)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _start_fetch_thread(nice: int) -> None:
    """A fetch thread runs torch on one core (``kvservice.serve.compute_threads``) and below the
    prefill's priority by ``nice`` (Linux schedules threads on their own: a thread id is a
    process id to ``setpriority``), so that on shared cores the prefill's threads go first;
    elsewhere, or without the right, its priority stays as it is."""
    single_threaded()
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:  # relative to the process's own niceness, which the thread started with
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass


def _read_in_turn(streams: list[Iterator[None]]) -> None:
    """Advance each stream by one layer in turn until every one has ended."""
    while streams:
        streams = [stream for stream in streams if next(stream, _ENDED) is not _ENDED]


_ENDED = object()


class LoadBatch:
    """The sources of one request, in the order of the keys given to :meth:`KVLoader.open`."""

    def __init__(self, sources: list[StoreLayeredKV], clock: _Clock, pipelined: bool) -> None:
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
            chunks=len(self.sources), tiers=self.tiers, bytes_read=self._clock.fetch.bytes_read,
            load_s=load_s, wait_s=wait_s, hidden_load_fraction=min(1.0, max(0.0, hidden)),
            pipelined=self.pipelined, faults=self._clock.faults, tier_bytes=self.tier_bytes(),
        )  # fmt: skip


class KVLoader:
    """Opens store-backed ``LayeredKV`` sources; owns the fetch threads (reuse one loader)."""

    def __init__(
        self,
        store: TieredStore,
        *,
        workers: int | None = None,
        prefetch_depth: int | None = None,
        pipeline: bool = True,
        promote: bool = True,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        decode_layers: int | None = None,
        join_chunks: bool | None = None,
    ) -> None:
        """``device`` and ``dtype``: where and as what the layers are decoded, the consumer's
        KV cache's (default: the host, in each object's own 16-bit dtype).
        ``decode_layers``: how many layers of a chunk from memory, the GPU or disk are read
        and decoded in one call (default :data:`DECODE_LAYERS`: on a GPU a layer's decoding
        is mostly kernel launches, and on the CPU each call's ~50 operators were most of the
        operators a reuse dispatched; S3's layers come in one sequential stream, decoded as
        they arrive). ``join_chunks``: decode a run of layers for all of a request's chunks
        from those tiers in one call (:class:`_Joined`; default: where the layers are decoded
        on a GPU, :data:`JOIN_ON_CPU` on the host)."""
        self.store = store
        self.prefetch_depth = (
            store.config.prefetch_depth if prefetch_depth is None else prefetch_depth
        )
        self.pipeline = pipeline
        self.promote = promote
        self.device = torch.device(device)
        self.dtype = dtype
        self.decode_layers = DECODE_LAYERS if decode_layers is None else decode_layers
        on_cpu = self.device.type == "cpu"
        self.join_chunks = (JOIN_ON_CPU or not on_cpu) if join_chunks is None else join_chunks
        workers = store.config.load_workers if workers is None else workers
        nice = (store.config.load_nice,)
        self.executor = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="kv-load",
            initializer=_start_fetch_thread, initargs=nice,
        )  # fmt: skip
        self.stream_threads = store.config.stream_threads
        self.stream_executor = ThreadPoolExecutor(
            max_workers=self.stream_threads, thread_name_prefix="kv-stream",
            initializer=_start_fetch_thread, initargs=nice,
        )  # fmt: skip

    def read_streams(self, sources: Sequence[StoreLayeredKV]) -> None:
        """Start reading the streams of ``sources`` that have one (S3 chunks), dealt round
        robin to at most ``stream_threads`` readers. Each reader takes its chunks in turn, a
        layer at a time, so layer ``i`` of every chunk arrives before layer ``i+1`` of any,
        the order the engine uses them in; on 2 cores more readers took CPU from the prefill
        (docs/loading.md)."""
        streams = [stream for stream in (s.take_stream() for s in sources) if stream is not None]
        readers = min(self.stream_threads, len(streams))
        for r in range(readers):
            self.stream_executor.submit(_in_task_context, _read_in_turn, streams[r::readers])

    def open(
        self,
        keys: Sequence[ChunkKey],
        *,
        token_ids: Sequence[Sequence[int]] | None = None,
        recompute_fn: RecomputeFn | None = None,
        choose: Callable[[Sequence[StoreLayeredKV]], Sequence[bool]] | None = None,
    ) -> LoadBatch:
        """Start loading ``keys``; returns once every chunk is located (or, without
        pipelining, fully loaded). ``token_ids`` (per key) and ``recompute_fn`` enable
        recovery from faults; without them a fault raises from ``.layer()``. ``choose``,
        given the located sources (tier, tokens, ``loaded_bytes``), says which to read; the
        others are skipped before their reads start (``LoadBatch.read``: False), for the
        caller to recompute (the loading controller's per-chunk choice)."""
        if token_ids is not None and len(token_ids) != len(keys):
            raise ValueError("token_ids must have one entry per key")
        clock = _Clock()
        joined = _Joined([], started=False)
        joined.sources += [
            StoreLayeredKV(
                self, key, None if token_ids is None else token_ids[i], recompute_fn, clock,
                joined,
            )
            for i, key in enumerate(keys)
        ]  # fmt: skip
        sources = joined.sources
        started = time.perf_counter()
        located = [self.executor.submit(_in_task_context, source._locate) for source in sources]
        for future in located:
            future.result()
        if choose is not None:
            for source, read in zip(sources, choose(sources), strict=True):
                if not read:
                    source.skip()
        self.read_streams(sources)
        joined.start()
        if not self.pipeline:  # load-then-compute: every layer of every chunk, now
            for source in sources:
                for future in list(source._futures.values()):
                    future.exception()
        clock.add_wait(time.perf_counter() - started)
        return LoadBatch(sources, clock, self.pipeline)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.stream_executor.shutdown(wait=True)

    def __enter__(self) -> KVLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
