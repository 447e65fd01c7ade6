from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from kvservice.blend.prefill import refresh_steps
from kvservice.model.sampling import SamplingParams, sample_next
from kvservice.protocol.prompt import PromptFormat
from kvservice.serve.batcher import StepBudget
from kvservice.serve.engine import Engine, Request, refresh_ratio_from_env

PASSAGES = [
    "Paris is the capital and largest city of France.",
    "The Eiffel Tower was completed in 1889 for the World's Fair.",
]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def engine(smollm2, smollm2_tokenizer):
    fmt = PromptFormat(smollm2_tokenizer, "You are a helpful assistant.", "Read the passages.\n")
    engine = Engine(smollm2, smollm2_tokenizer, fmt)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def request_parts(engine):
    prompt = engine.format.build(PASSAGES, QUESTION)
    return prompt, engine.precompute(prompt.chunk_ids)


def test_prompt_parts_follow_the_chat_template(engine, smollm2_tokenizer):
    prompt = engine.format.build(PASSAGES, QUESTION)
    text = smollm2_tokenizer.decode(prompt.token_ids)
    assert text.startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    )
    assert text.endswith(f"Question: {QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    # Each chunk is tokenized on its own, identically every time.
    assert prompt.chunk_ids[0] == engine.format.chunk_ids(PASSAGES[0])
    assert prompt.head_ids == engine.format.head_ids


def test_greedy_full_matches_transformers_generate(engine, request_parts, smollm2_dir):
    from transformers import AutoModelForCausalLM

    prompt, _ = request_parts
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt.token_ids])
    with torch.no_grad():
        hf_out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
    hf_tokens = [t for t in hf_out[0, ids.shape[1] :].tolist() if t not in engine.stop_ids]
    ours = engine.generate(
        Request(prompt, [None] * len(prompt.chunk_ids), "full", sampling=SamplingParams(12))
    )
    assert ours.token_ids == hf_tokens[: len(ours.token_ids)] and len(ours.token_ids) > 0
    assert "Paris" in ours.text


def test_stream_gives_deltas_ttft_on_first_and_a_finish_reason(engine, request_parts):
    prompt, chunks = request_parts
    events = list(
        engine.stream(Request(prompt, chunks, "blend", 0.15, SamplingParams(max_tokens=6)))
    )
    assert events[0].ttft_s is not None and events[0].ttft_s > 0
    assert all(e.ttft_s is None for e in events[1:])
    assert events[-1].finish_reason in ("stop", "length") and events[-1].token_id == -1
    assert all(e.finish_reason is None and e.token_id >= 0 for e in events[:-1])
    assert [e.index for e in events] == list(range(len(events)))
    assert len(events) <= 7 and "".join(e.text for e in events).strip()


def test_max_tokens_and_stop_tokens(engine, request_parts):
    prompt, chunks = request_parts
    long = engine.generate(Request(prompt, chunks, "reuse", sampling=SamplingParams(max_tokens=3)))
    assert len(long.token_ids) == 3 and long.finish_reason == "length"
    first = long.token_ids[0]
    stopped = engine.generate(
        Request(
            prompt, chunks, "reuse", sampling=SamplingParams(max_tokens=3, stop_token_ids=(first,))
        )
    )
    assert stopped.token_ids == [] and stopped.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_top_p_tiny_is_greedy(engine, request_parts):
    prompt, chunks = request_parts
    params = SamplingParams(max_tokens=8, temperature=1.5, top_p=0.95, seed=123)
    a = engine.generate(Request(prompt, chunks, "blend", sampling=params))
    b = engine.generate(Request(prompt, chunks, "blend", sampling=params))
    assert a.token_ids == b.token_ids
    greedy = engine.generate(
        Request(prompt, chunks, "blend", sampling=SamplingParams(max_tokens=8))
    )
    nucleus = engine.generate(
        Request(
            prompt,
            chunks,
            "blend",
            sampling=SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=1),
        )
    )
    assert nucleus.token_ids == greedy.token_ids


def test_sample_next_respects_top_p():
    logits = torch.tensor([[5.0, 4.0, -10.0, -10.0]])
    gen = torch.Generator().manual_seed(0)
    draws = {
        int(sample_next(logits, SamplingParams(temperature=1.0, top_p=0.9), gen))
        for _ in range(200)
    }
    assert draws == {0, 1}


def test_batched_decode_equals_one_by_one(engine, request_parts):
    prompt, chunks = request_parts
    other = engine.format.build(PASSAGES[::-1], "When was the Eiffel Tower completed?")
    other_chunks = [chunks[1], chunks[0]]  # the same cached chunks, reordered
    requests = [
        Request(prompt, chunks, "blend", 0.15, SamplingParams(max_tokens=10)),
        Request(other, other_chunks, "full", sampling=SamplingParams(max_tokens=6)),
        Request(prompt, chunks, "reuse", sampling=SamplingParams(max_tokens=4)),
    ]
    single = [engine.generate(r) for r in requests]
    with ThreadPoolExecutor(len(requests)) as pool:  # together: they share decode steps
        batched = list(pool.map(engine.generate, requests))
    assert engine.batcher.max_rows_seen >= 2
    assert [c.token_ids for c in batched] == [c.token_ids for c in single]
    assert all(c.token_ids for c in batched) and len(batched[2].token_ids) <= 4


