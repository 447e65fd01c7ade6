"""What of a streamed answer is shown (kvservice.model.sampling.AnswerText): a repeat ends the
answer before it is shown, an answer cut at the token cap ends at a sentence or a whole word,
and what was shown is never taken back; the inference worker (kvservice.serve.answer) streams and
records answers through it."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import redis

from kvservice.model.sampling import _ANSWER_WORD, AnswerText, starts_word
from kvservice.protocol import (
    AnswerOutcome,
    ChunkRef,
    GenerateRequest,
    PassageUse,
    TokenEvent,
    answer_stream,
    first_token_time_s,
)
from kvservice.protocol.prompt import PromptFormat
from kvservice.serve.answer import answer_request
from kvservice.serve.citing import UNSUPPORTED, WITHDRAWN


def stream(pieces: list[str], *, cut: bool) -> tuple[AnswerText, list[str]]:
    text = AnswerText()
    shown = [text.push(piece) for piece in pieces]
    shown.append(text.finish(cut=cut))
    assert "".join(shown) == text.text  # what was shown is the final text, nothing taken back
    return text, shown


def words(text: str) -> list[str]:
    """``text`` in pieces as a tokenizer streams it: each word with the space before it."""
    first, *rest = text.split(" ")
    return [first, *(" " + word for word in rest)]


def test_an_answer_that_ends_normally_is_shown_whole() -> None:
    answer = "The Osprey seats four people [1]. It needs a certified coxswain on board."
    text, _ = stream(words(answer), cut=False)
    assert text.text == answer and not text.repeated


def test_a_sentence_said_again_ends_the_answer_before_it_is_shown() -> None:
    looping = "The Gannet seats six. The Gannet seats six. The Gannet seats six."
    text, shown = stream(words(looping), cut=False)
    assert text.repeated and text.text == "The Gannet seats six."
    assert "".join(shown).count("Gannet") == 1


def test_a_run_of_words_said_again_ends_the_answer() -> None:
    looping = (
        "Boats stay in when the wind speed is above 25 knots and the wind speed is above 25 knots"
    )
    text, _ = stream(words(looping), cut=False)
    assert text.repeated
    assert text.text == "Boats stay in when the wind speed is above 25 knots and"


def test_a_short_line_said_a_third_time_ends_the_answer() -> None:
    # Too short for a run of six words or a sentence of three: "12:30" five times passed.
    text, _ = stream(["The", " ferry", " leaves", " at", ":\n"] + ["12:30\n"] * 5, cut=False)
    assert text.repeated and text.text == "The ferry leaves at:\n12:30\n12:30"
    text, _ = stream(["Yes\n"] * 5, cut=False)
    assert text.repeated and text.text == "Yes\nYes"
    different = "Opening: 12:30\nLast boat: 12:30\nClosing: 12:30\n"  # lines, not repeats
    text, _ = stream([line + "\n" for line in different.splitlines()], cut=False)
    assert not text.repeated and text.text == different


def test_a_repeated_list_item_is_cut_with_its_marker() -> None:
    looping = "- The gate shuts at 12:30 [1].\n" * 3
    text, _ = stream(words(looping), cut=False)
    assert text.repeated and text.text == "- The gate shuts at 12:30 [1]."  # no dangling "-"


def test_a_cut_answer_ends_at_its_last_sentence_within_the_held_words() -> None:
    text, _ = stream(words("It seats six. The Osprey and the Sk"), cut=True)
    assert text.text == "It seats six."


def test_a_cut_answer_without_a_sentence_end_stops_at_a_whole_word_and_says_so() -> None:
    answer = "The boats are the Gannet which carries the winch and the Osprey and the Sk"
    text, _ = stream(words(answer), cut=True)
    assert text.text == "The boats are the Gannet which carries the winch and the Osprey and the…"


def test_the_stream_holds_back_only_the_last_words() -> None:
    text = AnswerText()
    shown = "".join(text.push(piece) for piece in words("one two three four five six seven eight"))
    assert shown == "one two"  # the last six words wait: they could begin a repeat


class ScriptedPlan:
    """An engine's plan that streams ``pieces``, the last with ``finish_reason``, and
    reports ``engine_metrics`` after."""

    ratio, decision, prompt_tokens = 0.15, None, 40

    def __init__(
        self, pieces: list[str], finish_reason: str, engine_metrics=None, places=()
    ) -> None:
        self.pieces, self.finish_reason, self.taken = pieces, finish_reason, 0
        self.engine_metrics = engine_metrics or {}
        self.places = places  # told to on_queue before the first token, as the batcher does

    def events(self, on_queue=None) -> Iterator[TokenEvent]:
        for place in self.places:
            on_queue(place)
        for index, piece in enumerate(self.pieces):
            self.taken += 1
            last = index == len(self.pieces) - 1
            yield TokenEvent(
                index + 1, piece, index, finish_reason=self.finish_reason if last else None
            )

    def finish(self) -> dict:
        return dict(self.engine_metrics)


def answer_through_the_worker(smollm2_tokenizer, redis_service, plan: ScriptedPlan):
    """``answer_request`` on ``plan``, with the real prompt format and valkey: its outcome,
    checked against the text its stream's token events add up to; the outcome is the
    worker's report, never on the stream (the web side ends the stream once it is stored)."""
    client = redis.Redis.from_url(redis_service.env["REDIS_URL"])
    runtime = SimpleNamespace(
        prompt=PromptFormat.for_tokenizer(smollm2_tokenizer),
        context_len=2048,
        tokenizer=smollm2_tokenizer,
        engine=SimpleNamespace(stop_ids=set()),
        plan=lambda planned: plan,
        controller=None,
        refresh_ratio=None,
        chunk_key=lambda token_ids, scope="": (scope, tuple(token_ids)),
    )
    passage = "The Gannet seats six people. The Osprey seats four."
    request = GenerateRequest(
        request_id=uuid.uuid4().hex,
        question="How many does the Gannet seat?",
        chunks=[ChunkRef(chunk_id=1, token_ids=smollm2_tokenizer.encode(passage))],
    )
    plan.request_id = request.request_id
    result = answer_request(runtime, request, client)
    events = [
        (fields[b"type"].decode(), json.loads(fields[b"data"]))
        for _, fields in client.xrange(answer_stream(request.request_id))
    ]
    streamed = "".join(data["text"] for kind, data in events if kind == "token")
    assert {kind for kind, _ in events} <= {"queue", "token"}  # sent once: in the report
    assert AnswerOutcome.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    if not result.withheld:  # the words streamed are the answer
        assert streamed == result.text
    else:  # the words streamed, then withdrawn; the answer is "not found"
        assert streamed == result.withheld + WITHDRAWN
    return result


