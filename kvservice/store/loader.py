"""Pipelined per-layer loading of chunk KV from the store.

:meth:`KVLoader.open` locates every chunk (in parallel) and returns a :class:`LoadBatch` of
:class:`StoreLayeredKV` sources, one per chunk, each a ``LayeredKV``
(``kvservice.store.layered``; a request's chunks decoded together, ``kvservice.store.joined``;
its figures, ``kvservice.store.batch``). While the engine uses
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
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import torch

from kvservice.protocol.keys import ChunkKey
from kvservice.store.batch import LoadBatch, LoadClock
from kvservice.store.compute_threads import single_threaded
from kvservice.store.joined import JoinedChunks
from kvservice.store.layered import StoreLayeredKV
from kvservice.store.tiered import RecomputeFn, TieredStore

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

# Whether the chunks of a request are decoded together (``JoinedChunks``) where the layers are
# decoded on the host. Their operators fall, but on the CPU the time rises: one call over every
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


def _start_fetch_thread(nice: int) -> None:
    """A fetch thread runs torch on one core (``kvservice.store.compute_threads``) and below the
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
        from those tiers in one call (``JoinedChunks``; default: where the layers are decoded
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
            max_workers=workers,
            thread_name_prefix="kv-load",
            initializer=_start_fetch_thread,
            initargs=nice,
        )
        self.stream_threads = store.config.stream_threads
        self.stream_executor = ThreadPoolExecutor(
            max_workers=self.stream_threads,
            thread_name_prefix="kv-stream",
            initializer=_start_fetch_thread,
            initargs=nice,
        )

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on a fetch thread (inside :data:`task_context`, when set)."""
        return self.executor.submit(_in_task_context, fn, *args)

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
        clock = LoadClock()
        joined = JoinedChunks([], started=False)
        joined.sources += [
            StoreLayeredKV(
                self,
                key,
                None if token_ids is None else token_ids[i],
                recompute_fn,
                clock,
                joined,
            )
            for i, key in enumerate(keys)
        ]
        sources = joined.sources
        started = time.perf_counter()
        located = [self.submit(source.locate) for source in sources]
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
                for future in source.scheduled().values():
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
