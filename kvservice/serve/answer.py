"""One request, start to finish, inside the inference worker, for either engine: plan it
(``kvservice.blend.planning``: what fits the context, chunk keys, sampling, the ratio's policy), let
the runtime run the plan (``Runtime.plan``: where its chunks' KV comes from, the engine's
request), stream each token to Redis, and end with the answer's outcome
(``kvservice.protocol.AnswerOutcome``): its verdict, what it made of each passage, its metrics.
The outcome is returned for the record task (``kvservice.serve.server``), which carries it to
the web side; the web side ends the stream with it once it is stored.

The engines differ only behind ``Runtime``: the native one (``kvservice.serve.runtime``) loads the
chunks through the store's tiers and blends in ``kvservice.serve.engine``; the vLLM one
(``kvservice.vllm.runtime``) hands chunk keys to vLLM's KV connector.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvservice.blend.controller import LoadingController, RatioDecision
from kvservice.blend.planning import FittedContext, PlannedRequest, plan_request
from kvservice.model.sampling import AnswerText
from kvservice.protocol import (
    AnswerMetrics,
    AnswerOutcome,
    GenerateRequest,
    Queue,
    Token,
    TokenEvent,
    publish_event,
    stop_requested,
)
from kvservice.protocol.prompt import PromptFormat
from kvservice.serve import citing

log = logging.getLogger(__name__)


class AnswerPlan(Protocol):
    """One request as an engine will run it (``Runtime.plan``)."""

    ratio: float
    decision: RatioDecision | None  # the controller's, when it chose the ratio
    prompt_tokens: int

    def events(self, on_queue: Callable[[int | None], None] | None = None) -> Iterator[TokenEvent]:
        """The answer's tokens; leaving early stops the request. ``on_queue(ahead)`` while
        it waits for the engine (questions ahead of it), then None once it starts."""

    def finish(self) -> dict[str, Any]:
        """After the answer: what the engine reports (tiers, load, prefill time)."""


class Runtime(Protocol):
    """What the inference worker holds for its lifetime, whichever the engine; the planner
    reads the first four and ``chunk_key`` (``kvservice.blend.planning.Plannable``)."""

    prompt: PromptFormat
    context_len: int
    controller: LoadingController
    refresh_ratio: float | None
    model_name: str | None
    tokenizer: Any
    engine: Any  # stream(), stop_ids

    def load(self, cfg: Any) -> None: ...
    def status(self) -> dict[str, object]: ...
    def chunk_key(self, token_ids: list[int], scope: str = ""): ...
    def plan(self, planned: PlannedRequest) -> AnswerPlan: ...
    def close(self) -> None: ...


@dataclass
class Streamed:
    """What streaming an answer left (``_stream``)."""

    answer: AnswerText = field(default_factory=AnswerText)
    status: str = "done"  # or "stopped"
    finish_reason: str = "stop"
    completion_tokens: int = 0
    first_token_at: float | None = None
    second_token_at: float | None = None  # progressive blend's upgrade comes before it
    last_words_at: float | None = None  # the last text put on the stream
    longest_pause_s: float | None = None  # between two of the engine's tokens
    cut: bool = False  # at the token cap, at a word
    judged: citing.Verdict | None = None


def answer_request(runtime: Runtime, request: GenerateRequest, redis: Any) -> AnswerOutcome:
    """Answer ``request``: tokens to its Redis stream as they come (through ``AnswerText``:
    a repeat ends the answer, one cut at the token cap ends cleanly); returns the outcome
    (failed, with the words streamed so far, when anything raised) for the record, which
    ends the stream once stored."""
    started = time.perf_counter()
    streamed = Streamed()
    try:
        planned = plan_request(runtime, request)
        plan = runtime.plan(planned)
        place = functools.partial(_publish_place, redis, request.request_id)
        _stream(plan.events(on_queue=place), runtime.engine.stop_ids, request, redis, streamed)
        passages = passage_texts(runtime, request, planned.fitted)
        _last_words(request, passages, streamed, redis)  # before the engine's bookkeeping
        engine_metrics = plan.finish()
    except Exception as err:
        log.exception("request %s failed", request.request_id)
        message = f"{type(err).__name__}: {err}" if not isinstance(err, ValueError) else str(err)
        return AnswerOutcome.failed(message, streamed.answer.text, audit_of=request.audit_of)
    return _outcome(runtime, planned, plan, streamed, passages, engine_metrics, started)


def _publish_place(redis: Any, request_id: str, ahead: int | None) -> None:
    """The question's place in the engine's line on its stream (``queue``: questions ahead
    of it, 0 next; None once it starts), for the page and the API to show."""
    publish_event(redis, request_id, Queue(ahead=ahead))


def _stream(
    events: Iterator[TokenEvent], stop_ids, request: GenerateRequest, redis: Any, out: Streamed
) -> None:
    """Relay the engine's tokens to the stream until the end, a repeat, a stop or the
    request's deadline (``TimeoutError``)."""
    deadline = time.monotonic() + request.timeout_s
    try:
        last = None  # when the engine's previous token came
        for event in events:
            now = time.perf_counter()
            if event.token_id >= 0:
                if last is not None:
                    out.longest_pause_s = max(out.longest_pause_s or 0.0, round(now - last, 4))
                last = now
            out.first_token_at = out.first_token_at or now
            if event.index == 1 and event.token_id >= 0:
                out.second_token_at = time.perf_counter()
            out.completion_tokens += 0 <= event.token_id and event.token_id not in stop_ids
            out.finish_reason = event.finish_reason or out.finish_reason
            if shown := out.answer.push(event.text):
                publish_event(redis, request.request_id, Token(text=shown))
                out.last_words_at = time.perf_counter()
            if out.answer.repeated:
                break  # the rest would say it again
            if stop_requested(redis, request.request_id):
                out.status = "stopped"
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not finish the request in time")
    finally:
        events.close()  # stops the request in the engine when we left early


