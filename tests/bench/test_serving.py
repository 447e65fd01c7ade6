"""The serving bench's arithmetic (schedules, percentiles, pauses, capacity, where the time
went), its stream reader and plot; and, slow, a tiny run against the suite's own live server
and workers, checking the JSON it writes."""

from __future__ import annotations

import asyncio
import json
import statistics
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from bench.serving import (
    Answer,
    capacity,
    gaps,
    loads,
    meets_target,
    percentiles,
    plot_svg,
    poisson_schedule,
    product_messages,
    rotated,
    sse_events,
    summarize,
    timings_of,
)

MUSIQUE_PASSAGES = Path(__file__).resolve().parents[1] / "data" / "musique_passages.json"


def test_poisson_schedule_is_seeded_starts_at_zero_and_has_the_rate_on_average() -> None:
    first = poisson_schedule(6, duration_s=60, seed=3)
    assert first == poisson_schedule(6, duration_s=60, seed=3)
    assert first != poisson_schedule(6, duration_s=60, seed=4)
    assert first[0] == 0.0 and first == sorted(first) and first[-1] < 60
    # 30 per minute over 100 minutes: about 3,000 arrivals, gaps of mean 2 s
    many = poisson_schedule(30, duration_s=6000, seed=0)
    assert 2850 < len(many) < 3150
    assert statistics.fmean(gaps(many)) == pytest.approx(2.0, rel=0.05)
    # exponential gaps: as many gaps above the mean's ln 2 as below (the median of Exp)
    above = sum(g > 2.0 * 0.6931 for g in gaps(many)) / (len(many) - 1)
    assert above == pytest.approx(0.5, abs=0.04)


def test_poisson_schedule_by_count_and_refusals() -> None:
    assert len(poisson_schedule(2, count=5, seed=0)) == 5
    assert len(poisson_schedule(2, count=5, duration_s=0.001, seed=0)) == 1  # the first, at 0
    with pytest.raises(ValueError):
        poisson_schedule(0, duration_s=60)
    with pytest.raises(ValueError):
        poisson_schedule(2)


def test_loads_give_every_rate_its_own_seed_in_order_then_the_burst() -> None:
    sweep = loads([8, 2], duration_s=60, questions=None, burst=4, seed=0)
    assert [load.label for load in sweep] == ["2/min", "8/min", "burst 4"]
    assert sweep[0].schedule == tuple(poisson_schedule(2, duration_s=60, seed=0))
    assert sweep[1].schedule == tuple(poisson_schedule(8, duration_s=60, seed=1))
    assert sweep[2].schedule == (0.0,) * 4
    assert [
        len(load.schedule) for load in loads([3], duration_s=1, questions=7, burst=None, seed=0)
    ] == [7]
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_percentiles_are_linear_between_order_statistics() -> None:
    values = [float(v) for v in range(1, 101)]  # 1 .. 100
    out = percentiles(values)
    assert out == {
        "p50": pytest.approx(50.5),
        "p95": pytest.approx(95.05),
        "p99": pytest.approx(99.01),
    }
    assert percentiles([], (0.5,)) == {"p50": None}


def _answer(ttft: float, tokens: list[float], *, ok: bool = True, **metrics) -> Answer:
    answer = Answer("blend", 0, "q", 0.0, ok=ok, metrics=metrics)
    for at in [ttft, *tokens]:
        answer.token(at)
    if not ok:
        answer.error = "generation_failed: boom"
    return answer


def test_summary_pools_pauses_over_answers_and_counts_failures() -> None:
    answers = [
        _answer(1.0, [1.1, 1.2, 1.9]),  # gaps 0.1 0.1 0.7
        _answer(3.0, [3.05]),  # gap 0.05
        _answer(2.0, [], ok=False),
        Answer("blend", 3, "q", 0.0, error="HTTP 503: busy"),  # refused: no token at all
        _answer(0.01, [], not_found=True),  # retrieval found nothing: no model ran
    ]
    run = summarize(answers, rate_per_min=4, burst=None, elapsed_s=30.0)
    assert (run["sent"], run["completed"], run["failed"]) == (5, 3, 2)
    assert run["answers_per_min"] == pytest.approx(6.0) and run["not_found"] == 1
    assert run["errors"] == {"generation_failed: boom": 1, "HTTP 503: busy": 1}
    # 1, 2, 3: every answer that streamed from a model
    assert run["ttft_s"]["p50"] == pytest.approx(2.0)
    assert run["max_pause_s"] == pytest.approx(0.7)
    assert run["tbt_s"]["p50"] == pytest.approx(0.1)
    assert run["tokens"] == 4 + 2 + 1 + 1


