"""Continuous batching for the inference worker: one thread owns the model; requests join
the running decode batch as soon as their (blended) prefill is done and leave it when they
finish, so concurrent questions share every decode step.

Request threads call :meth:`ContinuousBatcher.submit` and get their tokens through a
callback; the loop thread alternates between admitting new requests (prefill, one at a
time: prefill already uses every core) and one batched decode step for all active rows.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvservice.blend.prefill import BlendResult
from kvservice.model.decode_graph import DecodeGraph
from kvservice.model.transformer import KVCache, Transformer
from kvservice.serve.compute_threads import use_threads
from kvservice.serve.sampling import (
    Detokenizer,
    SamplingParams,
    StopStrings,
    TokenHistory,
    new_generator,
    sample_next,
)

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One request in the batcher. ``prefill`` runs on the loop thread (it needs the model);
    ``on_token(text, token_id)`` and ``on_finish(reason, error)`` are called from it too."""

    prefill: Callable[[int], BlendResult]  # extra_capacity -> prefilled batch-1 cache
    sampling: SamplingParams
    stop_ids: set[int]
    on_token: Callable[[str, int], None]
    on_finish: Callable[[str, BaseException | None], None]
    should_stop: Callable[[], bool] = lambda: False
    deadline: float = float("inf")  # time.monotonic() after which the request is cut off
    prompt_ids: Sequence[int] = ()  # what the repetition penalty counts as seen
    on_prefill: Callable[[BlendResult, float], None] | None = None  # (result, seconds)
    # progressive blend: (result, first token) -> the cache upgraded with that token, or None
    refresh: Callable[[BlendResult, int], BlendResult | None] | None = None
    # Filled in by the batcher:
    started: float = 0.0
    ttft_s: float | None = None
    prefill_result: BlendResult | None = None
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    detokenizer: Detokenizer | None = None
    history: TokenHistory | None = None
    stop_strings: StopStrings | None = None