def test_the_questions_place_in_line_goes_on_its_stream_before_its_words(
    smollm2_tokenizer, redis_service
) -> None:
    """The engine's places for a waiting question reach its stream as ``queue`` events, and
    the stream's first token is still found as the first token (the TTFT the page shows)."""
    plan = ScriptedPlan(
        words("The Gannet seats six people [1]."), finish_reason="stop", places=(2, 1, 0, None)
    )
    client = redis.Redis.from_url(redis_service.env["REDIS_URL"])
    result = answer_through_the_worker(smollm2_tokenizer, redis_service, plan)
    request_id = plan.request_id
    events = [
        (fields[b"type"].decode(), json.loads(fields[b"data"]))
        for _, fields in client.xrange(answer_stream(request_id))
    ]
    kinds = [kind for kind, _ in events]
    assert kinds[:5] == ["queue"] * 4 + ["token"]
    assert [data["ahead"] for kind, data in events if kind == "queue"] == [2, 1, 0, None]
    first_token_id = client.xrange(answer_stream(request_id))[4][0].decode()
    assert first_token_time_s(client, request_id) == int(first_token_id.split("-")[0]) / 1000
    assert result.text.startswith("The Gannet seats six people")


def test_the_worker_ends_a_looping_answer_and_stops_the_engine(
    smollm2_tokenizer, redis_service
) -> None:
    plan = ScriptedPlan(words("The Gannet seats six [1]. " * 20), finish_reason="length")
    result = answer_through_the_worker(smollm2_tokenizer, redis_service, plan)
    assert result.text == "The Gannet seats six [1]."
    assert plan.taken < len(plan.pieces)  # the engine was stopped at the repeat
    metrics = result.metrics
    assert metrics.repeat_suppressed and metrics.finish_reason == "stop"


