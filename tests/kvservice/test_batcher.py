"""Stall-free steps: an open answer keeps streaming while other questions prefill, with the
same tokens as when prefills run whole; the upgrade of a progressive blend runs while its
answer streams, lands exactly, and gives way to waiting questions; a question whose reader
left never starts."""

from __future__ import annotations

import copy
import math
import threading
import time

import pytest
import torch

from kvservice.blend.prefill import refresh
from kvservice.model.sampling import SamplingParams
from kvservice.protocol.prompt import PromptFormat
from kvservice.serve import batcher as batcher_module
from kvservice.serve.batcher import (
    BACKLOG_PAUSE_TARGET_S,
    BACKLOG_QUESTIONS,
    BACKLOG_WORD_PAUSE_S,
    MAX_SLICE_S,
    MIN_SLICE_S,
    PAUSE_TARGET_S,
    UPGRADE_AFTER_TOKENS,
    UPGRADE_SKIPPED,
    WORD_PAUSE_S,
    WORD_TOKENS,
    ContinuousBatcher,
    Job,
    StepBudget,
)
from kvservice.serve.engine import Engine, Request

PASSAGES = [
    "The lighthouse on Karsk Point was lit for the first time in 1871 by keeper Ana Vik.",
    "Ferries leave the harbour at seven and at nine; the evening boat was stopped in 1990.",
    "The island school has nine pupils and one teacher, who also runs the post office.",
    "Winter storms closed the harbour for eleven days in 2014, the longest on record.",
]


@pytest.fixture(scope="module")
def engine(smollm2, smollm2_tokenizer):
    fmt = PromptFormat(smollm2_tokenizer, "You are a helpful assistant.", "Read the passages.\n")
    engine = Engine(smollm2, smollm2_tokenizer, fmt)
    yield engine
    engine.close()


