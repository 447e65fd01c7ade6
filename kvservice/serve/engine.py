"""The native engine: a request's prefill in any mode (``kvservice.blend.prefill``), then
its decode in the continuous batch (``kvservice.serve.batcher``) that every request of the
worker shares.

Prompt format (the same at precompute and at query time, so cached tokens are exactly the
prompt's tokens): ``[head][chunk 1]...[chunk n][question + assistant opening]``, each part
tokenized on its own and the ids concatenated. The head is the chat template's opening with
the deployment's system prompt and instruction: fixed per deployment, so chunks are
precomputed after it (``Engine.precompute``) and its hash goes into their keys.

``kvservice.vllm.engine.VllmEngine`` offers the same ``stream``/``generate`` over vLLM; the
inference worker's answer path (``kvservice.serve.answer``) drives either.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from kvservice.blend.prefill import (
    BlendResult,
    Completion,
    Mode,
    Steps,
    blend_prefill_steps,
    can_refresh,
    refresh_steps,
    run_steps,
)
from kvservice.chunk import ChunkKV, LayeredKV
from kvservice.model.producer import KVProducer
from kvservice.model.sampling import SamplingParams
from kvservice.model.transformer import Transformer
from kvservice.protocol import TokenEvent, environment
from kvservice.protocol.prompt import Prompt, PromptFormat, stop_token_ids
from kvservice.protocol.ratio import DEFAULT_RECOMPUTE_RATIO
from kvservice.serve.batcher import (
    AUTO_BUDGET,
    ContinuousBatcher,
    Job,
    PrefillTimes,
    StepBudget,
)


@dataclass
class Request:
    prompt: Prompt
    chunks: list[LayeredKV | None]  # cached KV of prompt.chunk_ids, same order (None: computed)
    mode: Mode = "blend"
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cached_prefix: LayeredKV | None = None  # an earlier prompt's KV for the first slots
    # progressive blend: the ratio the cache is upgraded to after the first token, as the
    # planner resolved it (kvservice.blend.planning.RatioPolicy); None or 0: not upgraded
    refresh_ratio: float | None = None


def refresh_ratio_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """``BLEND_REFRESH_RATIO`` (``kvservice.protocol.environment``): progressive blend, a
    blend's cache upgraded to that ratio before the second token
    (``kvservice.blend.prefill.refresh``); unset or empty: off."""
    return environment.read("BLEND_REFRESH_RATIO", environ)


@dataclass(frozen=True)
class _Place:
    """A request's place in the batcher's line, on its way to the reading thread."""

    ahead: int | None


class Engine:
    """Prefill and decode for the native model. The batcher's thread owns the model's compute
    with ``threads`` torch threads (by default the building thread's count; other threads had
    best run torch on one core, ``kvservice.store.compute_threads``): it starts with the first
    request and stops with ``close``."""

    def __init__(
        self,
        model: Transformer,
        tokenizer,
        prompt_format: PromptFormat | None = None,
        *,
        max_batch: int = 8,
        threads: int | None = None,
        step_budget: StepBudget = AUTO_BUDGET,
    ) -> None:
        """``step_budget``: the prefill work each batch step runs beside the decode rows.
        Progressive blend is the request's (``Request.refresh_ratio``)."""
        self.model = model
        self.tokenizer = tokenizer
        self.format = prompt_format or PromptFormat(tokenizer)
        self.device = model.device
        self.stop_ids = stop_token_ids(tokenizer)
        self.batcher = ContinuousBatcher(
            model, tokenizer, max_batch=max_batch, threads=threads, budget=step_budget
        )
        # Stored chunks' KV, after what they are stored after (PromptFormat.storage_ids)
        self.producer = KVProducer(model, self.format.storage_ids)
        self._start_lock = threading.Lock()
        self._started = False

    @property
    def head_kv(self) -> ChunkKV:
        """The prompt head's KV, computed once (it is the same for every request), in the
        producer's cache (one computation where chunks are stored after the head alone)."""
        return self.producer.heads.get(self.format.head_ids)

    def precompute(self, chunk_ids) -> list[ChunkKV]:
        """Chunks' KV as the store holds it (``kvservice.model.producer``): a chunk whose stored
        KV is missing, recomputed for this request."""
        return self.producer.compute(chunk_ids)

    def prefill(self, request: Request, extra_capacity: int = 0) -> BlendResult:
        """The request's prefill, whole (outside the batch: calibration, benches, tests)."""
        return run_steps(self.prefill_steps(request, extra_capacity))

    def prefill_steps(self, request: Request, extra_capacity: int = 0) -> Steps[BlendResult]:
        """The request's prefill, pausing after each layer (``kvservice.blend.prefill``)."""
        prompt = request.prompt
        return blend_prefill_steps(
            self.model,
            prompt.head_ids,
            request.chunks,
            prompt.question_ids,
            mode=request.mode,
            recompute_ratio=request.recompute_ratio,
            chunk_ids=prompt.chunk_ids,
            head_kv=self.head_kv if prompt.head_ids == self.format.head_ids else None,
            extra_capacity=extra_capacity,
            cached_prefix=request.cached_prefix,
        )

    def submit(
        self,
        request: Request,
        *,
        on_token: Callable[[str, int], None],
        on_finish: Callable[[str, BaseException | None], None],
        should_stop: Callable[[], bool] = lambda: False,
        deadline: float = float("inf"),
        on_prefill: Callable[[BlendResult, PrefillTimes], None] | None = None,
        on_refresh: Callable[[float, float | str], None] | None = None,
        on_queue: Callable[[int | None], None] | None = None,
    ) -> Job:
        """Queue the request in the batch: ``on_token(text, token_id)`` for each token and
        ``on_finish(reason, error)`` once, both from the batcher's thread, and
        ``on_prefill(result, times)`` after the prefill (the result keeps the prompt's
        cache after the batch has copied it), ``on_refresh(ratio, outcome)`` once a
        progressive blend's upgrade is done (its compute seconds) or did not happen (why),
        ``on_queue(ahead)`` while it waits (then None once it starts). The returned job holds
        the TTFT and tokens."""
        ratio = self.refresh_ratio_for(request)
        job = Job(
            prefill=lambda extra: self.prefill_steps(request, extra),
            sampling=request.sampling,
            stop_ids=self.stop_ids | set(request.sampling.stop_token_ids),
            prompt_ids=request.prompt.token_ids,
            on_token=on_token,
            on_finish=on_finish,
            should_stop=should_stop,
            deadline=deadline,
            on_prefill=on_prefill,
            refresh=self._refresher(ratio),
            on_refresh=None
            if ratio is None or on_refresh is None
            else lambda outcome: on_refresh(ratio, outcome),
            on_queue=on_queue,
        )
        with self._start_lock:
            if not self._started:
                self.batcher.start()
                self._started = True
        self.batcher.submit(job)
        return job

    def refresh_ratio_for(self, request: Request) -> float | None:
        """The ratio progressive blend upgrades ``request``'s cache to after the first token
        (the request's, resolved by the planner): None where there is none, or the request is
        not a blend below it."""
        ratio = request.refresh_ratio
        if request.mode != "blend" or not ratio or ratio <= request.recompute_ratio:
            return None
        return ratio

    def _refresher(
        self, ratio: float | None
    ) -> Callable[[BlendResult, int], Steps[BlendResult] | None] | None:
        """Progressive blend at ``ratio`` (``refresh_ratio_for``): the steps of the cache's
        upgrade once the first token is known (docs/blend.md: validation KL 0.0414 -> 0.0261
        at 0.10), run while the answer streams from its first-pass cache
        (``kvservice.serve.batcher``); None for the others."""
        if ratio is None:
            return None

        def upgrade(result: BlendResult, token: int) -> Steps[BlendResult] | None:
            if not can_refresh(result):
                return None
            return refresh_steps(self.model, result, [token], ratio)

        return upgrade

    def stream(
        self,
        request: Request,
        *,
        should_stop: Callable[[], bool] = lambda: False,
        deadline: float = float("inf"),
        on_prefill: Callable[[BlendResult, PrefillTimes], None] | None = None,
        on_refresh: Callable[[float, float | str], None] | None = None,
        on_queue: Callable[[int | None], None] | None = None,
    ) -> Iterator[TokenEvent]:
        """The request's tokens as the batch produces them, each as soon as it is sampled
        (a progressive blend's first one before its upgrade), TTFT on the first, then a
        last event with no token (``token_id`` -1) and the finish reason. Leaving the
        iteration early stops the request; past ``deadline`` (``time.monotonic()``) it fails
        with ``TimeoutError``. ``on_queue(ahead)`` is called from the iterating thread (not
        the batcher's) while the request waits for its turn, then with None."""
        events: queue.Queue = queue.Queue()
        left = threading.Event()
        job = self.submit(
            request,
            on_token=lambda text, token: events.put((token, text, None, None)),
            on_finish=lambda reason, error: events.put((None, "", reason, error)),
            should_stop=lambda: left.is_set() or should_stop(),
            deadline=deadline,
            on_prefill=on_prefill,
            on_refresh=on_refresh,
            on_queue=None if on_queue is None else lambda place: events.put(_Place(place)),
        )
        index = 0
        try:
            while True:
                try:  # the batcher ends a late request itself; this is for a stuck batch
                    wait = None if deadline == float("inf") else deadline - time.monotonic() + 30
                    item = events.get(timeout=wait and max(wait, 0.1))
                except queue.Empty:
                    raise TimeoutError("the engine did not finish the request in time") from None
                if isinstance(item, _Place):
                    on_queue(item.ahead)
                    continue
                token, text, reason, error = item
                if reason is not None:
                    break
                yield TokenEvent(token, text, index, job.ttft_s if index == 0 else None)
                index += 1
        finally:
            left.set()
        if error is not None and reason == "error":
            raise error
        yield TokenEvent(-1, "", index, job.ttft_s if index == 0 else None, finish_reason=reason)

    def generate(self, request: Request) -> Completion:
        events = list(self.stream(request))
        return Completion(
            token_ids=[e.token_id for e in events if e.token_id >= 0],
            text="".join(e.text for e in events),
            ttft_s=events[0].ttft_s or 0.0,
            finish_reason=events[-1].finish_reason or "length",
        )

    def close(self) -> None:
        if self._started:
            self.batcher.close()
