"""A bounded load and soak run against a running stack, over loopback, with figures.

    DATA_DIR=.ragblend .venv/bin/python -m deploy.loadtest --users 20 --duration 600 \\
        --json load.json

Each simulated user (its own account and API key, made here through the stack's database)
uploads a small document now and then and asks questions through ``POST /api/v1/query`` with
``stream: true``, back to back; a 429 or 503 is honoured by waiting its ``Retry-After``. At
the end the run waits for every answer to settle, then reports: responses by status (and
whether each 429/503 carried ``Retry-After``), time to first token (p50/p95) seen by the
client, answers by final state in the database (``pending`` left = stuck; a started stream
without an end = lost), and the memory of each stack process before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from collections import Counter
from typing import Any

import httpx
import psutil

from kvservice.protocol import environment

SENTENCES = [
    "The harbour of Veldmark was rebuilt in 1893 after the great storm.",
    "Its lighthouse keeper, Ada Brandt, kept a log of every ship for forty years.",
    "The town's guild of rope makers supplied the whole northern coast.",
    "A railway reached Veldmark in 1911 and the fish market moved inland.",
    "The museum now holds the keeper's logbooks and a model of the old pier.",
]
QUESTIONS = [
    "Who kept the lighthouse log?",
    "When was the harbour rebuilt?",
    "What did the rope makers supply?",
    "When did the railway reach the town?",
    "What does the museum hold?",
]
ROLES = {
    "uvicorn": "web",
    "kvservice.worker": "inference",
    "inference@": "inference",
    "celery": "celery",
    "postgres": "postgres",
    "weed": "s3",
    "valkey": "valkey",
}


def stack_memory() -> dict[str, float]:
    """Resident memory (MiB) of the stack's processes on this machine, by role."""
    totals: Counter[str] = Counter()
    for process in psutil.process_iter(["cmdline", "memory_info"]):
        title = " ".join(process.info["cmdline"] or [])
        role = next((r for key, r in ROLES.items() if key in title), None)
        if role and process.info["memory_info"] and "deploy.loadtest" not in title:
            totals[role] += process.info["memory_info"].rss / 2**20
    return {role: round(mib, 1) for role, mib in sorted(totals.items())}


def make_users(count: int) -> list[tuple[int, str]]:
    """(user id, API key) of ``count`` load-test accounts, made in the stack's database."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    django.setup()
    from django.contrib.auth import get_user_model

    from webapp.accounts.services import api_key_create

    users = []
    for index in range(count):
        user, _ = get_user_model().objects.get_or_create(username=f"load-{index:03d}")
        _, key = api_key_create(user=user, name=f"loadtest {time.strftime('%H:%M:%S')}")
        users.append((user.pk, key))
    return users


class Stats:
    def __init__(self) -> None:
        self.statuses: Counter[str] = Counter()
        self.retry_after_missing = 0
        self.ttft_s: list[float] = []
        self.started: set[int] = set()  # message ids whose stream began
        self.ended: set[int] = set()  # message ids whose stream ended (done or error)
        self.uploads: Counter[int] = Counter()


async def _wait_hint(response: httpx.Response, stats: Stats) -> None:
    stats.statuses[str(response.status_code)] += 1
    hint = response.headers.get("retry-after", "")
    if not hint.isdigit():
        stats.retry_after_missing += 1
    await asyncio.sleep(min(int(hint) if hint.isdigit() else 5, 30))


async def ask(client: httpx.AsyncClient, question: str, stats: Stats) -> None:
    started = time.monotonic()
    body = {"question": question, "stream": True}
    async with client.stream("POST", "/api/v1/query", json=body) as response:
        if response.status_code in (429, 503):
            await _wait_hint(response, stats)
            return
        stats.statuses[str(response.status_code)] += 1
        if response.status_code != 200:
            return
        event, message_id, first = None, None, True
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event:
                data = json.loads(line[6:])
                if event == "start":
                    message_id = data["message_id"]
                    stats.started.add(message_id)
                elif event == "token" and first:
                    stats.ttft_s.append(time.monotonic() - started)
                    first = False
                elif event in ("done", "error") and message_id is not None:
                    stats.ended.add(message_id)


async def upload(client: httpx.AsyncClient, user_id: int, stats: Stats) -> None:
    number = stats.uploads[user_id]
    text = " ".join(SENTENCES[(number + i) % len(SENTENCES)] for i in range(12))
    text += f"\n\nThis is note {number} of reader {user_id}."
    files = {"file": (f"note-{number}.txt", text.encode(), "text/plain")}
    response = await client.post("/api/v1/documents", files=files)
    if response.status_code in (429, 503):
        await _wait_hint(response, stats)
        return
    stats.statuses[f"upload {response.status_code}"] += 1
    stats.uploads[user_id] += 1


async def simulated_user(url: str, user_id: int, key: str, deadline: float, stats: Stats) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    timeout = httpx.Timeout(360, connect=10)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as client:
        turn = 0
        while time.monotonic() < deadline:
            try:
                if turn % 5 == 0:
                    await upload(client, user_id, stats)
                await ask(client, QUESTIONS[turn % len(QUESTIONS)], stats)
            except httpx.HTTPError as err:
                stats.statuses[f"error {type(err).__name__}"] += 1
                await asyncio.sleep(2)
            turn += 1


def settle(user_ids: list[int], since: float, wait_s: float) -> dict[str, int]:
    """Answers of these users made during the run, by state, once none is pending (or the
    wait is over: what is still pending then is stuck)."""
    from datetime import UTC, datetime

    from webapp.chat.models import Message

    answers = Message.objects.filter(
        role=Message.Role.ASSISTANT,
        conversation__owner_id__in=user_ids,
        created_at__gte=datetime.fromtimestamp(since, tz=UTC),
    )
    end = time.monotonic() + wait_s
    while answers.filter(status__in=["pending", "streaming"]).exists() and time.monotonic() < end:
        time.sleep(2)
    return dict(Counter(answers.values_list("status", flat=True)))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))], 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=f"http://127.0.0.1:{environment.read('PORT')}")
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--settle", type=float, default=420.0, help="seconds to let answers end")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args()

    users = make_users(args.users)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    memory_before = stack_memory()
    stats, since = Stats(), time.time()
    deadline = time.monotonic() + args.duration

    async def run() -> None:
        await asyncio.gather(
            *(simulated_user(args.url, uid, key, deadline, stats) for uid, key in users)
        )

    asyncio.run(run())
    answers = settle([uid for uid, _ in users], since, args.settle)
    report: dict[str, Any] = {
        "users": args.users,
        "duration_s": args.duration,
        "responses": dict(sorted(stats.statuses.items())),
        "refusals_without_retry_after": stats.retry_after_missing,
        "ttft_s": {
            "n": len(stats.ttft_s),
            "p50": percentile(stats.ttft_s, 0.5),
            "p95": percentile(stats.ttft_s, 0.95),
            "mean": round(statistics.fmean(stats.ttft_s), 2) if stats.ttft_s else None,
        },
        "answers": answers,
        "streams_started": len(stats.started),
        "streams_without_an_end": len(stats.started - stats.ended),
        "uploads": sum(stats.uploads.values()),
        "memory_mib_before": memory_before,
        "memory_mib_after": stack_memory(),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
