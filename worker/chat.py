"""Chat tasks: the inference worker reports each finished answer here to be stored."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from kvservice.protocol import RECORD_TASK


@shared_task(name=RECORD_TASK, autoretry_for=(Exception,), retry_backoff=2, max_retries=5)
def record_answer(message_id: int, result: dict[str, Any]) -> None:
    from webapp.chat.services import chat_record_answer

    chat_record_answer(message_id=message_id, result=result)