def _last_words(
    request: GenerateRequest, passages: list[str], streamed: Streamed, redis: Any
) -> None:
    """Stream the answer's end: what the repeat guard held back (or the "…" of an answer cut
    at the cap), then what the verdict adds (a citation, or the withdrawal of words no
    passage supports); the verdict is kept in ``streamed``."""
    answer = streamed.answer
    streamed.cut = (
        streamed.status == "done" and streamed.finish_reason == "length" and not answer.repeated
    )
    words = [answer.finish(cut=streamed.cut)]
    if streamed.status == "done":
        streamed.judged = citing.verdict(answer.text, passages, request.question)
        words.append(streamed.judged.streamed)
    for text in filter(None, words):
        publish_event(redis, request.request_id, Token(text=text))
        streamed.last_words_at = time.perf_counter()


def _outcome(
    runtime: Runtime,
    planned: PlannedRequest,
    plan: AnswerPlan,
    streamed: Streamed,
    passages: list[str],
    engine_metrics: dict[str, Any],
    started: float,
) -> AnswerOutcome:
    """The answer's outcome: its verdict, what it made of each passage, its metrics."""
    request, fitted, answer, judged = (
        planned.request,
        planned.fitted,
        streamed.answer,
        streamed.judged,
    )
    text = judged.text if judged is not None else answer.text
    citation = judged.citation if judged is not None else None
    withheld = judged.withheld if judged is not None else ""
    whole_prefix = served_from_prefix(fitted, engine_metrics)
    measured: dict[str, Any] = {
        "mode": request.mode,
        "worker": getattr(runtime, "worker_id", ""),  # which inference worker answered
        "ttft_s": _seconds_since(started, streamed.first_token_at),
        "second_token_s": _seconds_since(started, streamed.second_token_at),
        "longest_pause_s": streamed.longest_pause_s,
        # To the last words streamed: what comes after them (keeping this prompt's KV for a
        # follow-up, the loading controller's bookkeeping) is not the user's wait.
        "total_s": _seconds_since(started, streamed.last_words_at or time.perf_counter()),
        # No ratio ran over passages the prefix cache served whole: none is recorded.
        "recompute_ratio": None if whole_prefix else plan.ratio,
        "prefix_cache": whole_prefix,
        "prompt_tokens": plan.prompt_tokens,
        "completion_tokens": streamed.completion_tokens,
        # OpenAI's words: "length" when cut at max_new_tokens, "stop" otherwise (an answer
        # ended before a repeat stopped, whatever the cap).
        "finish_reason": "length" if streamed.cut else "stop",
        "repeat_suppressed": answer.repeated,
        "temperature": request.temperature,
        "seed": request.seed,
        "dropped_chunks": fitted.dropped,
        "citation": citation,
        **engine_metrics,
    }
    if plan.decision is not None and not whole_prefix:
        measured["controller"] = {"source": plan.decision.source, "why": plan.decision.why}
    metrics = AnswerMetrics.from_dict(measured)  # the engine's measures checked by name
    return AnswerOutcome.answered(
        streamed.status,
        text=text,
        withheld=withheld,
        metrics=metrics,
        audit_of=request.audit_of,
        passages=citing.passage_uses(
            text, passages, fitted.chunk_ids, metrics.chunk_tiers, request.question
        ),
    )


def _seconds_since(started: float, at: float | None) -> float | None:
    return None if at is None else round(at - started, 4)


def passage_texts(runtime: Runtime, request: GenerateRequest, fitted: FittedContext) -> list[str]:
    """The kept passages' text as the web app stores it (the request carries it), else as
    their tokens decode (a request from before the text was sent)."""
    kept = request.chunks[: len(fitted.chunks_tokens)]
    return [
        ref.text or runtime.tokenizer.decode(ids)
        for ref, ids in zip(kept, fitted.chunks_tokens, strict=True)
    ]


def served_from_prefix(fitted: FittedContext, engine_metrics: dict[str, Any]) -> bool:
    """Whether every passage's KV came from the prefix cache (``kvservice.serve.prefix``): the
    whole context was read as the previous turn left it, so no recompute ratio ran."""
    tiers = engine_metrics.get("chunk_tiers") or {}
    kept = [str(chunk_id) for chunk_id in fitted.chunk_ids]
    return bool(kept) and all(tiers.get(chunk_id) == "prefix" for chunk_id in kept)
