"""What the inference worker measured of one answer (``AnswerMetrics``), as it travels in the
answer's outcome (``kvservice.protocol.outcome``) and as the web app reads it.

Every field has a default: a worker from before a field existed sends no key for it, and an
engine that does not measure something (the vLLM one has no store of its own, so no load
time) leaves it out; the default is what the web app read for a missing key before the
metrics were typed (``None`` for a measure, ``""`` or ``False`` where it only tested the value),
so a missing key means what it meant. The types are checked (``from_dict``): a worker that
sends a measure of the wrong type is refused by name, never stored as a wrong number. A key
this version does not know (a newer worker) is left out.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AnswerMetrics:
    """One answer's measurements (seconds from the worker's start of the request)."""

    mode: str = ""  # "blend", "full", "reuse"; "" unknown: the answer's own mode stands
    worker: str = ""  # which inference worker answered (``host:pid``)
    engine: str = ""  # "vllm" on that engine; "" the native one
    ttft_s: float | None = None  # to the first token
    second_token_s: float | None = None  # progressive blend's upgrade comes before it
    total_s: float | None = None  # to the last words streamed (what follows is not the wait)
    # the longest wait between two of its tokens as the worker streamed them (the reader's
    # pauses add the way through Redis and the web server)
    longest_pause_s: float | None = None
    recompute_ratio: float | None = None  # None: no ratio ran (the prefix cache served all)
    recompute_ratio_effective: float | None = None  # what the blend recomputed in fact
    refresh_ratio: float | None = None  # progressive blend's upgrade, when it ran
    refresh_s: float | None = None
    refresh_skipped: str | None = None  # why the upgrade did not run
    prefix_cache: bool = False  # every passage's KV came from the previous turn's context
    prefix_tokens: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str = ""  # OpenAI's words: "stop" or "length"; "" no answer was written
    repeat_suppressed: bool = False
    temperature: float = 0.0  # 0: greedy; above: a sampled attempt
    seed: int | None = None
    dropped_chunks: tuple[int, ...] = ()  # passages left out for room
    citation: str | None = None  # "cited", "not_found", "unsupported"; None: not judged
    nothing_retrieved: bool = False  # the web app's answer with no passage: no model ran
    # The loading controller's choice of the ratio: {"source": ..., "why": {...}}
    controller: dict[str, Any] | None = None
    # Where each passage's KV came from, by chunk id: "cpu", "disk", "s3", "prefix", ...
    chunk_tiers: dict[str, str] = field(default_factory=dict)
    recomputed_chunks: int | None = None  # chunks the load plan recomputed whole
    queue_s: float | None = None  # waiting for the engine
    prefill_s: float | None = None
    prefill_wall_s: float | None = None
    load_s: float | None = None
    hidden_load_fraction: float | None = None  # of the load time, the share under compute

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"dropped_chunks": list(self.dropped_chunks)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnswerMetrics:
        """The metrics ``to_dict`` wrote (or an older worker's: a missing key takes its
        default); raises ``ValueError`` naming the first key whose value has the wrong type."""
        if not isinstance(data, dict):
            raise ValueError(f"metrics are an object, not {type(data).__name__}")
        values = {}
        for name, hint in _FIELD_TYPES.items():
            if name in data:
                values[name] = _checked(name, data[name], hint)
        return cls(**values)


def _checked(name: str, value: Any, hint: Any) -> Any:
    """``value`` when it is of the field's type (an int where a float is due, as JSON may
    write 1.0; a list where a tuple is, made a tuple), else ``ValueError``."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for kind in allowed:
        base = typing.get_origin(kind) or kind
        if value is None and kind is type(None):
            return value
        if base is float and isinstance(value, int | float) and not isinstance(value, bool):
            return value
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base in (str, bool) and isinstance(value, base):
            return value
        if base is tuple and isinstance(value, list | tuple) and _all_ints(value):
            return tuple(value)
        if base is dict and isinstance(value, dict) and _dict_of(kind, value):
            return value
    raise ValueError(f"metrics {name!r}: {type(value).__name__} {value!r} is not {hint}")


def _all_ints(values: list | tuple) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _dict_of(hint: Any, value: dict) -> bool:
    """Whether a dict's keys are text and, for ``dict[str, str]``, its values too."""
    value_type = typing.get_args(hint)[1]
    return all(isinstance(k, str) for k in value) and (
        value_type is Any or all(isinstance(v, value_type) for v in value.values())
    )


_FIELD_TYPES = typing.get_type_hints(AnswerMetrics)
