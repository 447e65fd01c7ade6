"""One request, start to finish, inside the inference worker, for either engine: fit the
prompt into the context, let the runtime plan it (``Runtime.plan``: where its chunks' KV
comes from, the recompute ratio, the engine's request), stream each token to Redis, and
report the answer with its metrics.

The engines differ only behind ``Runtime``: the native one (``kvservice.runtime``) loads the
chunks through the store's tiers and blends in ``kvservice.engine``; the vLLM one
(``kvservice.vllm.runtime``) hands chunk keys to vLLM's KV connector.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from kvservice import citing
from kvservice.controller import RatioDecision
from kvservice.engine import TokenEvent
from kvservice.prompt import TURN_MARKERS, PromptFormat
from kvservice.protocol import GenerateRequest, publish_event, stop_requested
from kvservice.sampling import AnswerText, SamplingParams

log = logging.getLogger(__name__)

FIXED_RATIOS = {"full": 1.0, "prefix": None, "reuse": 0.0}

# The product's decoding, the same for both engines (kvservice.sampling.apply_penalties is
# vLLM's). Measured with the bundled SmolLM2-135M, greedy, on the 19 handbook questions
# (bench/answers.py): with no penalty 3 of 19 answers repeated a sentence to the
# 256-token cap, and in one conversation 4 of 7 answers went on with "User:"/"Question:"
# turns; with the turn markers as stop strings and a frequency penalty of 0.5 (on generated
# tokens only) none loops, 8.5 tokens on average. vLLM's repetition penalty also counts the
# prompt's tokens: at 1.2 it kept the answers from copying the passages ("27 days" became
# "69 days", 7 of 8 answers invented), so it stays off.
REPETITION_PENALTY = 1.0
FREQUENCY_PENALTY = 0.5
# Earlier questions carried into a follow-up's prompt, at most this many tokens (the oldest
# go first): history made the first token 1.6-5x slower and was copied into answers.
HISTORY_MAX_TOKENS = 192


@dataclass(frozen=True)
class FittedContext:
    """What of a request goes into the prompt (``fit_context``)."""

    chunk_ids: list[int]  # the passages kept, most relevant first
    chunks_tokens: list[list[int]]  # their token ids
    segments: list[list[int]]  # between head and question: "[1]", passage 1, "[2]", ...
    suffix_ids: list[int]  # the question part (earlier questions included)
    dropped: list[int]  # passages left out for room


class AnswerPlan(Protocol):
    """One request as an engine will run it (``Runtime.plan``)."""

    ratio: float
    decision: RatioDecision | None  # the controller's, when it chose the ratio
    prompt_tokens: int

    def events(self) -> Iterator[TokenEvent]:
        """The answer's tokens; leaving early stops the request."""

    def finish(self) -> dict[str, Any]:
        """After the answer: what the engine reports (tiers, load, prefill time)."""


class Runtime(Protocol):
    """What the inference worker holds for its lifetime, whichever the engine."""

    model_name: str | None
    prompt: PromptFormat
    context_len: int
    tokenizer: Any
    engine: Any  # stream(), stop_ids

    def load(self, cfg: Any) -> None: ...
    def status(self) -> dict[str, object]: ...
    def chunk_key(self, token_ids: list[int], scope: str = ""): ...
    def plan(self, request: GenerateRequest, fitted: FittedContext) -> AnswerPlan: ...
    def close(self) -> None: ...


def answer_sampling(request: GenerateRequest) -> SamplingParams:
    """How an answer is decoded, for either engine: the request's length, temperature and
    seed, the repetition penalty, and the prompt's turn markers as stop strings."""
    return SamplingParams(
        max_tokens=request.max_new_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        repetition_penalty=REPETITION_PENALTY,
        frequency_penalty=FREQUENCY_PENALTY,
        stop=TURN_MARKERS,
    )


def fit_context(runtime: Runtime, request: GenerateRequest) -> FittedContext:
    """Keep the newest turns that fit ``HISTORY_MAX_TOKENS``, then drop the least relevant
    (last) chunks until the prompt (passage markers included) and the answer fit the
    context."""
    prompt = runtime.prompt
    budget = runtime.context_len - request.max_new_tokens - len(prompt.head_ids)
    history = [(turn.role, turn.content) for turn in request.history]
    bare = len(prompt.question_ids(request.question))
    suffix = prompt.question_ids(request.question, history)
    while history and len(suffix) - bare > HISTORY_MAX_TOKENS:
        history = history[1:]
        suffix = prompt.question_ids(request.question, history)
    chunks = list(request.chunks)

    def length(kept: list) -> int:
        return sum(map(len, prompt.numbered([c.token_ids for c in kept])))

    while chunks and length(chunks) + len(suffix) > budget:
        chunks.pop()
    if len(suffix) > budget:
        raise ValueError("the question is too long for the model's context")
    tokens = [list(c.token_ids) for c in chunks]
    return FittedContext(
        chunk_ids=[c.chunk_id for c in chunks], chunks_tokens=tokens,
        segments=prompt.numbered(tokens), suffix_ids=suffix,
        dropped=[c.chunk_id for c in request.chunks[len(chunks) :]],
    )  # fmt: skip