class ContinuousBatcher:
    def __init__(
        self, model: Transformer, tokenizer, *, max_batch: int = 8, threads: int | None = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        # The batch's torch threads: by default the count of the thread that builds it.
        self.threads = threads or torch.get_num_threads()
        self._incoming: queue.Queue[Job] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        # The running batch: one row per active job.
        self._jobs: list[Job] = []
        self._cache: KVCache | None = None
        self._positions: torch.Tensor | None = None  # [B] position of each row's next token
        self._next_tokens: torch.Tensor | None = None  # [B] last sampled token per row
        # The batch cache's step recorded as a CUDA graph, where passes are (a GPU with
        # ENGINE_COMPILE on); a new one whenever the batch's rows change.
        self._decoder: DecodeGraph | None = None
        self.steps = 0
        self.max_rows_seen = 0

    def start(self) -> ContinuousBatcher:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def submit(self, job: Job) -> None:
        job.started = time.perf_counter()
        self._incoming.put(job)

    @property
    def active(self) -> int:
        return len(self._jobs)

    # -- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        # the one thread with an OpenMP team (kvservice.serve.compute_threads)
        use_threads(self.threads)
        while not self._stop.is_set():
            try:
                if len(self._jobs) < self.max_batch:
                    block = not self._jobs
                    try:
                        job = self._incoming.get(block=block, timeout=0.2 if block else None)
                    except queue.Empty:
                        job = None
                    if job is not None:
                        self._admit(job)
                        continue  # admit every waiting job before the next decode step
                if self._jobs:
                    self._decode_step()
            except Exception:  # never let the loop die: fail the batch, keep serving
                log.exception("batcher step failed; failing the running requests")
                for job in self._jobs:
                    self._finish(job, "error", RuntimeError("the engine failed on this batch"))
                self._reset()

    @torch.no_grad()
    def _admit(self, job: Job) -> None:
        try:
            began = time.perf_counter()
            result = job.prefill(job.sampling.max_tokens)
            if job.on_prefill is not None:
                job.on_prefill(result, time.perf_counter() - began)
        except Exception as err:
            log.exception("prefill failed")
            self._finish(job, "error", err)
            return
        job.prefill_result = result
        job.generator = new_generator(job.sampling.seed, self.model.device)
        job.detokenizer = Detokenizer(self.tokenizer)
        job.history = TokenHistory(job.prompt_ids)
        job.stop_strings = StopStrings(job.sampling.stop)
        token = int(sample_next(result.logits[None], job.sampling, job.generator, job.history)[0])
        job.ttft_s = time.perf_counter() - job.started
        if self._emit(job, token):
            return  # finished on its first token
        try:  # progressive blend: the cache upgraded before the second token
            upgraded = job.refresh(result, token) if job.refresh is not None else None
        except Exception as err:
            log.exception("refresh failed")
            self._finish(job, "error", err)
            return
        if upgraded is not None:  # it holds the first token: its logits give the second
            result = upgraded
            token = int(sample_next(result.logits[None], job.sampling, job.generator,
                                    job.history)[0])  # fmt: skip
            if self._emit(job, token):
                return
        self._add_row(job, result, token)

    def _emit(self, job: Job, token: int) -> bool:
        """Hand one sampled token to the job; True when the job is finished."""
        if token in job.stop_ids:
            self._finish(job, "stop")
            return True
        job.tokens.append(token)
        job.history.observe(token)
        text = job.stop_strings.push(job.detokenizer.push(token))
        reason, error = None, None
        if job.stop_strings.stopped:
            reason = "stop"
        elif len(job.tokens) >= job.sampling.max_tokens:
            reason = "length"
        elif job.should_stop():
            reason = "stopped"
        elif time.monotonic() > job.deadline:
            reason, error = "error", TimeoutError("the request ran past its time limit")
        if reason not in (None, "stop"):
            text += job.stop_strings.flush()  # what turned out not to start a stop string
        job.on_token(text, token)
        if reason is None:
            return False
        self._finish(job, reason, error)
        return True

    def _finish(self, job: Job, reason: str, error: BaseException | None = None) -> None:
        try:
            job.on_finish(reason, error)
        except Exception:
            log.exception("on_finish callback failed")

    def _add_row(self, job: Job, result: BlendResult, token: int) -> None:
        """Merge the job's prefilled cache into the running batch as a new row."""
        config, device = self.model.config, self.model.device
        n = result.num_tokens
        old = self._cache
        length = max(n, old.length if old is not None else 0)
        remaining = [j.sampling.max_tokens - len(j.tokens) for j in (*self._jobs, job)]
        capacity = length + max(remaining) + 1
        rows = len(self._jobs) + 1
        cache = KVCache(config, rows, capacity, device, result.cache.k.dtype)
        if old is not None:
            used = old.length
            cache.k[:, : rows - 1, :, :used] = old.k[:, :, :, :used]
            cache.v[:, : rows - 1, :, :used] = old.v[:, :, :, :used]
            cache.positions[: rows - 1, :used] = old.positions[:, :used]
            cache.valid[: rows - 1, :used] = old.valid[:, :used]
        cache.k[:, rows - 1, :, :n] = result.cache.k[:, 0, :, :n]
        cache.v[:, rows - 1, :, :n] = result.cache.v[:, 0, :, :n]
        cache.positions[rows - 1, :n] = result.cache.positions[0, :n]
        cache.valid[rows - 1, :n] = True
        cache.length = length
        self._cache, self._decoder = cache, None
        self._jobs.append(job)
        new_position = torch.tensor([n], device=device)
        new_token = torch.tensor([token], device=device)
        self._positions = (
            new_position if self._positions is None else torch.cat([self._positions, new_position])
        )
        self._next_tokens = (
            new_token if self._next_tokens is None else torch.cat([self._next_tokens, new_token])
        )
        job.prefill_result = None  # its cache now lives in the batch
        self.max_rows_seen = max(self.max_rows_seen, rows)

    @torch.no_grad()
    def _decode_step(self) -> None:
        cache = self._cache
        assert cache is not None and self._positions is not None and self._next_tokens is not None
        if cache.length + 1 > cache.capacity:  # cannot happen: capacity covers max_tokens
            raise RuntimeError("decode cache overflow")
        if self._graphed():
            if self._decoder is None:
                self._decoder = DecodeGraph(self.model, cache)
            logits = self._decoder.step(self._next_tokens, self._positions)
        else:
            logits, _ = self.model(self._next_tokens[:, None], self._positions[:, None], cache)
        self.steps += 1
        self._positions = self._positions + 1
        keep: list[int] = []
        next_tokens: list[int] = []
        for row, job in enumerate(self._jobs):
            token = int(
                sample_next(logits[row : row + 1], job.sampling, job.generator, job.history)[0]
            )
            if not self._emit(job, token):
                keep.append(row)
                next_tokens.append(token)
        if len(keep) == len(self._jobs):
            self._next_tokens = torch.tensor(next_tokens, device=self.model.device)
            return
        if not keep:
            self._reset()
            return
        index = torch.tensor(keep, device=self.model.device)
        self._decoder = None  # new tensors: a new recording
        cache.k = cache.k.index_select(1, index)
        cache.v = cache.v.index_select(1, index)
        cache.positions = cache.positions.index_select(0, index)
        cache.valid = cache.valid.index_select(0, index)
        self._jobs = [self._jobs[row] for row in keep]
        self._positions = self._positions.index_select(0, index)
        self._next_tokens = torch.tensor(next_tokens, device=self.model.device)

    def _graphed(self) -> bool:
        model = self.model
        return model.device.type == "cuda" and getattr(model, "pass_graphs", None) is not None

    def _reset(self) -> None:
        self._jobs, self._cache, self._positions, self._next_tokens = [], None, None, None
        self._decoder = None
