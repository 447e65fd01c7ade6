"""One request, start to finish, inside the inference worker: fit the prompt into the
context, load the chunks' KV through the tiers, choose the recompute ratio, blend and decode
in the shared batch, stream each token to Redis, and return the answer with its metrics."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvservice import citing
from kvservice.batcher import Job
from kvservice.blend import blend_prefill
from kvservice.engine import SamplingParams
from kvservice.prefix import PrefixKV, boundaries
from kvservice.prompt import TURN_MARKERS
from kvservice.protocol import GenerateRequest, publish_event

log = logging.getLogger(__name__)

FIXED_RATIOS = {"full": 1.0, "prefix": None, "reuse": 0.0}

# The product's decoding, the same for both engines (kvservice.engine.apply_penalties is
# vLLM's). Measured with the bundled SmolLM2-135M, greedy, on the 19 handbook questions
# (webapp/chat/answerbench.py): with no penalty 3 of 19 answers repeated a sentence to the
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


class _TokensOnly:
    """A chunk that is computed fresh (``full`` mode, or a chunk the store cannot serve):
    the blender only needs its length and ids."""

    head_hash = None

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.num_tokens = len(token_ids)

    def layer(self, index: int):
        raise RuntimeError("no cached KV for this chunk")


def answer_sampling(runtime: Any, request: GenerateRequest) -> SamplingParams:
    """How an answer is decoded, for either engine: the request's length and temperature,
    the repetition penalty, and the prompt's turn markers as stop strings."""
    return SamplingParams(
        max_tokens=request.max_new_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        repetition_penalty=REPETITION_PENALTY,
        frequency_penalty=FREQUENCY_PENALTY,
        stop=TURN_MARKERS,
    )


def _fit_context(
    runtime: Any, request: GenerateRequest
) -> tuple[list[int], list[list[int]], list[int], list[int]]:
    """(chunk ids kept, their token ids, suffix ids, dropped chunk ids): keep the newest
    turns that fit ``HISTORY_MAX_TOKENS``, then drop the least relevant (last) chunks until
    the prompt (passage markers included) and the answer fit the context."""
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
    dropped = [c.chunk_id for c in request.chunks[len(chunks) :]]
    return [c.chunk_id for c in chunks], [list(c.token_ids) for c in chunks], suffix, dropped


def complete_citation(runtime: Any, request: GenerateRequest, passages_ids, text: str):
    """``kvservice.citing.complete_citation`` over the kept chunks' text, for either engine."""
    passages = [runtime.engine.tokenizer.decode(ids) for ids in passages_ids]
    return citing.complete_citation(text, passages, request.question)


def chunk_keys(runtime: Any, request: GenerateRequest, chunks_tokens: list[list[int]]) -> list:
    """The store keys of the chunks ``_fit_context`` kept (the first of ``request.chunks``),
    each in the scope the web side stored it in."""
    kept = request.chunks[: len(chunks_tokens)]
    return [
        runtime.chunk_key(ids, ref.kv_scope) for ids, ref in zip(chunks_tokens, kept, strict=True)
    ]