def test_timings_say_where_the_time_went_and_take_the_workers_report_first() -> None:
    answer = _answer(1.3, [1.4], ttft_seen_s=1.2, ttft_s=0.9, total_s=4.9, prefill_s=0.5)
    assert timings_of(answer) == pytest.approx(
        {
            "web_s": 0.1,
            "before_worker_s": 0.3,
            "worker_ttft_s": 0.9,
            "decode_s": 4.0,
            "prefill_s": 0.5,
        }
    )
    answer.worker = {
        "prefill_s": 0.6,
        "load_s": 0.05,
        "queue_s": 0.2,
        "chunk_tiers": {"1": "cpu", "2": "s3"},
        "cached": True,
    }
    went = timings_of(answer)
    assert went["prefill_s"] == 0.6 and went["queue_s"] == 0.2
    assert "cached" not in went and "chunk_tiers" not in went
    run = summarize([answer], rate_per_min=2, burst=None, elapsed_s=60)
    assert run["tiers"] == {"cpu": 1, "s3": 1}
    assert run["load_s_by_tiers"] == {"cpu+s3": 0.05}
    assert timings_of(Answer("vllm", 0, "q", 0.0)) == {}  # vLLM's stream carries none


def test_the_workers_report_is_its_done_events_metrics_and_nothing_after_it(
    redis_service,
) -> None:
    """The answer is recorded before its stream's ``done`` (the record task appends it), so
    no time from that event to the record is reported: it would be at most 0."""
    import uuid
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from bench.serving import WorkerReports
    from kvservice.protocol import AnswerMetrics, AnswerOutcome, Done, publish_event
    from webapp.redis import redis_client

    request_id = str(uuid.uuid4())
    outcome = AnswerOutcome("done", text="Six", metrics=AnswerMetrics(ttft_s=0.4, total_s=1.5))
    publish_event(redis_client(), request_id, Done(outcome))
    recorded = SimpleNamespace(request_id=request_id, completed_at=datetime.now(UTC))
    report = WorkerReports._report(recorded)
    assert (report["ttft_s"], report["total_s"]) == (0.4, 1.5)
    assert "record_s" not in report


def _run(rate, p95, *, pause=0.1, failed=0, completed=5) -> dict:
    return {
        "rate_per_min": rate,
        "burst": None,
        "ttft_s": {"p95": p95},
        "max_pause_s": pause,
        "failed": failed,
        "completed": completed,
    }


def test_capacity_is_the_highest_rate_before_the_first_miss() -> None:
    target = 4.0  # 4x an unloaded TTFT of 1 s
    runs = [_run(8, 3.9), _run(2, 1.0), _run(4, 2.0), _run(16, 9.0)]
    assert capacity(runs, target) == 8
    assert capacity([_run(2, 1.0), _run(4, 4.1), _run(8, 3.0)], target) == 2  # 8 passed by luck
    assert capacity([_run(2, 1.0), _run(4, 2.0, pause=0.6)], target) == 2  # a stall misses
    assert capacity([_run(2, 1.0), _run(4, 2.0, failed=1)], target) == 2  # a failure misses
    assert capacity([_run(2, 5.0)], target) is None
    burst = {**_run(None, 1.0), "burst": 16}
    assert capacity([burst], target) is None  # a burst is no rate
    assert not meets_target(_run(2, None, completed=0), target)
    assert meets_target(_run(2, 4.0, pause=None), target)  # one-token answers: no pause


