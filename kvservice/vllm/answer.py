"""One request through vLLM, inside the inference worker (``ENGINE=vllm``): fit the prompt
into the context, choose the recompute ratio, send the request to vLLM (``reuse``/``blend``
carry their blend plan to the connector), stream each token to Redis, and return the answer
with its metrics, as ``kvservice.answer.answer_request`` does for the native engine."""

from __future__ import annotations

import logging
import time
from typing import Any

from kvservice.answer import (
    FIXED_RATIOS,
    _fit_context,
    answer_sampling,
    chunk_keys,
    complete_citation,
)
from kvservice.prompt import Prompt
from kvservice.protocol import GenerateRequest, publish_event, stop_requested
from kvservice.vllm.engine import VllmRequest

log = logging.getLogger(__name__)


def answer_request(runtime: Any, request: GenerateRequest, redis: Any) -> dict[str, Any]:
    with runtime.request_in_flight():
        return _answer(runtime, request, redis)


def _answer(runtime: Any, request: GenerateRequest, redis: Any) -> dict[str, Any]:
    started = time.perf_counter()
    request_id, mode = request.request_id, request.mode
    pieces: list[str] = []
    first_token_at = None
    status, decision, completion_tokens, finish_reason = "done", None, 0, "stop"
    try:
        chunk_ids, chunks_tokens, suffix_ids, dropped = _fit_context(runtime, request)
        keys = chunk_keys(runtime, request, chunks_tokens)
        tiers = [runtime.store.where(key) or "missing" for key in keys]
        ratio = request.recompute_ratio
        if ratio is None and mode == "blend":
            load_bytes: dict[str, int] = {}
            per_token = runtime.kv_bytes_per_token(element_size=2)  # stored as 16-bit
            for tier, ids in zip(tiers, chunks_tokens, strict=True):
                load_bytes[tier] = load_bytes.get(tier, 0) + per_token * len(ids)
            load_bytes.pop("missing", None)
            decision = runtime.controller.choose(
                num_tokens=sum(map(len, chunks_tokens)),
                num_layers=runtime.config.n_layers,
                load_bytes_by_tier=load_bytes,
            )
            ratio = decision.recompute_ratio
        elif ratio is None:
            ratio = FIXED_RATIOS.get(mode) or 0.0
        # Each passage behind its number ("[1]"); a marker is in no store, so vLLM
        # prefills it itself.
        segments = runtime.prompt.numbered(chunks_tokens)
        segment_keys = [
            part
            for key, marker in zip(keys, segments[::2], strict=True)
            for part in (runtime.chunk_key(marker).to_string(), key.to_string())
        ]
        vllm_request = VllmRequest(
            Prompt(list(runtime.prompt.head_ids), segments, suffix_ids),
            mode=mode,
            chunk_keys=segment_keys,
            recompute_ratio=ratio,
            sampling=answer_sampling(runtime, request),
        )
        deadline = time.monotonic() + request.timeout_s
        events = runtime.engine.stream(vllm_request)
        try:
            for event in events:
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                if event.token_id not in runtime.engine.stop_ids:
                    completion_tokens += 1
                finish_reason = event.finish_reason or finish_reason
                if event.text:
                    pieces.append(event.text)
                    publish_event(redis, request_id, "token", text=event.text)
                if stop_requested(redis, request_id):
                    status = "stopped"
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the engine did not finish the request in time")
        finally:
            events.close()  # aborts the request in vLLM when we left early
    except Exception as err:
        log.exception("request %s failed", request_id)
        message = f"{type(err).__name__}: {err}" if not isinstance(err, ValueError) else str(err)
        publish_event(redis, request_id, "error", message=message, text="".join(pieces))
        return {"status": "error", "text": "".join(pieces), "error": message, "metrics": {}}

    citation = None
    if status == "done":
        extra, citation = complete_citation(runtime, request, chunks_tokens, "".join(pieces))
        if extra:
            pieces.append(extra)
            publish_event(redis, request_id, "token", text=extra)
    text = "".join(pieces)
    metrics: dict[str, Any] = {
        "mode": mode,
        "worker": getattr(runtime, "worker_id", ""),  # which inference worker answered
        "engine": "vllm",
        "ttft_s": None if first_token_at is None else round(first_token_at - started, 4),
        "total_s": round(time.perf_counter() - started, 4),
        "prefill_s": None,
        "recompute_ratio": ratio,
        "prompt_tokens": len(vllm_request.prompt.token_ids),
        "completion_tokens": completion_tokens,
        "finish_reason": finish_reason,  # vLLM's: "length" when cut at max_tokens
        "chunk_tiers": {str(cid): tier for cid, tier in zip(chunk_ids, tiers, strict=True)},
        "dropped_chunks": dropped,
        "citation": citation,
    }
    if decision is not None:
        metrics["controller"] = {"source": decision.source, "why": decision.why}
    publish_event(redis, request_id, "done", text=text, metrics=metrics, status=status)
    return {"status": status, "text": text, "error": "", "metrics": metrics}
