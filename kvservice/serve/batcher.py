"""Continuous batching with stall-free steps for the inference worker: one thread owns the
model; requests join the running decode batch as soon as their (blended) prefill is done and
leave it when they finish, so concurrent questions share every decode step.

Request threads call :meth:`ContinuousBatcher.submit` and get their tokens through a
callback. The loop thread runs engine steps: each step is one batched decode step for every
open answer plus a slice of pending prefill work, as many layers of it as fit the step's
budget (``StepBudget``), so no open stream waits longer than one step while other
questions prefill (Sarathi-Serve's stall-free batching, arXiv 2403.02310, here with the
slice run beside the decode step rather than fused into it). With no open answer a prefill
runs whole. The work, one piece at a time, oldest first: a question's prefill up to its
first token (``kvservice.blend.prefill.blend_prefill_steps`` pauses after each layer). A
progressive blend's upgrade (``refresh_steps``) is the lowest-priority work: its answer
joins the batch at once and streams from the first-pass cache while the upgrade runs in the
slices no prefill wants; when it is done, the tokens decoded meanwhile are computed again
over the upgraded cache and the row's cache is replaced (the next tokens read it). One
upgrade runs at a time; one that would start while questions wait, or while another runs,
is skipped, and one whose answer ended first is dropped (the answer's metrics say which).
A question waits in the queue while the batch is full.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvservice.blend.prefill import LOADING, BlendResult
from kvservice.model.decode_graph import DecodeGraph
from kvservice.model.sampling import (
    Detokenizer,
    SamplingParams,
    StopStrings,
    TokenHistory,
    new_generator,
    sample_next,
    starts_word,
)
from kvservice.model.transformer import KVCache, Transformer
from kvservice.protocol import environment
from kvservice.store.compute_threads import use_threads

log = logging.getLogger(__name__)

# ``auto``: a step (decode rows and a prefill slice) aims at this long; the slice gets what
# the measured decode step leaves, and at least MIN_SLICE_S. A reader sees a word once its
# last token is out (the stream holds text back to whole words: AnswerText), and a word is
# up to four or five tokens (a year is four digits): at 0.3 s a step, words came 1.2 s
# apart. So a step aims at 0.12 s (words within ~0.5 s), and at 0.2 s (within ~1 s) only
# while BACKLOG_QUESTIONS or more wait, when the prefills' share decides how long they wait.
PAUSE_TARGET_S = 0.12
BACKLOG_PAUSE_TARGET_S = 0.2
BACKLOG_QUESTIONS = 4
MIN_SLICE_S = 0.05
# ... and the words under way bound it (``StepBudget.slice_s``): no open answer may go longer
# than WORD_PAUSE_S between two words (BACKLOG_WORD_PAUSE_S under a backlog), counting the
# decode steps its word may still need (up to WORD_TOKENS tokens a word). So a step shortens,
# down to no prefill work at all, while an answer is deep in a long word, and under a backlog
# it may run longer (up to MAX_SLICE_S) while every answer has just begun one: a word of one
# token is one step, however long.
WORD_PAUSE_S = 0.42
BACKLOG_WORD_PAUSE_S = 0.85
WORD_TOKENS = 5
MAX_SLICE_S = 0.5
# A progressive upgrade starts once its answer has this many tokens: the stream shows no
# words before the first seven are written (AnswerText holds six back), so an upgrade that
# ran from the first token slowed exactly the steps before the reader's first words (0.3 s
# more to them, unloaded); after them it costs the reader nothing they wait for.
UPGRADE_AFTER_TOKENS = 10
LONG_PIECE_S = 0.3  # a piece of work longer than this while answers stream is logged
# The batch's slots: room for ``max_batch`` rows, and this share more columns than the rows
# need, for the batch's length to grow while rows come and go (``_add_row``)
SLOT_HEADROOM = 0.25
LOADING_WAIT_S = 0.002  # a prefill waiting for its KV with nothing else to run: this sleep
# why a progressive blend's upgrade did not happen (the answer's metrics say it)
UPGRADE_SKIPPED = "other questions were waiting"
UPGRADE_DROPPED = "the answer ended before its upgrade"


@dataclass(frozen=True)
class StepBudget:
    """How long a step's slice of prefill work may run beside the decode rows: ``auto``
    (``PAUSE_TARGET_S``, or ``BACKLOG_PAUSE_TARGET_S`` under a backlog, less the measured
    decode step), a number of seconds, or ``off``
    (whole prefills between decode steps, as before stall-free steps)."""

    seconds: float | None = None  # None: auto; math.inf: off

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StepBudget:
        """``ENGINE_STEP_BUDGET``: ``auto`` (default), ``off``, or seconds (``0.2``), as
        ``kvservice.protocol.environment`` reads it."""
        return cls(environment.read("ENGINE_STEP_BUDGET", environ))

    def slice_s(
        self, decode_s: float, waiting: int = 0, words: Sequence[tuple[float, int]] = ()
    ) -> float:
        """The slice's time for a step whose decode rows take ``decode_s``, with ``waiting``
        questions not started; ``words``: each open answer's word under way (seconds since
        it began, its tokens so far). 0: this step runs no prefill work."""
        if self.seconds is not None:
            return self.seconds
        backlog = waiting >= BACKLOG_QUESTIONS
        target = BACKLOG_PAUSE_TARGET_S if backlog else PAUSE_TARGET_S
        fixed = max(MIN_SLICE_S, target - decode_s)
        if not words:
            return fixed
        limit = BACKLOG_WORD_PAUSE_S if backlog else WORD_PAUSE_S
        # this step, then a decode step for each token up to the next word's first; a word
        # longer than WORD_TOKENS bounds nothing more (it would hold the line back)
        room = min(
            (
                limit - elapsed - (WORD_TOKENS + 1 - tokens) * decode_s
                for elapsed, tokens in words
                if tokens <= WORD_TOKENS
            ),
            default=fixed,
        )
        return max(0.0, min(room, MAX_SLICE_S if backlog else fixed))

    def __str__(self) -> str:
        if self.seconds is None:
            return "auto"
        return "off" if self.seconds == math.inf else f"{self.seconds:g} s"


AUTO_BUDGET = StepBudget()


@dataclass(frozen=True)
class PrefillTimes:
    """Where a question's time went up to its first token: waiting in the queue, the
    prefill's own compute (its slices), and its wall time from start to end (slices and the
    decode steps between them)."""

    queued_s: float
    compute_s: float
    wall_s: float


@dataclass
class Job:
    """One request in the batcher. ``prefill`` runs on the loop thread (it needs the model);
    ``on_token(text, token_id)`` and ``on_finish(reason, error)`` are called from it too."""

    # extra_capacity -> the prefill's steps, which return the prefilled batch-1 cache
    prefill: Callable[[int], Generator[None, None, BlendResult]]
    sampling: SamplingParams
    stop_ids: set[int]
    on_token: Callable[[str, int], None]
    on_finish: Callable[[str, BaseException | None], None]
    should_stop: Callable[[], bool] = lambda: False
    deadline: float = float("inf")  # time.monotonic() after which the request is cut off
    prompt_ids: Sequence[int] = ()  # what the repetition penalty counts as seen
    on_prefill: Callable[[BlendResult, PrefillTimes], None] | None = None
    # progressive blend: (result, first token) -> the steps of the cache's upgrade with that
    # token (returning the upgraded result), or None
    refresh: Callable[[BlendResult, int], Generator[None, None, BlendResult] | None] | None = None
    # the upgrade's outcome: its compute seconds, or why it did not happen (UPGRADE_SKIPPED...)
    on_refresh: Callable[[float | str], None] | None = None
    # its place while it waits: questions ahead of it (0: next), then None once it starts
    on_queue: Callable[[int | None], None] | None = None
    # Filled in by the batcher:
    started: float = 0.0
    ttft_s: float | None = None
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    detokenizer: Detokenizer | None = None
    history: TokenHistory | None = None
    stop_strings: StopStrings | None = None
    place: int | None = None  # the place last told to on_queue
    word_began: float = 0.0  # when its word under way began (its first token: its first word)
    word_tokens: int = 0  # that word's tokens so far


@dataclass
class _Work:
    """A job's pending prefill or progressive upgrade, paused between layers."""

    job: Job
    steps: Generator[None, None, BlendResult]
    began: float = field(default_factory=time.perf_counter)
    compute_s: float = 0.0