class _Answer:
    """One job's tokens with the time each arrived, its prefill's times and its end."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.at: list[float] = []
        self.times = None
        self.reason: str | None = None
        self.done = threading.Event()
        self.prefilled = False

    def job(self, engine: Engine, request: Request, **extra) -> Job:
        def prefill(capacity):
            self.prefilled = True
            return engine.prefill_steps(request, capacity)

        return Job(
            prefill=prefill,
            sampling=request.sampling,
            stop_ids=set(),  # every answer runs to max_tokens: the decode rows stay open
            on_token=lambda _text, token: (
                self.tokens.append(token),
                self.at.append(time.perf_counter()),
            ),
            on_finish=lambda reason, _error: (setattr(self, "reason", reason), self.done.set()),
            on_prefill=lambda _result, times: setattr(self, "times", times),
            prompt_ids=request.prompt.token_ids,
            **extra,
        )


def _open_answer_then_a_prefill(engine: Engine, budget: StepBudget):
    """Answer A is decoding when question B (a full prefill of every passage) arrives."""
    short = engine.format.build(PASSAGES[:1], "When was the lighthouse first lit?")
    long = engine.format.build(PASSAGES * 3, "How many pupils does the island school have?")
    a_request = Request(
        short, [None] * len(short.chunk_ids), "full", sampling=SamplingParams(max_tokens=60)
    )
    b_request = Request(
        long, [None] * len(long.chunk_ids), "full", sampling=SamplingParams(max_tokens=4)
    )
    batcher = ContinuousBatcher(engine.model, engine.tokenizer, budget=budget).start()
    a, b = _Answer(), _Answer()
    try:
        a_job = a.job(engine, a_request)
        batcher.submit(a_job)
        deadline = time.monotonic() + 120
        while len(a.tokens) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        b_job = b.job(engine, b_request)
        batcher.submit(b_job)
        assert a.done.wait(300) and b.done.wait(300)
    finally:
        batcher.close()
    start = b_job.started + b.times.queued_s
    during = [t for t in a.at if start < t < start + b.times.wall_s]
    return a, b, during, batcher


def test_an_open_answer_keeps_streaming_while_another_question_prefills(engine):
    whole_a, whole_b, whole_during, _ = _open_answer_then_a_prefill(engine, StepBudget(math.inf))
    a, b, during, batcher = _open_answer_then_a_prefill(engine, StepBudget(0.005))
    assert whole_during == []  # prefills run whole: the open answer waits for all of B's
    # sliced: A's tokens keep coming while B prefills (30 layers, a layer or two a step)
    assert len(during) >= 5, (len(during), b.times)
    assert batcher.slices >= 5
    # the same tokens either way: slicing changes when work runs, not what it computes
    assert a.tokens == whole_a.tokens and len(a.tokens) == 60
    assert b.tokens == whole_b.tokens and len(b.tokens) == 4
    # B's prefill computed for less time than it took: the decode steps ran in between
    assert b.times.compute_s < b.times.wall_s
    gaps = [later - earlier for earlier, later in zip(a.at, a.at[1:], strict=False)]
    whole_gaps = [
        later - earlier for earlier, later in zip(whole_a.at, whole_a.at[1:], strict=False)
    ]
    assert max(gaps) < max(whole_gaps)


def test_a_progressive_upgrade_gives_way_to_waiting_questions(smollm2, smollm2_tokenizer):
    fmt = PromptFormat(smollm2_tokenizer, "You are a helpful assistant.", "Read the passages.\n")
    progressive = Engine(smollm2, smollm2_tokenizer, fmt)
    prompt = fmt.build(PASSAGES[:2], "When did the evening boat stop?")
    chunks = progressive.precompute(prompt.chunk_ids)
    reports: list[list] = [[], [], []]
    finished = [threading.Event() for _ in reports]
    try:
        for index, (report, done) in enumerate(zip(reports, finished, strict=True)):
            # all three at once; the last long enough for its upgrade's slices to land
            sampling = SamplingParams(max_tokens=UPGRADE_AFTER_TOKENS + 8 if index == 2 else 3)
            request = Request(prompt, chunks, "blend", 0.15, sampling, refresh_ratio=0.6)
            progressive.submit(
                request,
                on_token=lambda *_: None,
                on_finish=lambda reason, error, done=done: done.set(),
                on_refresh=lambda ratio, seconds, report=report: report.append((ratio, seconds)),
            )
        assert all(done.wait(300) for done in finished)
    finally:
        progressive.close()
    # the first two reach their first token while others wait: no upgrade; the last does
    assert reports[0] == [(0.6, UPGRADE_SKIPPED)] and reports[1] == [(0.6, UPGRADE_SKIPPED)]
    assert len(reports[2]) == 1 and reports[2][0][0] == 0.6 and reports[2][0][1] > 0
    assert progressive.batcher.upgrades_skipped == 2


def test_a_progressive_upgrade_lands_while_its_answer_streams(engine):
    """The answer streams from its first-pass cache while the upgrade runs (one layer a
    step here); when the upgrade lands, the tokens decoded meanwhile are computed again over
    it and every later token reads the upgraded cache: the same tokens as decoding by hand
    from the first-pass cache up to that point, then from the upgraded one."""
    request, answer, landed, batcher = _progressive_answer(engine, StepBudget(0.001))
    streamed = landed[0][1]  # tokens sampled before the upgrade landed
    assert 3 <= streamed < 48 and batcher.upgrade_lag_tokens == streamed - 1
    assert len(answer.tokens) == 48
    model = engine.model
    low = engine.prefill(request, extra_capacity=48)
    expected = [int(low.logits.argmax())]
    expected += _greedy(model, low.cache, low.num_tokens, expected, streamed - 1)
    upgraded = refresh(model, low, expected[:1], 0.6)  # the prefill's cache, upgraded
    n = upgraded.num_tokens
    expected += _greedy(model, upgraded.cache, n, expected[1:], 48 - streamed, fed=True)
    assert answer.tokens == expected


def test_a_progressive_upgrade_waits_for_its_answers_first_words(engine):
    """The upgrade starts once its answer has ``UPGRADE_AFTER_TOKENS`` tokens (the stream shows
    no words before that many are written), so the steps before the reader's first words
    run no upgrade slice; it lands after them."""
    _request, _answer, landed, _batcher = _progressive_answer(engine, StepBudget(10.0))
    # started beside the step after the first words, and ran whole in it (the budget)
    assert landed[0][1] == UPGRADE_AFTER_TOKENS + 1


def _progressive_answer(engine: Engine, budget: StepBudget):
    """A blend answer of 48 tokens upgraded to 0.6 while it streams, under ``budget``:
    its request, the answer, ``landed`` (the upgrade's outcome and the tokens sampled when
    it landed; asserted to be one landing) and the batcher, closed."""
    prompt = engine.format.build(PASSAGES[:3], "When was the evening boat stopped?")
    chunks = engine.precompute(prompt.chunk_ids)
    request = Request(prompt, chunks, "blend", 0.15, SamplingParams(max_tokens=48))
    answer, landed = _Answer(), []
    job = answer.job(
        engine,
        request,
        refresh=engine._refresher(0.6),
        on_refresh=lambda outcome: landed.append((outcome, len(answer.tokens))),
    )
    batcher = ContinuousBatcher(engine.model, engine.tokenizer, budget=budget)
    batcher.start()
    try:
        batcher.submit(job)
        assert answer.done.wait(300)
    finally:
        batcher.close()
    assert len(landed) == 1 and isinstance(landed[0][0], float), landed
    return request, answer, landed, batcher


def _greedy(model, cache, position, tokens, count, fed=False) -> list[int]:
    """``count`` greedy tokens after ``tokens`` over a copy of ``cache`` (whose first
    ``position`` slots are filled): with ``fed``, every one of ``tokens`` is fed first, else
    only the last (the others are in the cache)."""
    cache = copy.deepcopy(cache)
    feed = list(tokens) if fed else list(tokens[-1:])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(count):
            positions = torch.arange(position, position + len(feed))
            logits, _ = model(torch.tensor([feed]), positions[None], cache)
            position += len(feed)
            feed = [int(logits[0].argmax())]  # logits: [1, V], the last token's
            out.append(feed[0])
    return out


def test_a_waiting_question_whose_reader_left_never_starts(engine):
    prompt = engine.format.build(PASSAGES[:2], "When was the harbour closed?")
    request = Request(
        prompt, [None] * len(prompt.chunk_ids), "full", sampling=SamplingParams(max_tokens=8)
    )
    batcher = ContinuousBatcher(engine.model, engine.tokenizer).start()
    first, left = _Answer(), _Answer()
    try:
        batcher.submit(first.job(engine, request))
        batcher.submit(left.job(engine, request, should_stop=lambda: True))
        assert first.done.wait(120) and left.done.wait(120)
    finally:
        batcher.close()
    assert first.reason == "length" and len(first.tokens) == 8
    assert left.reason == "stopped" and not left.prefilled and left.tokens == []


def test_waiting_questions_are_told_their_place_until_they_start(engine):
    prompt = engine.format.build(PASSAGES, "When was the harbour closed?")
    request = Request(
        prompt, [None] * len(prompt.chunk_ids), "full", sampling=SamplingParams(max_tokens=4)
    )
    # a layer a step once an answer streams: the places are told between the steps
    batcher = ContinuousBatcher(engine.model, engine.tokenizer, budget=StepBudget(0.001))
    answers = [_Answer() for _ in range(3)]
    places: list[list] = [[], [], []]
    for answer, told in zip(answers, places, strict=True):  # all three in line at the start
        batcher.submit(answer.job(engine, request, on_queue=told.append))
    batcher.start()
    try:
        assert all(answer.done.wait(120) for answer in answers)
    finally:
        batcher.close()
    # the first started at once (its prefill whole: nothing streamed yet); then one a time
    assert places == [[], [0, None], [1, 0, None]]
    assert all(answer.reason == "length" and len(answer.tokens) == 4 for answer in answers)


def test_rows_come_and_go_in_the_batchs_slots_without_copying_the_batch(engine):
    """A row that leaves frees its slot for the next to join: one allocation for the three
    answers below (B leaves, C takes its slot), and each answer's tokens as when alone."""
    prompt = engine.format.build(PASSAGES[:2], "When was the harbour closed?")

    def request(tokens: int) -> Request:
        return Request(
            prompt,
            [None] * len(prompt.chunk_ids),
            "full",
            sampling=SamplingParams(max_tokens=tokens),
        )

    alone = []
    for tokens in (40, 6, 6):
        batcher = ContinuousBatcher(engine.model, engine.tokenizer).start()
        answer = _Answer()
        batcher.submit(answer.job(engine, request(tokens)))
        assert answer.done.wait(120)
        batcher.close()
        alone.append(answer.tokens)
    batcher = ContinuousBatcher(engine.model, engine.tokenizer, max_batch=2).start()
    made = []
    new_slots = batcher._new_slots
    batcher._new_slots = lambda *args: made.append(args) or new_slots(*args)
    a, b, c = _Answer(), _Answer(), _Answer()
    try:
        batcher.submit(a.job(engine, request(40)))
        batcher.submit(b.job(engine, request(6)))
        assert b.done.wait(120)
        batcher.submit(c.job(engine, request(6)))  # A still writing: C takes B's slot
        assert a.done.wait(120) and c.done.wait(120)
    finally:
        batcher.close()
    assert [a.tokens, b.tokens, c.tokens] == alone and len(a.tokens) == 40
    assert len(made) == 1 and made[0][0] == 1  # the first row's: room for two


