"""What the web app asks the inference worker: the Celery tasks and queues, and the request
of one answer (``GenerateRequest``, sent as ``to_dict()``)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

INFERENCE_QUEUE = "inference"
GENERATE_TASK = "kvservice.generate"
# The worker reports each finished answer with this task, on a queue of its own: a report
# never waits behind a document's ingest (the Celery worker serves ``answers`` first). Args:
# [message id, ``AnswerOutcome.to_dict()``, request id]; the task stores the outcome, then
# ends the answer's stream with it (the outcome's one journey: ``kvservice.protocol.events``).
RECORD_TASK = "worker.chat.record_answer"
RECORD_QUEUE = "answers"
# Cache actions the dashboard sends to the inference worker (it owns the tiers):
EVICT_TASK = "kvservice.evict"  # args: [list of ChunkKey strings] -> dropped from every tier
WARM_TASK = "kvservice.warm"  # args: [list of ChunkKey strings, tier name] -> loaded into it


@dataclass(frozen=True)
class ChunkRef:
    chunk_id: int
    token_ids: list[int]
    kv_scope: str = ""  # whose KV objects to read and write (kvservice.protocol.keys.ChunkKey)
    # What a worker reading KV through the knowledge delivery API (KV_SOURCE=kdn) asks for:
    # the chunk's text (the API finds KV by text), and a token the web app signed for this
    # request's user, valid until the request's timeout (the worker holds no key of its own).
    # "" in both (a job queued before they existed): the chunk is recomputed, never fetched.
    text: str = ""
    kdn_token: str = ""


@dataclass(frozen=True)
class Turn:
    role: str  # "user" | "assistant"
    content: str


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    question: str
    chunks: list[ChunkRef]
    mode: str = "blend"
    history: list[Turn] = field(default_factory=list)
    message_id: int | None = None
    recompute_ratio: float | None = None  # None: the controller (or the admin's fixed value)
    # The least ratio the measured curve says reaches the operator's fidelity target: the
    # controller's floor for this request in r_min's place (loading may raise it).
    target_ratio: float | None = None
    # Progressive blend: the ratio a blend's cache is upgraded to after the first token
    # (kvservice.blend.prefill.refresh); None: the worker's BLEND_REFRESH_RATIO, 0: not upgraded.
    refresh_ratio: float | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy (a first answer); above: sampled (an answer again)
    top_p: float = 1.0
    seed: int | None = None  # the sampling's seed, recorded with the answer
    timeout_s: float = 300.0
    # Set on a fidelity-audit re-run (mode "full") of the blend answer with this message id:
    # the worker reports the result with it instead of a message of its own.
    audit_of: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerateRequest:
        """The request ``to_dict`` wrote. Fields this version does not know (a newer web app
        during a rolling upgrade) are left out, not refused."""
        known = {f.name for f in dataclasses.fields(cls)}
        data = {name: value for name, value in data.items() if name in known}
        data["chunks"] = [ChunkRef(**c) for c in data.get("chunks", [])]
        data["history"] = [Turn(**t) for t in data.get("history", [])]
        return cls(**data)