def test_sse_reader_reads_named_and_unnamed_events_and_multiline_data() -> None:
    async def lines():
        for line in [
            "event: start",
            'data: {"message_id": 7}',
            "",
            ": comment",
            "",
            "data: [DONE]",
            "",
            "event: token",
            "data: a",
            "data: b",
            "",
        ]:
            yield line

    async def read():
        return [event async for event in sse_events(lines())]

    assert asyncio.run(read()) == [
        ("start", '{"message_id": 7}'),
        ("message", "[DONE]"),
        ("token", "a\nb"),
    ]


def test_vllm_gets_the_products_prompt_numbered_as_the_worker_numbers_it() -> None:
    from kvservice.protocol.prompt import SYSTEM_PROMPT

    system, user = product_messages(["Alpha text.", "Beta text."], "Who?")
    assert system == {"role": "system", "content": SYSTEM_PROMPT}
    assert user["content"] == "Sources:\n\n[1]\nAlpha text.\n\n[2]\nBeta text.\n\nQuestion: Who?"


def test_plot_is_svg_with_a_line_per_mode_and_the_target() -> None:
    modes = {
        "blend": [_run(2, 1.0), _run(4, 1.5), {**_run(None, 9.0), "burst": 8}],
        "full": [_run(2, 2.0), _run(4, 6.0)],
    }
    svg = plot_svg(modes, target_ttft_s=4.0)
    root = ElementTree.fromstring(svg)
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    # the axes, blend, full, the dashed target
    assert len(lines) == 4 and lines[-1].get("stroke-dasharray")
    assert len(root.findall("{http://www.w3.org/2000/svg}circle")) == 4  # the burst is no point
    assert "blend" in svg and "full" in svg
    ElementTree.fromstring(plot_svg({}, None))  # nothing measured: still a drawing


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.django_db(transaction=True)
def test_a_tiny_run_against_the_suites_stack_writes_every_figure(
    live_server, celery_worker_process, inference_worker_process, django_user_model, tmp_path
) -> None:
    from bench.serving import main
    from webapp.accounts.services import api_key_create

    user = django_user_model.objects.create_user(username="bench", password="x", is_staff=True)
    _, key = api_key_create(user=user, name="serving bench")
    out = tmp_path / "serving.json"
    data = tmp_path / "musique.json"  # two examples as musique_dev.json holds them
    passages = json.loads(MUSIQUE_PASSAGES.read_text())["passages"]
    data.write_text(
        json.dumps(
            [
                {
                    "question": "Who developed the thriller television series for NBC?",
                    "answers": ["bryan fuller"],
                    "ctxs": [{"title": "Hannibal", "text": passages[0]}],
                },
                {
                    "question": "When was the play Hannibal and Scipio first performed?",
                    "answers": ["1635"],
                    "ctxs": [{"title": "Hannibal and Scipio", "text": passages[1]}],
                },
            ]
        )
    )
    code = main(
        [
            "--data",
            str(data),
            "--first",
            "0",
            "--url",
            live_server.url,
            "--api-key",
            key,
            "--data-dir",
            str(tmp_path),
            "--examples",
            "2",
            "--passages",
            "1",
            "--rates",
            "30",
            "--questions",
            "2",
            "--unloaded",
            "1",
            "--modes",
            "blend",
            "--settle",
            "0",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["corpus"]["documents"] == 2
    assert report["unloaded_blend"]["ttft_median_s"] > 0
    (run,) = report["modes"]["blend"]["runs"]
    assert (run["rate_per_min"], run["sent"], run["completed"]) == (30, 2, 2)
    assert run["ttft_s"]["p95"] >= run["ttft_s"]["p50"] > 0 and run["answers_per_min"] > 0
    assert {"worker_ttft_s", "before_worker_s", "decode_s", "prefill_s"} <= set(
        run["timings_p50_s"]
    )  # the worker's own report was read too (prefill_s is not in the API's)
    assert all(a["message_id"] and a["token_times_s"] for a in run["answers"])
    assert "capacity_per_min" in report["modes"]["blend"]
    assert out.with_suffix(".svg").read_text().startswith("<svg")


def test_vllm_runs_no_model_where_retrieval_found_nothing_as_the_product() -> None:
    from bench.serving import VllmApi

    async def ask() -> tuple[Answer, Answer]:
        # nothing listens on port 9: a request would fail the answer
        client = VllmApi(
            "http://127.0.0.1:9",
            model="m",
            max_tokens=4,
            timeout_s=2,
            passages={"q": [], "r": ["a passage"]},
        )
        empty, other = Answer("vllm", 0, "q", 0.0), Answer("vllm", 1, "r", 0.0)
        await client.ask(empty)
        await client.ask(other)
        await client.client.aclose()
        return empty, other

    empty, other = asyncio.run(ask())
    assert empty.ok and empty.metrics == {"not_found": True} and not empty.token_times_s
    assert not other.ok and "ConnectError" in other.error


def test_vllm_stream_is_read_and_a_repeated_question_gets_a_salt_of_its_own() -> None:
    """vLLM's wire format (a stand-in transport: the server takes a minute to start)."""
    import httpx

    from bench.serving import VllmApi

    sent: list[dict] = []
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},  # no token yet
        {"choices": [{"delta": {"content": "Juba"}}]},
        {"choices": [{"delta": {"content": " [1]"}, "finish_reason": "stop"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 900,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 80},
            },
        },
    ]
    stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    def reply(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, text=stream, headers={"content-type": "text/event-stream"})

    async def ask_twice() -> list[Answer]:
        client = VllmApi(
            "http://vllm",
            model="m",
            max_tokens=8,
            timeout_s=5,
            passages={"Where?": ["Juba is in Sudan."]},
        )
        client.client = httpx.AsyncClient(
            base_url="http://vllm", transport=httpx.MockTransport(reply)
        )
        answers = [Answer("vllm", i, "Where?", 0.0) for i in range(2)]
        for answer in answers:
            await client.ask(answer)
        await client.client.aclose()
        return answers

    first, again = asyncio.run(ask_twice())
    assert first.ok and len(first.token_times_s) == 2 and first.ttft_s is not None
    assert first.metrics == {
        "prompt_tokens": 900,
        "completion_tokens": 2,
        "cached_prompt_tokens": 80,
    }
    assert "cache_salt" not in sent[0] and sent[1]["cache_salt"]
    assert sent[0]["messages"] == product_messages(["Juba is in Sudan."], "Where?")
    assert len(sent[0]["stop"]) == 4 and sent[0]["stream_options"] == {"include_usage": True}
    run = summarize([first, again], rate_per_min=2, burst=None, elapsed_s=60)
    assert run["cached_prompt_share"] == round(160 / 1800, 3)