def test_a_batch_whose_columns_run_out_moves_its_rows_to_the_front_not_to_new_slots(
    engine, monkeypatch
):
    """The batch's length grows a column a step while rows come and go (every row's next
    token goes in the same column); where a joining row no longer fits, the running rows
    move to the front of their slots (one compaction, no new slots) and every answer's
    tokens are those it has alone."""
    monkeypatch.setattr(batcher_module, "SLOT_HEADROOM", 0.0)  # slots exactly as needed
    long = engine.format.build(PASSAGES * 3, "How many pupils does the island school have?")
    short = engine.format.build(PASSAGES[:1], "When was the lighthouse first lit?")
    other = engine.format.build(PASSAGES[1:2], "When was the evening boat stopped?")

    def request(prompt, tokens: int) -> Request:
        return Request(
            prompt,
            [None] * len(prompt.chunk_ids),
            "full",
            sampling=SamplingParams(max_tokens=tokens),
        )

    requests = [request(long, 8), request(short, 40), request(other, 60)]
    alone = []
    for each in requests:
        batcher = ContinuousBatcher(engine.model, engine.tokenizer).start()
        answer = _Answer()
        batcher.submit(answer.job(engine, each))
        assert answer.done.wait(120)
        batcher.close()
        alone.append(answer.tokens)
    batcher = ContinuousBatcher(engine.model, engine.tokenizer, max_batch=2).start()
    a, b, c = _Answer(), _Answer(), _Answer()
    try:
        batcher.submit(a.job(engine, requests[0]))
        deadline = time.monotonic() + 120
        while len(a.tokens) < 2 and time.monotonic() < deadline:
            time.sleep(0.002)
        batcher.submit(b.job(engine, requests[1]))  # joins at A's length: a gap after its prompt
        assert a.done.wait(120)
        batcher.submit(c.job(engine, requests[2]))  # past the columns B's join left
        assert b.done.wait(120) and c.done.wait(120)
    finally:
        batcher.close()
    assert [a.tokens, b.tokens, c.tokens] == alone
    assert batcher.compactions == 1
    assert batcher.slot_allocations == 2  # A's, then B's longer need; none for C


