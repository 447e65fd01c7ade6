"""The typed wire contract between the inference worker and the web app: an answer's metrics
and its stream's events, each written and read by one pair of functions."""

from __future__ import annotations

import json
import uuid

import pytest
import redis

from kvservice.protocol import (
    AnswerMetrics,
    AnswerOutcome,
    Done,
    Error,
    PassageUse,
    Queue,
    Token,
    decode_events,
    end_of,
    outcome_of,
    publish_event,
    stream_ended,
)
from kvservice.protocol.events import answer_stream, decode_event, encode_event

MEASURED = AnswerMetrics(
    mode="blend",
    worker="host:42",
    ttft_s=0.31,
    second_token_s=0.4,
    total_s=1.25,
    recompute_ratio=0.15,
    prompt_tokens=412,
    completion_tokens=37,
    finish_reason="length",
    temperature=0.7,
    seed=11,
    dropped_chunks=(9, 10),
    citation="cited",
    controller={"source": "auto", "why": {"load_s": 0.02}},
    chunk_tiers={"3": "cpu", "4": "s3"},
    recomputed_chunks=1,
    queue_s=0.01,
    prefill_s=0.2,
    load_s=0.05,
    hidden_load_fraction=0.8,
)


def test_metrics_round_trip_through_json() -> None:
    again = AnswerMetrics.from_dict(json.loads(json.dumps(MEASURED.to_dict())))
    assert again == MEASURED
    assert again.dropped_chunks == (9, 10) and again.chunk_tiers == {"3": "cpu", "4": "s3"}


def test_an_older_workers_metrics_missing_keys_read_as_their_defaults() -> None:
    """A worker from before a key existed sends none: the default is what a ``.get`` read."""
    older = {
        k: v
        for k, v in MEASURED.to_dict().items()
        if k not in ("second_token_s", "seed", "prefix_cache", "chunk_tiers", "finish_reason")
    }
    read = AnswerMetrics.from_dict(older | {"speculated": 3})  # and a newer worker's key
    assert read.second_token_s is None and read.seed is None and read.prefix_cache is False
    assert read.chunk_tiers == {} and read.finish_reason == ""
    assert read.ttft_s == 0.31 and read.mode == "blend"
    assert AnswerMetrics.from_dict({}) == AnswerMetrics()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("ttft_s", "0.3"),
        ("prompt_tokens", 4.5),
        ("prompt_tokens", True),
        ("mode", None),
        ("chunk_tiers", {"3": 1}),
        ("dropped_chunks", ["9"]),
        ("prefix_cache", 1),
        ("controller", "auto"),
    ],
)
def test_metrics_of_the_wrong_type_are_refused_by_name(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=repr(key)):
        AnswerMetrics.from_dict(MEASURED.to_dict() | {key: value})


def test_a_json_integer_is_a_float_measure() -> None:
    assert AnswerMetrics.from_dict({"ttft_s": 1, "temperature": 0}).ttft_s == 1


def test_the_outcome_carries_typed_metrics_and_refuses_bad_ones() -> None:
    outcome = AnswerOutcome.answered(
        "done",
        text="Vienna [1].",
        metrics=MEASURED,
        passages=[PassageUse(rank=1, chunk_id=3, tier="cpu", cited=True, highlight=(0, 6))],
    )
    assert AnswerOutcome.from_dict(json.loads(json.dumps(outcome.to_dict()))) == outcome
    bad = outcome.to_dict() | {"metrics": {"total_s": "soon"}}
    with pytest.raises(ValueError, match="total_s"):
        AnswerOutcome.from_dict(bad)


EVENTS = [
    Token(text="Vienna "),
    Token(text=""),
    Queue(ahead=3),
    Queue(ahead=None),
    Done(AnswerOutcome.answered("done", text="Vienna [1].", metrics=MEASURED)),
    Done(AnswerOutcome.stopped_unstarted()),
    Error(code="generation_failed", message="TimeoutError: too slow", text="Vien"),
    Error(code="not_answered", message="No model worker took this question in time."),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_each_event_round_trips_through_its_stream_fields(event) -> None:
    fields = encode_event(event)
    assert set(fields) == {"type", "data"} and fields["type"] == event.kind
    assert decode_event(fields["type"], json.loads(fields["data"])) == event


def test_events_round_trip_through_a_real_stream(redis_service) -> None:
    client = redis.Redis.from_url(redis_service.env["REDIS_URL"])
    request_id = uuid.uuid4().hex
    for event in EVENTS:
        publish_event(client, request_id, event)
    name = answer_stream(request_id)
    read = [event for _id, event in decode_events([(name, client.xrange(name))])]
    assert read == EVENTS


def test_one_error_shape_and_an_older_workers_error_reads_as_one() -> None:
    assert json.loads(encode_event(EVENTS[-2])["data"]) == {
        "code": "generation_failed",
        "message": "TimeoutError: too slow",
        "text": "Vien",
    }
    older = decode_event("error", {"message": "model exploded", "text": ""})  # no code
    assert older == Error(code="generation_failed", message="model exploded")


@pytest.mark.parametrize(
    ("kind", "data"),
    [
        ("tokens", {"text": "x"}),
        ("token", {"text": 3}),
        ("queue", {"ahead": "2"}),
        ("error", {"code": "oops", "message": "m"}),
        ("error", {"code": "not_answered"}),
        ("done", {"metrics": {"ttft_s": [1]}}),
    ],
)
def test_a_malformed_event_is_refused(kind: str, data: dict) -> None:
    with pytest.raises(ValueError):
        decode_event(kind, data)


def test_an_outcome_ends_a_stream_as_done_or_as_an_error() -> None:
    done = AnswerOutcome.answered("stopped", text="Vi", metrics=MEASURED)
    assert end_of(done) == Done(done) and outcome_of(end_of(done)) == done
    failed = AnswerOutcome.failed("model exploded", "Vi")
    assert end_of(failed, "not_answered") == Error("not_answered", "model exploded", "Vi")
    assert outcome_of(end_of(failed)) == failed


def test_a_stream_has_ended_once_its_last_entry_is_done_or_error(redis_service) -> None:
    client = redis.Redis.from_url(redis_service.env["REDIS_URL"])
    request_id = uuid.uuid4().hex
    assert not stream_ended(client, request_id)  # no stream yet
    publish_event(client, request_id, Token(text="Vienna"))
    assert not stream_ended(client, request_id)
    publish_event(client, request_id, Error("not_answered", "gone"))
    assert stream_ended(client, request_id)
