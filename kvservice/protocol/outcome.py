"""How an answer ended, as the worker reports it and the web app records it: one typed
``AnswerOutcome``, built here and nowhere else.

The inference worker builds the outcome of every answer it writes (``AnswerOutcome.answered``
or ``.failed``), with what it measured (``AnswerMetrics``) and, per passage, whether the answer
cites it, the sentence that supports it and the tier its KV came from: worked out once, where
the passages are. The outcome travels once: in the ``RECORD_TASK`` report, so the answer is
stored even if nobody is watching; the web side's record task then ends the answer's stream
with it (``kvservice.protocol.events``: ``Done``, or ``Error``), so readers waiting on the
stream end when the answer is recorded. The web side ends answers no worker will finish with
``AnswerOutcome.failed``, answers with no passage to read with ``.nothing_retrieved``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvservice.protocol.metrics import AnswerMetrics

DONE, STOPPED, ERROR = "done", "stopped", "error"


@dataclass(frozen=True)
class PassageUse:
    """What the answer made of the passage numbered ``rank`` in its prompt."""

    rank: int  # 1-based: the "[n]" the passage carried in the prompt
    chunk_id: int
    tier: str  # where its KV came from: "cpu", "disk", "s3", "prefix", "computed", ...
    cited: bool  # the answer cites it inline ("[n]")
    # The span, in the passage's text, of the sentence that supports the answer, if one does.
    highlight: tuple[int, int] | None = None


@dataclass(frozen=True)
class AnswerOutcome:
    """An answer's end: ``status`` is ``done``, ``stopped`` or ``error``.

    ``text`` is the answer as recorded: the model's words, except for an answer no passage
    supports, whose words are ``withheld`` and whose text says "not found"
    (``kvservice.serve.citing.verdict``). ``metrics`` is what the worker measured
    (``AnswerMetrics``; none for an answer no worker wrote); ``passages`` the passages the
    prompt kept, in rank order; ``audit_of`` is set on a fidelity re-run of another answer.
    """

    status: str
    text: str = ""
    withheld: str = ""
    error: str = ""
    metrics: AnswerMetrics = field(default_factory=AnswerMetrics)
    passages: list[PassageUse] = field(default_factory=list)
    audit_of: int | None = None

    @property
    def ok(self) -> bool:
        return self.status != ERROR

    @classmethod
    def answered(cls, status: str, **fields: Any) -> AnswerOutcome:
        """The worker's outcome of an answer it wrote to the end (or until stopped)."""
        if status not in (DONE, STOPPED):
            raise ValueError(f"an answered outcome is done or stopped, not {status!r}")
        return cls(status=status, **fields)

    @classmethod
    def failed(cls, error: str, text: str = "", audit_of: int | None = None) -> AnswerOutcome:
        """An answer that ended in ``error`` (the words streamed before it kept)."""
        return cls(status=ERROR, text=text, error=error or "The model failed.", audit_of=audit_of)

    @classmethod
    def stopped_unstarted(cls) -> AnswerOutcome:
        """An answer stopped before any worker took it."""
        return cls(status=STOPPED)

    @classmethod
    def nothing_retrieved(cls, text: str, mode: str) -> AnswerOutcome:
        """The web app's answer when no passage was close enough to read: no generation."""
        metrics = AnswerMetrics(
            mode=mode,
            prompt_tokens=0,
            completion_tokens=0,
            finish_reason="stop",
            nothing_retrieved=True,
            citation="not_found",
        )
        return cls(status=DONE, text=text, metrics=metrics)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"metrics": self.metrics.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnswerOutcome:
        """The outcome ``to_dict`` wrote; fields this version does not know are left out, and
        metrics of the wrong type raise ``ValueError`` (``AnswerMetrics.from_dict``)."""
        passages = [
            PassageUse(**{**p, "highlight": tuple(p["highlight"]) if p.get("highlight") else None})
            for p in data.get("passages") or []
        ]
        return cls(
            status=data.get("status") or DONE,
            text=data.get("text") or "",
            withheld=data.get("withheld") or "",
            error=data.get("error") or "",
            metrics=AnswerMetrics.from_dict(data.get("metrics") or {}),
            passages=passages,
            audit_of=data.get("audit_of"),
        )