class _GatedKV:
    """A chunk's KV that is not at hand until ``opened`` is set, as a store loader's layers
    before they arrive (``StoreLayeredKV.layer_ready``)."""

    def __init__(self, chunk, opened: threading.Event) -> None:
        self.chunk, self.opened, self.asked = chunk, opened, 0
        self.num_tokens, self.token_ids = chunk.num_tokens, chunk.token_ids

    def layer_ready(self, index: int) -> bool:
        self.asked += 1
        return self.opened.is_set()

    def layer(self, index: int):
        assert self.opened.is_set(), "read before it arrived"
        return self.chunk.layer(index)


def test_a_prefill_waiting_for_its_kv_lets_the_open_answers_stream(engine):
    """A prefill whose chunks' KV has not arrived pauses (it does not hold the batch while it
    waits): the open answer's tokens keep coming, and the prefill ends as it would have."""
    streaming = engine.format.build(PASSAGES[:1], "When was the lighthouse first lit?")
    waiting = engine.format.build(PASSAGES[1:3], "When did the evening boat stop?")
    chunks = engine.precompute(waiting.chunk_ids)

    def answer_of(gates: threading.Event, submit_first: Request | None) -> tuple:
        batcher = ContinuousBatcher(engine.model, engine.tokenizer).start()
        a, b = _Answer(), _Answer()
        gated = [_GatedKV(chunk, gates) for chunk in chunks]
        try:
            if submit_first is not None:
                batcher.submit(a.job(engine, submit_first))
                while len(a.tokens) < 2:
                    time.sleep(0.005)
            reuse = Request(waiting, gated, "reuse", sampling=SamplingParams(max_tokens=5))
            batcher.submit(b.job(engine, reuse))
            before = len(a.tokens)
            time.sleep(1.0)  # its KV is "on its way" for a second
            during = len(a.tokens) - before
            gates.set()
            assert b.done.wait(120) and (submit_first is None or a.done.wait(120))
        finally:
            batcher.close()
        return b.tokens, during, sum(g.asked for g in gated)

    opened = threading.Event()
    opened.set()
    alone, _, _ = answer_of(opened, None)
    long = Request(
        streaming,
        [None] * len(streaming.chunk_ids),
        "full",
        sampling=SamplingParams(max_tokens=200),
    )
    tokens, during, asked = answer_of(threading.Event(), long)
    assert tokens == alone and len(tokens) == 5
    assert during >= 3, during  # held by a blocking wait, the open answer would get none
    assert asked > len(chunks)  # it asked again while the KV was "loading"