def test_calibration_at_load_measures_what_the_loading_controller_weighs(engine):
    from kvservice.blend.controller import ChunkLoad, LoadingController
    from kvservice.serve.runtime import calibrate

    controller = LoadingController()
    calibrate(engine, controller, chunks=2, chunk_tokens=64)
    snapshot = controller.snapshot()
    assert snapshot["recompute_token_layers_per_s"] > 0 and snapshot["read_token_layer_s"] >= 0
    # measured, the per-chunk choice weighs loads: over a link that takes an hour for a
    # chunk, every chunk is recomputed (unmeasured, every chunk would be read)
    chunks = [ChunkLoad(tokens=64, nbytes=1 << 20, tier="s3")] * 3
    controller.observe_tier_bandwidths({"s3": (1 << 20) / 3600})
    plan = controller.choose_loads(
        chunks=chunks, question_tokens=16, num_layers=30, recompute_ratio=0.15
    )
    assert plan.recomputed == 3 and plan.total_s_estimate < 3600


def test_progressive_blend_upgrades_a_blend_with_its_first_token(
    engine, smollm2, smollm2_tokenizer, request_parts, monkeypatch
):
    """With a refresh ratio, a blend's cache is upgraded once, with its first token, at that
    ratio, and the answer is as long as asked (how the upgrade lands in the running answer:
    tests/kvservice/test_batcher.py); reuse and full are not upgraded."""
    prompt, chunks = request_parts
    fmt = PromptFormat(smollm2_tokenizer, "You are a helpful assistant.", "Read the passages.\n")
    progressive = Engine(smollm2, smollm2_tokenizer, fmt)
    progressive.stop_ids = set()  # every answer runs to max_tokens
    calls = []

    def spy(model, result, answer, ratio):
        calls.append((list(answer), ratio))
        return refresh_steps(model, result, answer, ratio)

    monkeypatch.setattr("kvservice.serve.engine.refresh_steps", spy)
    try:
        sampling = SamplingParams(max_tokens=40)
        request = Request(prompt, chunks, "blend", 0.15, sampling, refresh_ratio=0.6)
        got = progressive.generate(request).token_ids
        assert calls == [([got[0]], 0.6)] and len(got) == 40
        low = progressive.prefill(request)
        assert got[0] == int(low.logits.argmax())  # the first token: the first pass's
        # reuse and full are not refreshed: the same tokens as an engine without it
        for mode in ("reuse", "full"):
            plain = Request(prompt, chunks, mode, sampling=SamplingParams(max_tokens=4))
            asked = replace(plain, refresh_ratio=0.6)
            assert progressive.generate(asked).token_ids == engine.generate(plain).token_ids
        assert len(calls) == 1  # neither was refreshed
    finally:
        progressive.close()


def test_a_token_reaches_the_reader_before_the_next_is_computed(
    smollm2, smollm2_tokenizer, request_parts, monkeypatch
):
    """The stream hands each token over as it is sampled: a progressive blend's first token
    is read before its upgrade runs (held back, it would wait for the upgrade), the request's
    ratio is the one it upgrades to, and the upgrade is reported with its ratio."""
    prompt, chunks = request_parts
    fmt = PromptFormat(smollm2_tokenizer, "You are a helpful assistant.", "Read the passages.\n")
    # the upgrade as soon as the row holds the first token, whole in one step (the product
    # waits for the first words: test_batcher)
    monkeypatch.setattr("kvservice.serve.batcher.UPGRADE_AFTER_TOKENS", 1)
    progressive = Engine(smollm2, smollm2_tokenizer, fmt, step_budget=StepBudget(10.0))
    read_first = threading.Event()
    seen = []

    def waiting(model, result, answer, ratio):
        seen.append((read_first.wait(timeout=60), ratio))
        return refresh_steps(model, result, answer, ratio)

    monkeypatch.setattr("kvservice.serve.engine.refresh_steps", waiting)
    refreshed = []
    try:
        request = Request(
            prompt, chunks, "blend", 0.15, SamplingParams(max_tokens=3), refresh_ratio=0.5
        )
        for event in progressive.stream(request, on_refresh=lambda *a: refreshed.append(a)):
            if event.index == 0:
                assert event.token_id >= 0 and not seen  # before the upgrade began
                read_first.set()
        assert [ratio for _, ratio in seen] == [0.5] and seen[0][0]
        assert len(refreshed) == 1 and refreshed[0][0] == 0.5 and refreshed[0][1] > 0
        off = Request(
            prompt, chunks, "blend", 0.15, SamplingParams(max_tokens=3), refresh_ratio=0.0
        )
        assert progressive.refresh_ratio_for(off) is None
        assert progressive.refresh_ratio_for(replace(off, refresh_ratio=None)) is None
        assert progressive.refresh_ratio_for(replace(off, refresh_ratio=0.9)) == 0.9
        assert progressive.refresh_ratio_for(replace(off, recompute_ratio=0.9)) is None
        assert progressive.refresh_ratio_for(replace(off, mode="reuse", refresh_ratio=0.5)) is None
    finally:
        progressive.close()


def test_the_refresh_ratio_setting_is_checked_when_read():
    # on by default (0.25); off by name or 0
    assert refresh_ratio_from_env({}) == 0.25
    assert refresh_ratio_from_env({"BLEND_REFRESH_RATIO": " "}) == 0.25
    assert refresh_ratio_from_env({"BLEND_REFRESH_RATIO": "0.4"}) == 0.4
    assert refresh_ratio_from_env({"BLEND_REFRESH_RATIO": "off"}) is None
    assert refresh_ratio_from_env({"BLEND_REFRESH_RATIO": "0"}) is None
    for bad in ("abc", "-0.1", "1.5"):
        with pytest.raises(ValueError, match="BLEND_REFRESH_RATIO"):
            refresh_ratio_from_env({"BLEND_REFRESH_RATIO": bad})