class ContinuousBatcher:
    def __init__(
        self,
        model: Transformer,
        tokenizer,
        *,
        max_batch: int = 8,
        threads: int | None = None,
        budget: StepBudget = AUTO_BUDGET,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.budget = budget
        # The batch's torch threads: by default the count of the thread that builds it.
        self.threads = threads or torch.get_num_threads()
        self._incoming: queue.Queue[Job] = queue.Queue()
        self._waiting: deque[Job] = deque()  # taken from _incoming, not started
        self._work: _Work | None = None  # the prefill under way
        self._upgrade: _Work | None = None  # the progressive upgrade under way (lowest priority)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        # The running batch: one row per active job.
        self._jobs: list[Job] = []
        self._slots: KVCache | None = None  # room for max_batch rows; rows come and go in it
        self._cache: KVCache | None = None  # its first rows: the running ones
        self._positions: torch.Tensor | None = None  # [B] position of each row's next token
        self._next_tokens: torch.Tensor | None = None  # [B] last sampled token per row
        # The batch cache's step recorded as a CUDA graph, where passes are (a GPU with
        # ENGINE_COMPILE on); a new one whenever the batch's rows change.
        self._decoder: DecodeGraph | None = None
        self._decode_s = 0.0  # the decode step's time, a moving average
        self.steps = 0
        self.max_rows_seen = 0
        self.slices = 0  # steps that ran prefill work beside decode rows
        self.upgrades_skipped = 0
        self.upgrades_dropped = 0
        self.upgrade_lag_tokens = 0  # tokens streamed from the first-pass cache (the last upgrade)
        self.longest_piece_s = 0.0  # _note_piece
        self.slot_allocations = 0  # _new_slots
        self.compactions = 0  # _compact

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

    @property
    def waiting(self) -> int:
        """Questions not started yet (queued behind the work under way or a full batch)."""
        return len(self._waiting) + self._incoming.qsize()

    def stats(self) -> dict[str, object]:
        """The batch's state for the worker's heartbeat (the dashboard's queue and budget):
        ``slice_s`` is what a step gives prefill work while answers stream (``off``: None)."""
        return {
            "active": self.active,
            "waiting": self.waiting,
            "prefilling": self._work is not None,
            "steps": self.steps,
            "slices": self.slices,
            "budget": str(self.budget),
            "slice_s": None
            if math.isinf(slice_s := self.budget.slice_s(self._decode_s, self.waiting))
            else round(slice_s, 4),
            "decode_step_s": round(self._decode_s, 4),
            "upgrades_skipped": self.upgrades_skipped,
            "upgrades_dropped": self.upgrades_dropped,
            "longest_piece_s": round(self.longest_piece_s, 4),
            "slot_allocations": self.slot_allocations,
            "compactions": self.compactions,
        }

    # -- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        # the one thread with an OpenMP team (kvservice.store.compute_threads)
        use_threads(self.threads)
        while not self._stop.is_set():
            try:
                self._take_incoming()
                if self._work is None and not self._jobs and not self._waiting:
                    continue  # idle: _take_incoming waited for a job
                self._run_slice()
                self._tell_places()
                if self._jobs:
                    self._decode_step()
            except Exception:  # never let the loop die: fail the batch, keep serving
                log.exception("batcher step failed; failing the running requests")
                failed = [*self._jobs, *([self._work.job] if self._work else [])]
                self._upgrade = None
                for job in failed:
                    self._finish(job, "error", RuntimeError("the engine failed on this batch"))
                self._work = None
                self._reset()

    def _take_incoming(self) -> None:
        """Move submitted jobs to the waiting line (waiting up to 0.2 s for one when there is
        nothing else to do) and end the waiting ones whose reader left or time ran out."""
        idle = self._work is None and not self._jobs and not self._waiting
        try:
            self._waiting.append(
                self._incoming.get(timeout=0.2) if idle else self._incoming.get_nowait()
            )
            while True:
                self._waiting.append(self._incoming.get_nowait())
        except queue.Empty:
            pass
        for job in [j for j in self._waiting if self._cut(j)]:
            self._waiting.remove(job)

    def _tell_places(self) -> None:
        """Each waiting job's place: the questions ahead of it (the work under way too)."""
        started = self._work is not None
        for index, job in enumerate(self._waiting):
            self._tell_place(job, index + started)

    def _tell_place(self, job: Job, place: int | None) -> None:
        """Tell a waiting job how many questions are ahead of it, when that changed."""
        if job.on_queue is None or place == job.place:
            return
        job.place = place
        try:
            job.on_queue(place)
        except Exception:
            log.exception("on_queue callback failed")

    def _cut(self, job: Job) -> bool:
        """End ``job`` before its first token if its reader left or its time ran out."""
        if job.should_stop():
            self._finish(job, "stopped")
        elif time.monotonic() > job.deadline:
            self._finish(job, "error", TimeoutError("the request ran past its time limit"))
        else:
            return False
        return True

    def _slice_s(self) -> float:
        if not self._jobs:
            return math.inf
        now = time.perf_counter()
        words = [(now - job.word_began, job.word_tokens) for job in self._jobs]
        return self.budget.slice_s(self._decode_s, len(self._waiting), words)

    @torch.no_grad()
    def _run_slice(self) -> None:
        """Prefill work, a layer at a time, while the step's budget has room for one more
        layer as long as the last one (at least one layer; with no decode rows, no limit)."""
        began, layer_s, ran = time.perf_counter(), 0.0, False
        while True:
            limit = self._slice_s()
            if limit <= 0 or (ran and time.perf_counter() - began + layer_s > limit):
                break
            work = self._next_work()
            if work is None:
                break
            ran = True
            layer_began = time.perf_counter()
            loading = self._advance(work) == LOADING
            layer_s = time.perf_counter() - layer_began
            work.compute_s += layer_s
            self._note_piece(layer_s)
            if loading:  # its KV is on its way: decode steps meanwhile, or a short wait
                if not self._jobs:
                    time.sleep(LOADING_WAIT_S)
                break
        if ran and self._jobs:
            self.slices += 1

    def _note_piece(self, seconds: float) -> None:
        """The longest piece of prefill work run between two pauses while answers streamed
        (what no budget can cut: a layer, or what a prefill does before its first layer)."""
        if self._jobs and seconds > self.longest_piece_s:
            self.longest_piece_s = seconds
            if seconds > LONG_PIECE_S:
                log.warning("a piece of prefill work held the open answers for %.2f s", seconds)

    def _next_work(self) -> _Work | None:
        """The prefill under way, else the oldest waiting question's prefill, room permitting,
        else the upgrade under way once its answer has ``UPGRADE_AFTER_TOKENS`` tokens."""
        if self._work is None and self._waiting and len(self._jobs) < self.max_batch:
            job = self._waiting.popleft()
            if job.place is not None:  # it was told a place: now it is started
                self._tell_place(job, None)
            job_steps = job.prefill(job.sampling.max_tokens)
            self._work = _Work(job, job_steps)
        if self._work is not None:
            return self._work
        if self._upgrade is not None and len(self._upgrade.job.tokens) > UPGRADE_AFTER_TOKENS:
            return self._upgrade
        return None

    def _advance(self, work: _Work) -> str | None:
        """One layer of ``work`` (what it yielded: ``LOADING`` when it waits for its KV); at
        its end, what follows it (``_prefilled``, ``_upgraded``)."""
        upgrade = work is self._upgrade
        if not upgrade and self._cut(work.job):  # an upgrade's answer ends in the batch
            self._work = None
            return None
        try:
            return next(work.steps)
        except StopIteration as done:
            result = done.value
        except Exception as err:
            log.exception("refresh failed" if upgrade else "prefill failed")
            self._end(work)
            self._finish(work.job, "error", err)
            return None
        self._end(work)
        if upgrade:
            self._upgraded(work, result)
        else:
            self._prefilled(work, result)
        return None

    def _end(self, work: _Work) -> None:
        if work is self._upgrade:
            self._upgrade = None
        else:
            self._work = None

    def _prefilled(self, work: _Work, result: BlendResult) -> None:
        """A prefill done: its first token, its row in the batch, and for a progressive
        blend its upgrade (when nobody waits and no other upgrade runs)."""
        job = work.job
        if job.on_prefill is not None:
            wall = time.perf_counter() - work.began
            job.on_prefill(result, PrefillTimes(work.began - job.started, work.compute_s, wall))
        job.generator = new_generator(job.sampling.seed, self.model.device)
        job.detokenizer = Detokenizer(self.tokenizer)
        job.history = TokenHistory(job.prompt_ids)
        job.stop_strings = StopStrings(job.sampling.stop)
        token = int(sample_next(result.logits[None], job.sampling, job.generator, job.history)[0])
        job.ttft_s = time.perf_counter() - job.started
        if self._emit(job, token):
            return  # finished on its first token
        upgrade = None
        if job.refresh is not None and (self.waiting or self._upgrade is not None):
            self.upgrades_skipped += 1
            self._report_refresh(job, UPGRADE_SKIPPED)
        elif job.refresh is not None:
            try:
                upgrade = job.refresh(result, token)
            except Exception:
                log.exception("refresh failed; the answer goes on from its first-pass cache")
        self._add_row(job, result, token)  # copies the cache: the upgrade then changes its own
        if upgrade is not None:
            self._upgrade = _Work(job, upgrade)

    def _upgraded(self, work: _Work, result: BlendResult) -> None:
        """An upgrade done (``result``: the cache after the prompt and the first token): the
        tokens the answer decoded since, computed again over it, and the row's cache
        replaced, so the next tokens read the upgraded cache. (An upgrade starts after its
        answer's first decode steps, so the row already holds the first token.)"""
        job = work.job
        if job not in self._jobs:  # ended meanwhile (``_finish`` reported it)
            return
        row = self._jobs.index(job)
        decoded = job.tokens[1:-1]  # in the row's cache after the first; the last is pending
        if decoded:
            n = result.num_tokens
            positions = torch.arange(n, n + len(decoded), device=self.model.device)
            ids = torch.tensor(decoded, device=self.model.device)
            self.model(ids[None], positions[None], result.cache)  # its KV joins the cache
        self._replace_row(row, result.cache)
        self.upgrade_lag_tokens = len(job.tokens) - 1
        self._report_refresh(job, work.compute_s)

    def _replace_row(self, row: int, cache: KVCache) -> None:
        """Row ``row``'s cache from batch-1 ``cache``: its slots in order onto the row's
        valid slots (a row's decoded tokens sit wherever the batch was when it joined)."""
        slots = self._cache.valid[row, : self._cache.length].nonzero().squeeze(1)
        if slots.numel() != cache.length:
            raise RuntimeError(f"upgrade of {cache.length} slots for a row of {slots.numel()}")
        count = slots.numel()
        self._slots.k[:, row].index_copy_(2, slots, cache.k[:, 0, :, :count])
        self._slots.v[:, row].index_copy_(2, slots, cache.v[:, 0, :, :count])

    def _report_refresh(self, job: Job, outcome: float | str) -> None:
        if job.on_refresh is not None:
            try:
                job.on_refresh(outcome)
            except Exception:
                log.exception("on_refresh callback failed")

    def _emit(self, job: Job, token: int) -> bool:
        """Hand one sampled token to the job; True when the job is finished."""
        if token in job.stop_ids:
            self._finish(job, "stop")
            return True
        job.tokens.append(token)
        job.history.observe(token)
        delta = job.detokenizer.push(token)
        self._note_word(job, delta)
        text = job.stop_strings.push(delta)
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

    @staticmethod
    def _note_word(job: Job, delta: str) -> None:
        """Keep ``job``'s word under way (``StepBudget.slice_s``): a token that begins a word
        (its first too) starts a new one."""
        text = job.detokenizer.emitted  # the answer's text, ``delta`` its end
        if len(job.tokens) == 1 or starts_word(text[: len(text) - len(delta)], delta):
            job.word_began, job.word_tokens = time.perf_counter(), 0
        job.word_tokens += 1

    def _finish(self, job: Job, reason: str, error: BaseException | None = None) -> None:
        if self._upgrade is not None and self._upgrade.job is job:  # said before the end
            self._upgrade = None
            self.upgrades_dropped += 1
            self._report_refresh(job, UPGRADE_DROPPED)
        try:
            job.on_finish(reason, error)
        except Exception:
            log.exception("on_finish callback failed")

    def _add_row(self, job: Job, result: BlendResult, token: int) -> None:
        """Put the job's prefilled cache into the running batch as a new row, in the batch's
        slots (one row copied). Slots are made once, for ``max_batch`` rows, and kept while
        the worker lives; where the rows' columns no longer fit (the batch's length grows a
        column a step while rows come and go) the rows are first moved to their front
        (``_compact``), and only a row longer than any before gets new, larger slots: a
        batch's allocation and copy held every open answer for 0.2-0.5 s."""
        n = result.num_tokens
        rows = len(self._jobs)
        # room for the longest answer still to come, and its next token
        tail = max(j.sampling.max_tokens - len(j.tokens) for j in (*self._jobs, job)) + 1
        length = max(n, self._cache.length if self._cache is not None else 0)
        slots = self._slots
        if rows and slots is not None and length + tail > slots.capacity:
            self._compact()
            length = max(n, self._cache.length)
        if slots is None or rows + 1 > slots.batch_size or length + tail > slots.capacity:
            slots = self._new_slots(rows + 1, length + tail, result.cache.k.dtype)
        slots.k[:, rows, :, :n] = result.cache.k[:, 0, :, :n]
        slots.v[:, rows, :, :n] = result.cache.v[:, 0, :, :n]
        slots.positions[rows, :n] = result.cache.positions[0, :n]
        slots.valid[rows] = False  # what an earlier row left there is not this one's
        slots.valid[rows, :n] = True
        self._cache, self._decoder = slots.first_rows(rows + 1), None
        self._cache.length = length
        self._jobs.append(job)
        device = self.model.device
        new_position = torch.tensor([n], device=device)
        new_token = torch.tensor([token], device=device)
        self._positions = (
            new_position if self._positions is None else torch.cat([self._positions, new_position])
        )
        self._next_tokens = (
            new_token if self._next_tokens is None else torch.cat([self._next_tokens, new_token])
        )
        self.max_rows_seen = max(self.max_rows_seen, rows + 1)

    def _new_slots(self, rows: int, needed: int, dtype: torch.dtype) -> KVCache:
        """Slots for ``max_batch`` rows (at least ``rows``) of ``needed`` tokens and
        ``SLOT_HEADROOM`` more, holding the running rows; they replace the old ones."""
        old = self._cache
        capacity, room = needed + int(needed * SLOT_HEADROOM), max(rows, self.max_batch)
        slots = KVCache(self.model.config, room, capacity, self.model.device, dtype)
        if old is not None:
            used, running = old.length, old.batch_size
            slots.k[:, :running, :, :used] = old.k[:, :, :, :used]
            slots.v[:, :running, :, :used] = old.v[:, :, :, :used]
            slots.positions[:running, :used] = old.positions[:, :used]
            slots.valid[:running, :used] = old.valid[:, :used]
        self._slots = slots
        self.slot_allocations += 1
        return slots

    def _compact(self) -> None:
        """Each running row's tokens moved to the front of its slots, in order: the batch's
        length becomes its longest row's, where it was the columns written since the
        batch began (a row that joins starts at column 0; every row's next token goes in
        the same column)."""
        before = self._cache.length
        if self._cache.compact_rows() < before:
            self.compactions += 1

    def _drop_rows(self, keep: list[int]) -> list[int]:
        """Keep the rows ``keep`` (sorted): each row past the kept count moves into a row
        left free (one row's copy each, not the batch's). Returns, for each row after, the
        row it was before."""
        count, kept = len(keep), set(keep)
        free = [row for row in range(count) if row not in kept]
        movers = [row for row in keep if row >= count]
        order = [row if row in kept else movers[free.index(row)] for row in range(count)]
        for dest, source in zip(free, movers, strict=True):
            self._slots.move_row(source, dest, self._cache.length)
        length = self._cache.length
        self._cache, self._decoder = self._slots.first_rows(count), None
        self._cache.length = length
        return order

    @torch.no_grad()
    def _decode_step(self) -> None:
        began = time.perf_counter()
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
        self._note_decode(began)  # the tokens sampled: the device is done
        if len(keep) == len(self._jobs):
            self._next_tokens = torch.tensor(next_tokens, device=self.model.device)
            return
        if not keep:
            self._reset()
            return
        order = self._drop_rows(keep)  # a new view of the slots: a new recording
        tokens = dict(zip(keep, next_tokens, strict=True))
        self._jobs = [self._jobs[row] for row in order]
        self._positions = self._positions[torch.tensor(order, device=self.model.device)]
        self._next_tokens = torch.tensor([tokens[row] for row in order], device=self.model.device)

    def _note_decode(self, began: float) -> None:
        """The decode step's time, sampling included, as a moving average."""
        seconds = time.perf_counter() - began
        self._decode_s = seconds if not self._decode_s else 0.7 * self._decode_s + 0.3 * seconds

    def _graphed(self) -> bool:
        model = self.model
        return model.device.type == "cuda" and getattr(model, "pass_graphs", None) is not None

    def _reset(self) -> None:
        """No rows (the slots are kept for the next batch)."""
        self._jobs, self._cache, self._positions, self._next_tokens = [], None, None, None
        self._decoder = None