def test_the_step_budget_setting():
    assert StepBudget.from_env({}) == StepBudget()
    assert StepBudget.from_env({"ENGINE_STEP_BUDGET": " Auto "}).seconds is None
    assert StepBudget.from_env({"ENGINE_STEP_BUDGET": "off"}).seconds == math.inf
    assert StepBudget.from_env({"ENGINE_STEP_BUDGET": "0.2"}).seconds == 0.2
    assert StepBudget.from_env({"ENGINE_STEP_BUDGET": "0.2s"}).seconds == 0.2
    for bad in ("fast", "0", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match="ENGINE_STEP_BUDGET"):
            StepBudget.from_env({"ENGINE_STEP_BUDGET": bad})
    auto = StepBudget()  # what the measured decode step leaves of the pause target
    assert auto.slice_s(0.03) == pytest.approx(PAUSE_TARGET_S - 0.03)
    assert auto.slice_s(0.03, waiting=BACKLOG_QUESTIONS) == pytest.approx(
        BACKLOG_PAUSE_TARGET_S - 0.03
    )
    assert BACKLOG_PAUSE_TARGET_S > PAUSE_TARGET_S
    assert auto.slice_s(10.0) == MIN_SLICE_S
    assert StepBudget(0.2).slice_s(10.0) == 0.2
    assert [str(b) for b in (auto, StepBudget(math.inf), StepBudget(0.2))] == [
        "auto",
        "off",
        "0.2 s",
    ]


def test_the_words_under_way_bound_the_step():
    """Every open answer's next word must come within the word pause, counting a decode step
    for each token its word may still need: a step shortens (to no prefill work) while an
    answer is deep in a word, and under a backlog runs longer while all have just begun one;
    without a backlog it is never longer than the fixed target."""
    auto, decode = StepBudget(), 0.05
    fixed = PAUSE_TARGET_S - decode
    waiting = BACKLOG_QUESTIONS
    # every answer has just begun a word: under a backlog, the room the longest word leaves
    room = BACKLOG_WORD_PAUSE_S - WORD_TOKENS * decode
    assert auto.slice_s(decode, waiting, [(0.0, 1), (0.01, 1)]) == pytest.approx(
        min(room, MAX_SLICE_S)
    )
    assert auto.slice_s(decode, waiting, [(0.0, 1)]) > BACKLOG_PAUSE_TARGET_S - decode
    # one answer three tokens and 0.75 s into its word: no prefill work this step
    assert auto.slice_s(decode, waiting, [(0.0, 1), (0.75, 3)]) == 0.0
    # a word longer than assumed bounds nothing (it would hold every question back)
    assert auto.slice_s(decode, waiting, [(2.0, WORD_TOKENS + 1)]) == pytest.approx(
        BACKLOG_PAUSE_TARGET_S - decode
    )
    # no backlog: the fixed target, shortened when a word runs long
    assert auto.slice_s(decode, 0, [(0.0, 1)]) == pytest.approx(fixed)
    deep = WORD_PAUSE_S - 0.2 - (WORD_TOKENS - 1) * decode
    assert 0 < deep < fixed
    assert auto.slice_s(decode, 0, [(0.0, 1), (0.2, 2)]) == pytest.approx(deep)
    assert auto.slice_s(decode, 0, [(WORD_PAUSE_S, 2)]) == 0.0
    assert StepBudget(0.2).slice_s(decode, waiting, [(0.6, 3)]) == 0.2  # a fixed budget
