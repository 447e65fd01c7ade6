"""How one request will run, decided in one place for either engine (``plan_request``): what
of it fits the context, its chunks' store keys, how the answer is decoded, and its recompute
ratio (``RatioPolicy``). A runtime is handed the result (``Runtime.plan(request, planned)``)
and calls back once, into ``RatioPolicy.choose``, with what only it knows after opening the
chunks: the loader's estimate (the bytes each tier will deliver); the native plan also asks
``RatioPolicy.expected`` for the ratio to price its per-chunk loads at before that.

The ratio, in this order (``RatioPolicy``): the request's own (the admin's fixed ratio, which
the web app puts there: ``kvservice.protocol.ratio.plan_ratios``, the same decision that
turns the operator's fidelity target into the request's ``target_ratio`` on a curve measured
on this model), a fixed mode's, then the loading controller's choice for a blend from the
fidelity target's floor, else ``DEFAULT_RECOMPUTE_RATIO``, raised where loading is slower.
Progressive blend's refresh ratio is resolved here, once: the request's, else the worker's
``BLEND_REFRESH_RATIO``; the engine is handed it with the request.

``check_ratio_curve``: whether the measured curve the web app reads fits the worker's model,
logged at start and carried in the heartbeat.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvservice.blend.controller import LoadingController, RatioDecision
from kvservice.model.sampling import SamplingParams
from kvservice.protocol import GenerateRequest
from kvservice.protocol.curve import bench_command, configured_path, series_for_codec
from kvservice.protocol.prompt import TURN_MARKERS, PromptFormat
from kvservice.protocol.ratio import no_curve_note, resolve_refresh_ratio

log = logging.getLogger(__name__)

FIXED_RATIOS = {"full": 1.0, "prefix": None, "reuse": 0.0}

# The product's decoding, the same for both engines (kvservice.model.sampling.apply_penalties is
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


class Plannable(Protocol):
    """What the planner reads of a runtime (``kvservice.serve.answer.Runtime``)."""

    prompt: PromptFormat
    context_len: int
    controller: LoadingController
    refresh_ratio: float | None  # BLEND_REFRESH_RATIO (None: off), where a request sets none

    def chunk_key(self, token_ids: list[int], scope: str = ""): ...


@dataclass(frozen=True)
class FittedContext:
    """What of a request goes into the prompt (``fit_context``)."""

    chunk_ids: list[int]  # the passages kept, most relevant first
    chunks_tokens: list[list[int]]  # their token ids
    segments: list[list[int]]  # between head and question: "[1]", passage 1, "[2]", ...
    suffix_ids: list[int]  # the question part (earlier questions included)
    dropped: list[int]  # passages left out for room


@dataclass(frozen=True)
class RatioPolicy:
    """The recompute ratio of one request (the order is the module's docstring's)."""

    request: GenerateRequest
    controller: LoadingController
    worker_refresh_ratio: float | None = None

    @property
    def preset(self) -> float | None:
        """The ratio set before any measurement (the request's or a fixed mode's); None for
        a blend the controller decides."""
        if self.request.recompute_ratio is not None:
            return self.request.recompute_ratio
        if self.request.mode != "blend":
            return FIXED_RATIOS.get(self.request.mode) or 0.0
        return None

    def expected(self) -> float:
        """The ratio to plan loads for before the controller's choice: the preset, else the
        floor the controller starts from (the fidelity target's, else its own)."""
        preset = self.preset
        if preset is not None:
            return preset
        return self.request.target_ratio or self.controller.target_ratio

    def choose(
        self, *, num_tokens: int, num_layers: int, load_bytes: dict[str, int]
    ) -> tuple[float, RatioDecision | None]:
        """The ratio to run at, and the controller's decision when it made one: over the
        chunk tokens it would recompute and the bytes to load per tier."""
        if self.preset is not None:
            return self.preset, None
        decision = self.controller.choose(
            num_tokens=num_tokens,
            num_layers=num_layers,
            load_bytes_by_tier=load_bytes,
            target_ratio=self.request.target_ratio,
        )
        return decision.recompute_ratio, decision

    @property
    def refresh_ratio(self) -> float | None:
        """Progressive blend's ratio after the first token (None or 0: not upgraded)."""
        return resolve_refresh_ratio(self.request.refresh_ratio, self.worker_refresh_ratio)


@dataclass(frozen=True)
class PlannedRequest:
    """A request as ``plan_request`` prepared it for a runtime."""

    request: GenerateRequest
    fitted: FittedContext
    chunk_keys: list[Any]  # the kept chunks' store keys (kvservice.protocol.keys.ChunkKey)
    sampling: SamplingParams
    ratio: RatioPolicy


def plan_request(runtime: Plannable, request: GenerateRequest) -> PlannedRequest:
    fitted = fit_context(runtime.prompt, runtime.context_len, request)
    kept = request.chunks[: len(fitted.chunks_tokens)]
    keys = [
        runtime.chunk_key(ids, ref.kv_scope)
        for ids, ref in zip(fitted.chunks_tokens, kept, strict=True)
    ]  # each in the scope the web side stored it in
    policy = RatioPolicy(request, runtime.controller, runtime.refresh_ratio)
    return PlannedRequest(request, fitted, keys, answer_sampling(request), policy)


def check_ratio_curve(
    model_fingerprint: str, codec: str, path: str | Path | None = None
) -> dict[str, Any]:
    """Whether the measured ratio curve of ``codec`` (at ``path``, else ``RATIO_CURVE_PATH``'s)
    was measured on this model, for the heartbeat: where it was not, target mode reads no
    curve (``kvservice.protocol.ratio.plan_ratios``), and the worker's log says so at start."""
    path = configured_path() if path is None else Path(path)
    curve = series_for_codec(path, codec)
    if curve is None:
        return {"path": path.name, "codec": codec, "fits": None, "note": None}
    note = no_curve_note(curve, model_fingerprint, bench_command(str(path), codec))
    if note is not None:
        log.warning(
            "the ratio curve %s was measured on model %s, not this one (%s). %s",
            path.name,
            curve.model_fingerprint,
            model_fingerprint,
            note,
        )
    return {
        "path": path.name,
        "codec": codec,
        "model_fingerprint": curve.model_fingerprint,
        "fits": note is None,
        "note": note,
    }


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


def fit_context(prompt: PromptFormat, context_len: int, request: GenerateRequest) -> FittedContext:
    """Keep the newest turns that fit ``HISTORY_MAX_TOKENS``, then drop the least relevant
    (last) chunks until the prompt (passage markers included) and the answer fit the
    context."""
    budget = context_len - request.max_new_tokens - len(prompt.head_ids)
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
        chunk_ids=[c.chunk_id for c in chunks],
        chunks_tokens=tokens,
        segments=prompt.numbered(tokens),
        suffix_ids=suffix,
        dropped=[c.chunk_id for c in request.chunks[len(chunks) :]],
    )