def cached_prefix(runtime: Any, request: GenerateRequest, segments: list[list[int]]):
    """``(prefix, passages, keys, lengths)``: the KV an earlier prompt of this worker left for
    the longest run of this prompt's segments (``kvservice.prefix``), how many whole passages
    it holds, and the prompt's boundary keys and lengths (to keep this prompt's KV after).
    ``full`` mode reads none: it is the reference every other mode is measured against."""
    kept = request.chunks[: len(segments) // 2]
    scopes = [scope for ref in kept for scope in ("", ref.kv_scope)]  # marker, passage
    keys, lengths = boundaries(runtime.prompt.head_ids, segments, scopes)
    found = None
    if request.mode != "full" and runtime.prefix_cache.capacity_bytes > 0:
        found = runtime.prefix_cache.match(keys, lengths)
    if found is None:
        return None, 0, keys, lengths
    prefix, covered = found
    return prefix, covered // 2, keys, lengths


def keep_prefix(runtime: Any, result: Any, keys: list[str], lengths: list[int]) -> None:
    """Keep this prompt's context KV (everything before the question part) for a follow-up,
    in the store's 16-bit type; called once the answer is out, off the first token's path."""
    if not keys or runtime.prefix_cache.capacity_bytes <= 0:
        return
    dtype = runtime.store.config.narrow_to or result.cache.k.dtype
    runtime.prefix_cache.put(keys, lengths, PrefixKV.from_cache(result.cache, lengths[-1], dtype))


def answer_request(runtime: Any, request: GenerateRequest, redis: Any) -> dict[str, Any]:
    from kvservice.protocol import stop_requested

    started = time.perf_counter()
    request_id = request.request_id
    pieces: list[str] = []
    state: dict[str, Any] = {"first_token_at": None, "prefill": None, "prefill_s": None}
    done = threading.Event()
    outcome: dict[str, Any] = {}
    try:
        chunk_ids, chunks_tokens, suffix_ids, dropped = _fit_context(runtime, request)
        model, mode = runtime.model, request.mode
        # Each passage behind its number ("[1]"): the markers are computed fresh (None).
        segments = runtime.prompt.numbered(chunks_tokens)
        prefix, reused, prefix_keys, prefix_lengths = cached_prefix(runtime, request, segments)
        batch = None
        if mode == "full":
            sources = [_TokensOnly(ids) for ids in chunks_tokens]
        else:  # the passages the cached prefix holds are not loaded
            keys = chunk_keys(runtime, request, chunks_tokens)[reused:]
            batch = runtime.loader.open(
                keys, token_ids=chunks_tokens[reused:], recompute_fn=runtime.recompute_chunk
            )
            sources = [None] * reused + list(batch)
        sources = [part for source in sources for part in (None, source)]
        decision = None
        ratio = request.recompute_ratio
        if ratio is None and mode == "blend":
            decision = runtime.controller.choose(
                num_tokens=sum(len(ids) for ids in chunks_tokens[reused:]),
                num_layers=model.config.n_layers,
                load_bytes_by_tier=batch.tier_bytes() if batch is not None else {},
            )
            ratio = decision.recompute_ratio
        elif ratio is None:
            ratio = FIXED_RATIOS.get(mode) or 0.0

        def prefill(extra_capacity: int):
            t0 = time.perf_counter()
            result = blend_prefill(
                model, list(runtime.prompt.head_ids), sources, suffix_ids, mode=mode,
                recompute_ratio=ratio, chunk_ids=segments, head_kv=runtime.head_kv,
                extra_capacity=extra_capacity, cached_prefix=prefix,
            )  # fmt: skip
            state["prefill"], state["prefill_s"] = result, time.perf_counter() - t0
            return result

        def on_token(text: str, token_id: int) -> None:
            if state["first_token_at"] is None:
                state["first_token_at"] = time.perf_counter()
            if text:
                pieces.append(text)
                publish_event(redis, request_id, "token", text=text)

        def on_finish(reason: str, error: BaseException | None) -> None:
            outcome["reason"], outcome["error"] = reason, error
            done.set()

        job = Job(
            prefill=prefill,
            sampling=answer_sampling(runtime, request),
            stop_ids=set(runtime.engine.stop_ids),
            prompt_ids=[*runtime.prompt.head_ids, *(i for s in segments for i in s), *suffix_ids],
            on_token=on_token,
            on_finish=on_finish,
            should_stop=lambda: stop_requested(redis, request_id),
            deadline=time.monotonic() + request.timeout_s,
        )
        runtime.batcher.submit(job)
        if not done.wait(request.timeout_s + 30):
            raise TimeoutError("the engine did not finish the request in time")
        if outcome["error"] is not None:
            raise outcome["error"]
    except Exception as err:
        log.exception("request %s failed", request_id)
        message = f"{type(err).__name__}: {err}" if not isinstance(err, ValueError) else str(err)
        publish_event(redis, request_id, "error", message=message, text="".join(pieces))
        return {"status": "error", "text": "".join(pieces), "error": message, "metrics": {}}

    total_s = time.perf_counter() - started
    first = state["first_token_at"]
    result = state["prefill"]
    metrics: dict[str, Any] = {
        "mode": mode,
        "worker": getattr(runtime, "worker_id", ""),  # which inference worker answered
        "ttft_s": None if first is None else round(first - started, 4),
        "total_s": round(total_s, 4),
        "prefill_s": None if state["prefill_s"] is None else round(state["prefill_s"], 4),
        "recompute_ratio": ratio,
        "prompt_tokens": len(runtime.prompt.head_ids) + sum(map(len, segments)) + len(suffix_ids),
        "completion_tokens": None,
        "chunk_tiers": {str(cid): "prefix" for cid in chunk_ids[:reused]},
        "prefix_tokens": 0 if prefix is None else prefix.num_tokens,
        "dropped_chunks": dropped,
    }
    if result is not None:
        metrics["recompute_ratio_effective"] = round(result.recompute_ratio_effective, 4)
        if state["prefill_s"]:
            runtime.controller.observe_recompute(
                tokens=sum(result.recomputed_per_layer), layers=1, seconds=state["prefill_s"]
            )
    if batch is not None:
        load = batch.stats()
        metrics["chunk_tiers"].update(
            (str(cid), tier) for cid, tier in zip(chunk_ids[reused:], load.tiers, strict=True)
        )
        metrics["load_s"] = round(load.load_s, 4)
        metrics["hidden_load_fraction"] = round(load.hidden_load_fraction, 3)
        runtime.controller.observe_store_stats(runtime.store.stats().tiers)
    if decision is not None:
        metrics["controller"] = {"source": decision.source, "why": decision.why}
    status = "stopped" if outcome.get("reason") == "stopped" else "done"
    if status == "done":
        extra, metrics["citation"] = complete_citation(
            runtime, request, chunks_tokens, "".join(pieces)
        )
        if extra:
            pieces.append(extra)
            publish_event(redis, request_id, "token", text=extra)
    if result is not None:
        keep_prefix(runtime, result, prefix_keys, prefix_lengths)
    text = "".join(pieces)
    metrics["completion_tokens"] = len(job.tokens)
    # OpenAI's words: "length" when cut at max_new_tokens, "stop" otherwise (stopped included).
    metrics["finish_reason"] = "length" if outcome.get("reason") == "length" else "stop"
    publish_event(redis, request_id, "done", text=text, metrics=metrics, status=status)
    return {"status": status, "text": text, "error": "", "metrics": metrics}
