"""The request the web app queues and the inference worker reads."""

from __future__ import annotations

import json
import time
import uuid

import redis

from kvservice.protocol import (
    AnswerOutcome,
    ChunkRef,
    Done,
    GenerateRequest,
    Token,
    Turn,
    first_token_time_s,
    publish_event,
)


def test_a_request_round_trips_and_a_newer_versions_fields_are_left_out():
    request = GenerateRequest(
        request_id="r",
        question="q",
        chunks=[ChunkRef(1, [5, 6], "scope")],
        history=[Turn("user", "hi")],
        target_ratio=0.1,
        refresh_ratio=0.25,
    )
    data = json.loads(json.dumps(request.to_dict()))
    assert GenerateRequest.from_dict(data) == request
    newer = dict(data, speculative_tokens=4)  # a field a newer web app sends
    assert GenerateRequest.from_dict(newer) == request
    older = {k: v for k, v in data.items() if k != "refresh_ratio"}  # queued before it existed
    assert GenerateRequest.from_dict(older).refresh_ratio is None


def test_the_first_tokens_time_is_read_from_its_stream_entry(redis_service) -> None:
    """The first words are dated by their stream entry (the stream server's clock); a stream
    that begins without a token has none."""
    client = redis.Redis.from_url(redis_service.env["REDIS_URL"])
    answered, silent = uuid.uuid4().hex, uuid.uuid4().hex
    before = time.time()
    publish_event(client, answered, Token(text="Six"))
    time.sleep(0.05)
    publish_event(client, answered, Done(AnswerOutcome("done", text="Six")))
    publish_event(client, silent, Done(AnswerOutcome("done")))
    first = first_token_time_s(client, answered)
    assert first is not None and abs(first - before) < 0.04  # the token's, not "done"'s
    assert first_token_time_s(client, silent) is None
    assert first_token_time_s(client, uuid.uuid4().hex) is None  # no stream at all
