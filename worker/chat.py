"""Chat tasks: the inference worker reports each finished answer here to be stored; beat
ends the answers nobody will finish."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from kvservice.protocol import RECORD_TASK

log = logging.getLogger(__name__)

MALFORMED_REPORT = "The model worker reported this answer in a form this version cannot read."


@shared_task(name=RECORD_TASK, autoretry_for=(Exception,), retry_backoff=2, max_retries=5)
def record_answer(
    message_id: int | None, outcome: dict[str, Any], request_id: str | None = None
) -> None:
    """The worker's report of an answer (``AnswerOutcome.to_dict()``), on its own queue:
    stored, then the answer's stream (``request_id``; None from a worker that ended the stream
    itself) ended with it. Retried whole: both steps are idempotent."""
    from kvservice.protocol import AnswerOutcome
    from webapp.chat.services import record_report

    try:
        report = AnswerOutcome.from_dict(outcome)
    except ValueError as err:  # a worker of another version: fail the answer, keep its words
        log.error("answer %s: malformed report: %s", message_id, err)
        text = outcome.get("text") if isinstance(outcome.get("text"), str) else ""
        report = AnswerOutcome.failed(f"{MALFORMED_REPORT} ({err})", text)
    record_report(message_id=message_id, request_id=request_id, outcome=report)


@shared_task(name="worker.chat.reap_stale_answers", ignore_result=True)
def reap_stale_answers() -> int:
    from webapp.chat.reaper import reap_stale_answers as reap

    return reap()
