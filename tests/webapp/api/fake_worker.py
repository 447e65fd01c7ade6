"""A stand-in for the inference worker in fast tests: it takes generate requests off the
``inference`` queue (the real Celery message in Redis) and streams a canned answer through
the real protocol, so the API's waiting and streaming are exercised end to end."""

from __future__ import annotations

import base64
import json
import threading
import time

from kvservice.protocol import (
    INFERENCE_QUEUE,
    AnswerMetrics,
    AnswerOutcome,
    Token,
    end_of,
    publish_event,
)
from kvservice.serve.citing import passage_uses, verdict


class FakeInferenceWorker:
    """``queue``: the one it takes requests from; ``token_delay_s``: a pause before each token
    (a slow model, for the browser to see an answer stream); ``record``: report each answer to
    the web app as the real worker's record task does (``record_report``: stored, then the
    stream ended), else only end the stream; ``judged``:
    the real worker's verdict on the words over the request's passages (its [n], or "not
    found" with the words withheld); ``metrics``: measurements to report over the canned."""

    def __init__(
        self,
        client,
        *,
        words=("Arborio", " rice", " [1]."),
        fail: bool = False,
        finish_reason: str = "stop",
        queue: str = INFERENCE_QUEUE,
        token_delay_s: float = 0.0,
        record: bool = True,
        judged: bool = False,
        metrics: dict | None = None,
    ):
        self.client, self.words, self.fail = client, words, fail
        self.finish_reason, self.judged, self.metrics = finish_reason, judged, metrics or {}
        self.queue, self.token_delay_s, self.record = queue, token_delay_s, record
        self.requests: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeInferenceWorker:
        self.client.delete(self.queue)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            item = self.client.brpop(self.queue, timeout=1)
            if item is None:
                continue
            message = json.loads(item[1])
            args = json.loads(base64.b64decode(message["body"]))[0]
            request = args[0]
            self.requests.append(request)
            self._answer(request)

    def _answer(self, request: dict) -> None:
        """Stream the words and end as the real worker does: its outcome reported to the web
        app, whose record task stores it and ends the stream with it."""
        request_id = request["request_id"]
        if self.fail:
            self._report(request, AnswerOutcome.failed("model exploded"))
            return
        for word in self.words:
            time.sleep(self.token_delay_s)
            publish_event(self.client, request_id, Token(text=word))
        tiers = {str(chunk["chunk_id"]): "cpu" for chunk in request["chunks"]}
        metrics = {
            "ttft_s": 0.05,
            "total_s": 0.2,
            "mode": request["mode"],
            "recompute_ratio": 0.15,
            "chunk_tiers": tiers,
            "prompt_tokens": 40,
            "completion_tokens": len(self.words),
            "finish_reason": self.finish_reason,
            **self.metrics,
        }
        text, withheld = self._judge(request, metrics)
        passages = [chunk["text"] for chunk in request["chunks"]]
        chunk_ids = [chunk["chunk_id"] for chunk in request["chunks"]]
        outcome = AnswerOutcome.answered(
            "done",
            text=text,
            withheld=withheld,
            metrics=AnswerMetrics.from_dict(metrics),
            passages=passage_uses(text, passages, chunk_ids, tiers, request["question"]),
        )
        self._report(request, outcome)

    def _report(self, request: dict, outcome: AnswerOutcome) -> None:
        if not self.record or request.get("message_id") is None:
            publish_event(self.client, request["request_id"], end_of(outcome))
            return
        from django.db import connection

        from webapp.chat.services import record_report

        record_report(
            message_id=request["message_id"], request_id=request["request_id"], outcome=outcome
        )
        connection.close()  # this thread's own: the test database is dropped after the test

    def _judge(self, request: dict, metrics: dict) -> tuple[str, str]:
        """(the answer's text, its withheld words), streaming what the verdict adds and
        reporting how the answer cites in ``metrics``."""
        text = "".join(self.words)
        if not self.judged:
            return text, ""
        passages = [chunk["text"] for chunk in request["chunks"]]
        judged = verdict(text, passages, request["question"])
        if judged.streamed:
            publish_event(self.client, request["request_id"], Token(text=judged.streamed))
        metrics["citation"] = judged.citation
        return judged.text, judged.withheld
