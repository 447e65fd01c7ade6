"""Decoding a user can read: vLLM's penalties in the native engine (checked against
transformers' own repetition penalty, which has the same definition), stop strings over
streamed text, and both in the continuous batcher the worker uses."""

from __future__ import annotations

import threading

import pytest
import torch

from kvservice.model.sampling import (
    SamplingParams,
    StopStrings,
    TokenHistory,
    apply_penalties,
    sample_next,
)
from kvservice.protocol.prompt import TURN_MARKERS, PromptFormat
from kvservice.serve.batcher import ContinuousBatcher, Job
from kvservice.serve.engine import Engine, Request

PASSAGES = ["Laptops are replaced every four years.", "The VPN is called Skerry."]
QUESTION = "How often are laptops replaced?"


def test_apply_penalties_follows_vllms_definition() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, 1.0]])
    prompt_mask = torch.tensor([[True, True, False, False]])
    output_counts = torch.tensor([[0.0, 0.0, 2.0, 0.0]])
    out = apply_penalties(
        logits,
        prompt_mask,
        output_counts,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    # seen positive: divided; seen negative: multiplied; generated twice: also -2*0.5 - 0.25
    assert out.tolist() == [[1.0, -4.0, 3.0 / 2 - 1.0 - 0.25, 1.0]]


def test_a_frequency_penalty_turns_greedy_away_from_a_repeated_token() -> None:
    logits = torch.tensor([[5.0, 4.8, 0.0]])
    params = SamplingParams(frequency_penalty=0.5)
    history = TokenHistory(prompt_ids=[])
    assert int(sample_next(logits, params, None, history)[0]) == 0
    history.observe(0)
    assert int(sample_next(logits, params, None, history)[0]) == 1  # 5.0 - 0.5 < 4.8
    assert int(sample_next(logits, SamplingParams(), None, history)[0]) == 0  # off: unchanged


def test_stop_strings_hold_back_a_possible_start_and_cut_before_the_marker() -> None:
    stops = StopStrings(TURN_MARKERS)
    shown = [stops.push(piece) for piece in ["The VPN is Skerry", ".\n\nQue", "stion: what"]]
    assert shown == ["The VPN is Skerry", ".\n\n", ""] and stops.stopped
    assert stops.push("more") == ""  # nothing after the stop
    held = StopStrings(["User:"])
    assert held.push("Ask the Us") == "Ask the " and held.flush() == "Us"  # not a stop after all
    assert StopStrings([]).push("User: hi") == "User: hi"


@pytest.fixture(scope="module")
def engine(smollm2, smollm2_tokenizer):
    engine = Engine(smollm2, smollm2_tokenizer, PromptFormat.for_tokenizer(smollm2_tokenizer))
    yield engine
    engine.close()


def _prompt(engine):
    from kvservice.protocol.prompt import Prompt

    fmt = engine.format
    segments = fmt.numbered([fmt.chunk_ids(text) for text in PASSAGES])
    return Prompt(list(fmt.head_ids), segments, fmt.question_ids(QUESTION))


def test_numbered_passages_read_as_one_text(engine, smollm2_tokenizer) -> None:
    prompt = _prompt(engine)
    text = smollm2_tokenizer.decode(prompt.token_ids)
    assert f"Sources:\n\n[1]\n{PASSAGES[0]}\n\n[2]\n{PASSAGES[1]}\n\nQuestion: " in text
    # Each marker tokenizes as it does inside the whole text: the chunks' cached KV fits.
    whole = smollm2_tokenizer(
        f"[1]\n{PASSAGES[0]}\n\n[2]\n{PASSAGES[1]}", add_special_tokens=False
    )["input_ids"]
    assert [i for segment in prompt.chunk_ids for i in segment] == whole


def test_repetition_penalty_decodes_as_transformers_does(engine, smollm2_dir) -> None:
    from transformers import AutoModelForCausalLM

    prompt = _prompt(engine)
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt.token_ids])
    with torch.no_grad():
        hf_out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.3,
        )
    hf_tokens = [t for t in hf_out[0, ids.shape[1] :].tolist() if t not in engine.stop_ids]
    sampling = SamplingParams(16, repetition_penalty=1.3)
    ours = engine.generate(Request(prompt, [None] * len(prompt.chunk_ids), "full", 1.0, sampling))
    plain = engine.generate(Request(prompt, [None] * len(prompt.chunk_ids), "full", 1.0))
    assert ours.token_ids == hf_tokens[: len(ours.token_ids)] and ours.token_ids
    assert ours.token_ids != plain.token_ids[: len(ours.token_ids)]  # the penalty did act


def test_the_batcher_ends_an_answer_at_a_stop_string(engine, smollm2_tokenizer) -> None:
    prompt = _prompt(engine)
    plain = engine.generate(
        Request(prompt, [None] * len(prompt.chunk_ids), "full", 1.0, SamplingParams(12))
    )
    words = plain.text.split()
    assert len(words) >= 3, plain.text
    stop = words[2]  # the third word of the free answer becomes a stop string
    batcher = ContinuousBatcher(engine.model, smollm2_tokenizer).start()
    pieces: list[str] = []
    finished: dict = {}
    done = threading.Event()
    try:
        batcher.submit(
            Job(
                prefill=lambda extra: engine.prefill_steps(
                    Request(prompt, [None] * len(prompt.chunk_ids), "full", 1.0), extra
                ),
                sampling=SamplingParams(12, stop=(stop,)),
                stop_ids=set(engine.stop_ids),
                on_token=lambda text, _id: pieces.append(text),
                on_finish=lambda reason, error: (finished.update(reason=reason), done.set()),
                prompt_ids=prompt.token_ids,
            )
        )
        assert done.wait(120)
    finally:
        batcher.close()
    assert finished["reason"] == "stop"
    assert "".join(pieces) == plain.text[: plain.text.index(stop)]
