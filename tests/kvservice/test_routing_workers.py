"""Two real inference workers sharing one S3 tier: each document set's questions land on the
worker that holds its chunks hot, and when that worker is killed the other answers."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from celery import Celery

from deploy.devstack import stop_all
from kvservice.protocol import (
    GENERATE_TASK,
    RECORD_QUEUE,
    ChunkRef,
    End,
    GenerateRequest,
    answer_stream,
    decode_events,
    outcome_of,
    routing,
    worker_alive,
)
from tests.conftest import ROOT, wait_for

PASSAGES = json.loads((ROOT / "tests" / "data" / "musique_passages.json").read_text())["passages"]


def _report(client: redis.Redis, request_id: str) -> dict | None:
    """The answer's outcome: its stream's end, once a web side's record task has stored it,
    else the worker's report still waiting on the ``answers`` queue (no web side here)."""
    name = answer_stream(request_id)
    for _id, event in decode_events([(name, client.xrange(name))]):
        if isinstance(event, End):
            return outcome_of(event).to_dict()
    for raw in client.lrange(RECORD_QUEUE, 0, -1):
        args = json.loads(base64.b64decode(json.loads(raw)["body"]))[0]
        if args[2:] == [request_id]:
            return args[1]
    return None


def _start_worker(shared: str, index: int, tmp_path: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "INFERENCE_QUEUE": shared,
        "INFERENCE_CONCURRENCY": "2",
        "INFERENCE_NODE_NAME": f"{shared}-{index}@%h",
        "KV_DISK_DIR": str(tmp_path / f"disk{index}"),
        "HEARTBEAT_KEY": f"ragblend:inference:heartbeat:{shared}-{index}",
    }
    log = open(tmp_path / f"inference{index}.log", "wb")  # noqa: SIM115 - the child keeps it
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "kvservice.worker"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()


@pytest.mark.slow
def test_questions_go_to_the_worker_holding_their_chunks_and_survive_its_death(
    redis_service, smollm2_tokenizer, tmp_path
) -> None:
    shared = f"inference-two-{uuid.uuid4().hex[:6]}"
    client = redis.Redis.from_url(redis_service.env["REDIS_URL"])
    sender = Celery("routing-test", broker=redis_service.env["REDIS_URL"])
    processes = [_start_worker(shared, index, tmp_path) for index in (1, 2)]
    ids = [f"{socket.gethostname()}:{process.pid}" for process in processes]
    texts = PASSAGES

    def chunks(scope: str, passages: list[str]) -> list[ChunkRef]:
        return [
            ChunkRef(chunk_id=n, token_ids=smollm2_tokenizer.encode(text), kv_scope=scope)
            for n, text in enumerate(passages)
        ]

    def ask(refs: list[ChunkRef], queue: str | None = None) -> dict:
        """Send a question as the web side does (or to ``queue``); its outcome's metrics."""
        request = GenerateRequest(
            request_id=str(uuid.uuid4()),
            question="Which river is named here?",
            chunks=refs,
            mode="reuse",
            max_new_tokens=2,
        )
        queue = queue or routing.choose_queue(client, refs, shared).queue
        sender.send_task(GENERATE_TASK, args=[request.to_dict()], queue=queue)
        final = wait_for(
            lambda: _report(client, request.request_id),
            timeout=240,
            interval=0.3,
            what="the answer",
        )
        assert "metrics" in final, final
        return final["metrics"]

    def holds(worker: str, refs: list[ChunkRef]) -> bool:
        digests = [routing.ref_digest(ref) for ref in refs]
        return all(client.smismember(routing.hot_key(worker, shared), digests))

    set_a, set_b = chunks("ra", texts[:3]), chunks("rb", texts[3:6])
    try:
        wait_for(
            lambda: (
                all(worker_alive(client, w) for w in ids)
                or any(p.poll() is not None for p in processes)
            ),
            timeout=300,
            interval=1,
            what="both inference workers",
        )
        assert all(p.poll() is None for p in processes), (tmp_path / "inference1.log").read_text()

        # Nobody holds set A: the shared queue, whichever worker is free.
        first = ask(set_a)["worker"]
        other = next(w for w in ids if w != first)
        wait_for(lambda: holds(first, set_a), timeout=30, what="set A advertised hot")
        # Set B made hot on the other worker (its own queue, as a routed question would be).
        assert ask(set_b, routing.worker_queue(other, shared))["worker"] == other
        wait_for(lambda: holds(other, set_b), timeout=30, what="set B advertised hot")

        for _ in range(2):  # routed: each set to its holder, served from its memory tier
            for refs, holder in ((set_a, first), (set_b, other)):
                metrics = ask(refs)
                assert metrics["worker"] == holder
                # memory: its CPU tier, or the previous same prompt's context KV (prefix)
                assert set(metrics["chunk_tiers"].values()) <= {"device", "cpu", "prefix"}, metrics

        # The holder of set A dies. A question already routed to it goes back to the shared
        # queue; the next ones go to the worker that is left.
        dead = processes[ids.index(first)]
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        orphan = GenerateRequest(
            str(uuid.uuid4()), "Which river?", set_a, mode="reuse", max_new_tokens=2
        )
        sender.send_task(
            GENERATE_TASK, args=[orphan.to_dict()], queue=routing.worker_queue(first, shared)
        )
        wait_for(lambda: not worker_alive(client, first), timeout=20, what="the alive key")
        assert routing.requeue_orphans(client, shared) == 1
        wait_for(
            lambda: (_report(client, orphan.request_id) or {}).get("status") == "done",
            timeout=240,
            interval=0.3,
            what="the requeued question's answer",
        )
        assert ask(set_a)["worker"] == other
    finally:
        stop_all(processes)
        client.close()
