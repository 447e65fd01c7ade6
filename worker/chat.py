"""Chat tasks: the inference worker reports each finished answer here to be stored; beat
ends the answers nobody will finish."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from kvservice.protocol import RECORD_TASK


@shared_task(name=RECORD_TASK, autoretry_for=(Exception,), retry_backoff=2, max_retries=5)
def record_answer(message_id: int | None, outcome: dict[str, Any]) -> None:
    """The worker's report of an answer (``AnswerOutcome.to_dict()``), on its own queue."""
    from kvservice.protocol import AnswerOutcome
    from webapp.chat.services import record_outcome

    record_outcome(message_id=message_id, outcome=AnswerOutcome.from_dict(outcome))


@shared_task(name="worker.chat.reap_stale_answers", ignore_result=True)
def reap_stale_answers() -> int:
    from webapp.chat.reaper import reap_stale_answers as reap

    return reap()