def test_the_query_apis_events_fill_the_answer_and_a_refusal_is_a_failure() -> None:
    """The API's event stream as the web app writes it (``webapp.answer_stream.sse``)."""
    import httpx

    from bench.serving import RagblendApi
    from webapp.answer_stream import sse

    citations = [{"rank": 2, "text": "second"}, {"rank": 1, "text": "first"}]
    events = [
        sse("start", {"message_id": 41, "citations": citations}),
        sse("token", {"text": "Juba"}),
        sse("token", {"text": " [1]"}),
        sse("done", {"answer": "Juba [1]", "metrics": {"ttft_s": 0.5, "mode": "full"}}),
    ]
    sent: list[dict] = []

    def reply(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        if len(sent) == 2:
            return httpx.Response(503, json={"code": "busy"}, headers={"Retry-After": "5"})
        return httpx.Response(
            200, text="".join(events), headers={"content-type": "text/event-stream"}
        )

    async def ask_twice() -> list[Answer]:
        api = RagblendApi("http://stack", "rbk_key", timeout_s=5)
        api.client = httpx.AsyncClient(
            base_url="http://stack", transport=httpx.MockTransport(reply)
        )
        answers = [Answer("full", i, "Where?", 0.0) for i in range(2)]
        for answer in answers:
            await api.ask(answer, collection_id=9)
        await api.client.aclose()
        return answers

    done, refused = asyncio.run(ask_twice())
    assert sent[0] == {"question": "Where?", "mode": "full", "stream": True, "collection_ids": [9]}
    assert done.ok and done.message_id == 41 and done.passages == ["first", "second"]
    assert len(done.token_times_s) == 2 and done.metrics == {"ttft_s": 0.5, "mode": "full"}
    assert not refused.ok and refused.error.startswith("HTTP 503")  # never retried
    assert len(sent) == 2