def test_the_worker_cuts_an_answer_at_the_cap_at_a_word_and_says_so(
    smollm2_tokenizer, redis_service
) -> None:
    pieces = words("The boats are the Gannet which carries the winch and the Osprey and the Sk")
    result = answer_through_the_worker(
        smollm2_tokenizer, redis_service, ScriptedPlan(pieces, finish_reason="length")
    )
    cut = "The boats are the Gannet which carries the winch and the Osprey and the…"
    assert result.text == cut + " [1]"  # the citation the worker completes comes after
    assert result.metrics.finish_reason == "length"
    assert not result.metrics.repeat_suppressed


def test_the_worker_withholds_an_answer_no_passage_supports(smollm2_tokenizer, redis_service):
    """One verdict: "not found", the model's words kept apart (and, on the stream, withdrawn)
    rather than an answer followed by a note that nothing supports it."""
    plan = ScriptedPlan(words("The answer is: 4"), finish_reason="stop")
    result = answer_through_the_worker(smollm2_tokenizer, redis_service, plan)
    assert result.text == UNSUPPORTED and "4" not in result.text
    assert result.withheld == "The answer is: 4"
    assert result.metrics.citation == "unsupported"


def test_a_supported_answer_carries_no_not_found_note(smollm2_tokenizer, redis_service):
    plan = ScriptedPlan(words("The Gannet seats six people."), finish_reason="stop")
    result = answer_through_the_worker(smollm2_tokenizer, redis_service, plan)
    assert result.text == "The Gannet seats six people. [1]" and not result.withheld
    assert "could not find" not in result.text
    passage = "The Gannet seats six people. The Osprey seats four."
    highlight = (0, len("The Gannet seats six people."))  # its first sentence, not the other
    assert result.passages == [PassageUse(1, 1, "", cited=True, highlight=highlight)]
    assert passage[slice(*highlight)] == "The Gannet seats six people."


def test_an_answer_served_whole_from_the_prefix_cache_records_no_ratio(
    smollm2_tokenizer, redis_service
) -> None:
    """Every passage from the prefix cache: the plan's ratio (the deployment's) never ran."""
    whole = ScriptedPlan(words("Six [1]."), "stop", {"chunk_tiers": {"1": "prefix"}})
    metrics = answer_through_the_worker(smollm2_tokenizer, redis_service, whole).metrics
    assert metrics.prefix_cache is True and metrics.recompute_ratio is None
    loaded = ScriptedPlan(words("Six [1]."), "stop", {"chunk_tiers": {"1": "cpu"}})
    metrics = answer_through_the_worker(smollm2_tokenizer, redis_service, loaded).metrics
    assert metrics.prefix_cache is False and metrics.recompute_ratio == 0.15


class SlowFinishPlan(ScriptedPlan):
    """A plan whose bookkeeping after the last token takes a while (keeping the prompt's KV
    for a follow-up)."""

    def finish(self) -> dict:
        time.sleep(0.6)
        return super().finish()


def test_the_answers_total_time_ends_with_its_last_words_not_the_bookkeeping(
    smollm2_tokenizer, redis_service
) -> None:
    plan = SlowFinishPlan(words("The Gannet seats six [1]."), finish_reason="stop")
    result = answer_through_the_worker(smollm2_tokenizer, redis_service, plan)
    assert result.text == "The Gannet seats six [1]."
    assert result.metrics.total_s < 0.5  # the words were all out before the 0.6 s


def test_a_word_begins_where_the_answer_text_shows_more():
    """``starts_word`` (the batcher's word clock) says a token begins a word exactly when
    ``AnswerText`` has one more word to count."""
    pieces = [
        "The",
        " light",
        "house",
        " was",
        " lit",
        " in",
        " 1",
        "8",
        "7",
        "1",
        ".",
        "\n",
        "-",
        " Ana",
    ]
    text = ""
    for piece in pieces:
        before = len(_ANSWER_WORD.findall(text))
        assert starts_word(text, piece) == (len(_ANSWER_WORD.findall(text + piece)) > before), piece
        text += piece
    assert starts_word("", "The") and not starts_word("", " ")
    assert not starts_word("e", "ach") and starts_word(",", "and")
