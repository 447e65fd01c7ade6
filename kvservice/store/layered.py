"""One chunk's KV served layer by layer from the store (:class:`StoreLayeredKV`, a
``LayeredKV``): located in the fastest tier holding a valid copy, its layers fetched ahead of
their use (a ranged read per run of layers from disk, one sequential stream from S3, views of
a memory or GPU copy), verified, decoded, and on a fault read from the next tier or
recomputed. :class:`kvservice.store.loader.KVLoader` opens them, a request's at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from kvservice.chunk import ChunkKV
from kvservice.protocol.errors import ChunkCorrupt, ChunkMissing, ChunkTruncated, ChunkUnavailable
from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.objects import K_PRE_ROPE, read_fully
from kvservice.store.format import (
    Buffer,
    ChunkHeader,
    as_uint8,
    decode_layer,
    decode_layers,
    decode_token_ids,
    joinable,
    layer_bytes,
    layer_run,
)
from kvservice.store.joined import RunClaim, settle_future
from kvservice.store.tiered import Located, RecomputeFn

if TYPE_CHECKING:
    from kvservice.store.batch import LoadClock
    from kvservice.store.joined import JoinedChunks, JointSlot
    from kvservice.store.loader import KVLoader

LayerKV = tuple[torch.Tensor, torch.Tensor]

# From disk, at most this many stored bytes a run: a run's first layer waits for the
# whole run's read, checksums and copy. With runs of 32 (``loader.DECODE_LAYERS``; an H200,
# 4,096 tokens, 6 chunks), the default codec's 22 MB runs took reuse from disk
# 0.465 -> 0.126 s, while fp16's 87 MB runs took it 0.199 -> 0.431 s (full prefill 0.12).
# Measured on an H100 (stop 45, docs/long_context_gpu/h100_2026-11-26b_disk_cap.txt):
# against no cap, 16 MiB took fp16 from disk 0.457 -> 0.28-0.31 s at 4,096 tokens and
# 1.72 -> 0.68-0.78 s at 16,384; 4 MiB was better for fp16 (0.23-0.25 / 0.57 s) but worse
# for the default codec at 16,384 (0.56 s / 0.34 s).
DISK_RUN_BYTES = 16 << 20


class StoreLayeredKV:
    """One chunk's KV, served layer by layer from the store with prefetch."""

    def __init__(
        self,
        loader: KVLoader,
        key: ChunkKey,
        token_ids: Sequence[int] | None,
        recompute_fn: RecomputeFn | None,
        clock: LoadClock,
        joined: JoinedChunks,
    ) -> None:
        self.key = key
        self.head_hash = key.head_hash  # the blender checks it against its prompt head
        self.model_fingerprint = key.model_fingerprint
        self.loader = loader
        self._store = loader.store
        self._token_ids = None if token_ids is None else list(token_ids)
        self._recompute_fn = recompute_fn
        self.clock = clock
        self.joined = joined  # the request's chunks, decoded together where they can be
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
        self._schedule(range(index, min(self.num_layers, index + 1 + self.loader.prefetch_depth)))
        future = self._futures.get(index)
        return future is None or future.done()

    def layer(self, index: int) -> LayerKV:
        self._wait_ready()
        if self._chunk is not None:
            return self._chunk.layer(index)
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} of {self.num_layers}")
        self._schedule(range(index, min(self.num_layers, index + 1 + self.loader.prefetch_depth)))
        future = self._futures[index]
        started = time.perf_counter()
        try:
            return future.result()
        except ChunkUnavailable as err:
            self._fail_over(err)
        finally:
            self.clock.add_wait(time.perf_counter() - started)
        return self.layer(index)

    @property
    def located(self) -> Located | None:
        """The copy being read (None: not located yet, recomputed, skipped or failing over)."""
        return self._located

    @property
    def joint_slot(self) -> JointSlot | None:
        """Where this chunk decodes into its request's joint buffers, if it does."""
        return self.joined.slots.get(self)

    def scheduled(self) -> dict[int, Future[LayerKV]]:
        """The layers scheduled so far, each with its future (a copy)."""
        with self._lock:
            return dict(self._futures)

    # -- locating -----------------------------------------------------------------------------

    def _wait_ready(self) -> None:
        if not self._ready.is_set():
            started = time.perf_counter()
            self._ready.wait()
            self.clock.add_wait(time.perf_counter() - started)
        if self._error is not None:
            raise self._error

    def locate(self, start_at: int = 0) -> None:
        """Find the chunk (a fetch thread at open, or the consumer after a fault)."""
        self.clock.fetch.start()
        nbytes = 0
        try:
            found = self._store.locate(self.key, start_at=start_at)
            if found.header.k_storage != K_PRE_ROPE:
                raise ChunkCorrupt(f"{self.key} stores post-RoPE K; the engine wants pre-RoPE K")
            nbytes = found.header.header_len
            self._use(found)
        except ChunkUnavailable as err:
            self.clock.fetch.stop(nbytes)
            self._recover(err)
            return
        except BaseException as err:  # surface unexpected errors to the consumer
            self.clock.fetch.stop(nbytes)
            self._error = err
            self._ready.set()
            return
        self.clock.fetch.stop(nbytes)
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
            if not found.tier.trusted and self.loader.promote:
                self._buffer = bytearray(header.total_bytes)
                head = memoryview(found.head).cast("B")[: header.header_len]
                self._buffer[: header.header_len] = head
        if found.tier.streams and not found.tier.trusted:
            self._start_stream(found)
            return
        self.schedule_first()

    def schedule_first(self) -> None:
        """Schedule the layers wanted as soon as the chunk is located: all of them without
        pipelining, else the first and those prefetched behind it."""
        loader = self.loader
        depth = self.num_layers if not loader.pipeline else 1 + loader.prefetch_depth
        self._schedule(range(min(self.num_layers, depth)))

    def _recover(self, err: ChunkUnavailable) -> None:
        self.clock.add_fault()
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
        self.locate(start_at=located.tier_index + 1)
        self.loader.read_streams([self])
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
                        self.loader.submit(self._fetch_run, found, run, generation)
                return
        # memory / device: a view, no thread hop worth paying; read inline with the other
        # chunks of the request (outside this chunk's lock: the group takes each in turn)
        for index in layers:
            self.joined.fetch(self, index)

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
        self.clock.fetch.start()
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
                        self.clock.fetch.stop(got)
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
                self.clock.fetch.stop(got)
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
        if raw.device != self.loader.device:
            raw = raw.to(self.loader.device, non_blocking=True)
        return decode_layer(header, index, raw, verify=False, dtype=self.loader.dtype)

    def _run_futures(
        self, header: ChunkHeader, first: int, max_bytes: int | None = None
    ) -> dict[int, Future[LayerKV]]:
        """A future for each layer of the run from ``first`` that decodes in one call
        (``layer_run``, at most the loader's ``decode_layers``, and, with
        ``max_bytes``, as many stored bytes), up to one already scheduled."""
        most = self.loader.decode_layers
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
        tier's runs are decoded with the request's other chunks: ``JoinedChunks``). On a GPU
        disk's layers read and decoded one by one were 3.9x full prefill's time (Llama-3-8B's
        shape, 4,096 tokens, 6 chunks, an H200): a layer's decode is kernel launches, and the
        fetch threads' contend with the prefill's for the GIL."""
        header, tier = found.header, found.tier
        first, last = min(futures), max(futures)
        start = header.layer_offset(first)
        self.clock.fetch.start()
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
            if raw.device != self.loader.device:  # from pinned memory: not waited for
                raw = raw.to(self.loader.device, non_blocking=True)
            k, v = decode_layers(header, first, len(futures), raw, dtype=self.loader.dtype)
        except BaseException as err:
            for future in futures.values():
                settle_future(future, error=err)
            return  # not done: a copy that failed a check is never promoted
        finally:
            self.clock.fetch.stop(got)
        for n, future in enumerate(futures.values()):
            settle_future(future, (k[n], v[n]))
        for _ in futures:
            self.layer_done(found, generation)

    def claim_run(self, first: int, lead: RunClaim | None) -> RunClaim | None:
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
            return RunClaim(self, found, futures, self._generation)

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

    def layer_done(self, found: Located, generation: int) -> None:
        """One layer of ``found`` (read as of ``generation``) is in: the whole copy promoted
        into the faster tiers once every layer is."""
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