def chunk_keys(runtime: Runtime, request: GenerateRequest, fitted: FittedContext) -> list:
    """The store keys of the chunks ``fit_context`` kept, each in the scope the web side
    stored it in."""
    kept = request.chunks[: len(fitted.chunks_tokens)]
    return [
        runtime.chunk_key(ids, ref.kv_scope)
        for ids, ref in zip(fitted.chunks_tokens, kept, strict=True)
    ]


def choose_ratio(
    runtime: Any, request: GenerateRequest, *, num_tokens: int, num_layers: int, load_bytes
) -> tuple[float, RatioDecision | None]:
    """The recompute ratio: the request's own, a fixed mode's, or the loading controller's
    choice for a blend (over the chunk tokens it would recompute and the bytes to load per
    tier), from the request's fidelity-target ratio where the operator set a target."""
    if request.recompute_ratio is not None:
        return request.recompute_ratio, None
    if request.mode != "blend":
        return FIXED_RATIOS.get(request.mode) or 0.0, None
    decision = runtime.controller.choose(
        num_tokens=num_tokens, num_layers=num_layers, load_bytes_by_tier=load_bytes,
        target_ratio=request.target_ratio,
    )  # fmt: skip
    return decision.recompute_ratio, decision


def answer_request(runtime: Runtime, request: GenerateRequest, redis: Any) -> dict[str, Any]:
    """Answer ``request``: tokens to its Redis stream as they come (through ``AnswerText``:
    a repeat ends the answer, one cut at the token cap ends cleanly), then ``done`` (or
    ``error``) with the metrics; returns the same report for the record."""
    started = time.perf_counter()
    request_id = request.request_id
    answer = AnswerText()
    first_token_at, completion_tokens, finish_reason, status = None, 0, "stop", "done"
    second_token_at = None  # progressive blend's upgrade comes between the first two
    try:
        fitted = fit_context(runtime, request)
        plan = runtime.plan(request, fitted)
        deadline = time.monotonic() + request.timeout_s
        events, stop_ids = plan.events(), runtime.engine.stop_ids
        try:
            for event in events:
                first_token_at = first_token_at or time.perf_counter()
                if event.index == 1 and event.token_id >= 0:
                    second_token_at = time.perf_counter()
                completion_tokens += 0 <= event.token_id and event.token_id not in stop_ids
                finish_reason = event.finish_reason or finish_reason
                if shown := answer.push(event.text):
                    publish_event(redis, request_id, "token", text=shown)
                if answer.repeated:
                    break  # the rest would say it again
                if stop_requested(redis, request_id):
                    status = "stopped"
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the engine did not finish the request in time")
        finally:
            events.close()  # stops the request in the engine when we left early
        engine_metrics = plan.finish()
    except Exception as err:
        log.exception("request %s failed", request_id)
        message = f"{type(err).__name__}: {err}" if not isinstance(err, ValueError) else str(err)
        publish_event(redis, request_id, "error", message=message, text=answer.text)
        return {"status": "error", "text": answer.text, "error": message, "metrics": {}}

    cut = status == "done" and finish_reason == "length" and not answer.repeated
    if rest := answer.finish(cut=cut):
        publish_event(redis, request_id, "token", text=rest)
    text, citation, withheld = answer.text, None, ""
    if status == "done":
        passages = [runtime.tokenizer.decode(ids) for ids in fitted.chunks_tokens]
        judged = citing.verdict(text, passages, request.question)
        if judged.streamed:
            publish_event(redis, request_id, "token", text=judged.streamed)
        text, citation, withheld = judged.text, judged.citation, judged.withheld
    whole_prefix = served_from_prefix(fitted, engine_metrics)
    metrics: dict[str, Any] = {
        "mode": request.mode,
        "worker": getattr(runtime, "worker_id", ""),  # which inference worker answered
        "ttft_s": None if first_token_at is None else round(first_token_at - started, 4),
        "second_token_s": None if second_token_at is None else round(second_token_at - started, 4),
        "total_s": round(time.perf_counter() - started, 4),
        # No ratio ran over passages the prefix cache served whole: none is recorded.
        "recompute_ratio": None if whole_prefix else plan.ratio,
        "prefix_cache": whole_prefix,
        "prompt_tokens": plan.prompt_tokens,
        "completion_tokens": completion_tokens,
        # OpenAI's words: "length" when cut at max_new_tokens, "stop" otherwise (an answer
        # ended before a repeat stopped, whatever the cap).
        "finish_reason": "length" if cut else "stop",
        "repeat_suppressed": answer.repeated,
        "temperature": request.temperature,
        "seed": request.seed,
        "dropped_chunks": fitted.dropped,
        "citation": citation,
        **engine_metrics,
    }
    if plan.decision is not None and not whole_prefix:
        metrics["controller"] = {"source": plan.decision.source, "why": plan.decision.why}
    publish_event(
        redis, request_id, "done", text=text, withheld=withheld, metrics=metrics, status=status
    )
    return {"status": status, "text": text, "withheld": withheld, "error": "", "metrics": metrics}


def served_from_prefix(fitted: FittedContext, engine_metrics: dict[str, Any]) -> bool:
    """Whether every passage's KV came from the prefix cache (``kvservice.prefix``): the
    whole context was read as the previous turn left it, so no recompute ratio ran."""
    tiers = engine_metrics.get("chunk_tiers") or {}
    kept = [str(chunk_id) for chunk_id in fitted.chunk_ids]
    return bool(kept) and all(tiers.get(chunk_id) == "prefix" for chunk_id in kept)
