"""Cache-aware against random routing over two inference workers: hot-tier hit rate and TTFT.

    .venv/bin/python -m bench.routing --data ../shared/data/musique_dev.json \\
        --first 20 --per-set 4 --rounds 3 --json routing.json

Two users' document sets (each the passages of ``--per-set`` Musique examples, a scope each)
have their KV precomputed into S3 first, so every miss is a load from S3, never a recompute.
Two real inference workers (``python -m kvservice.worker``) then answer the same questions,
the two sets' examples alternating, ``--rounds`` times over, one at a time, under each policy
in turn, each policy with freshly started workers (cold memory tiers):

* ``cache-aware``: the queue ``kvservice.protocol.routing.choose_queue`` picks, as the web app does;
* ``random``: one of the two workers' own queues, uniformly.

Each worker's memory tier holds about one set (``KV_CPU_CAPACITY_BYTES``; no disk tier), the
situation routing is for: two workers cannot each hold everything. Reported per policy: the
share of chunk loads served from memory (the rest came from S3) and TTFT (median, p90),
as the worker measured it. Services (S3 gateway, valkey) run in a temporary directory and
stop at the end, also on failure.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.data import REPO_ROOT, passage_texts
from bench.s3 import BUCKET, start_gateway
from bench.stats import quantile
from deploy import services
from deploy.devstack import stop_all

BLEND_RATIO = 0.15


def _documents(data: Path, first: int, per_set: int, tokenizer) -> list[list[dict]]:
    """Two sets of questions, each ``{question, chunks: [token ids]}`` over its own
    examples' passages."""
    examples = json.loads(data.read_text())[first : first + 2 * per_set]
    sets: list[list[dict]] = [[], []]
    for index, example in enumerate(examples):
        chunks = [tokenizer.encode(text) for text in passage_texts(example, 6)]
        sets[index // per_set].append({"question": example["question"], "chunks": chunks})
    return sets


def _precompute_into_s3(sets: list[list[dict]], scopes: list[str], model_dir: Path, env) -> int:
    """Every chunk's KV into S3 (the bench's own process, S3 tier only): a miss is then an S3
    load."""
    from transformers import AutoTokenizer

    from kvservice.model.producer import KVProducer
    from kvservice.model.transformer import Transformer
    from kvservice.protocol.prompt import PromptFormat
    from kvservice.store import StoreConfig, TieredStore

    model = Transformer.from_pretrained(model_dir, device="cpu")
    prompt = PromptFormat.for_tokenizer(AutoTokenizer.from_pretrained(model_dir))
    only_s3 = {**env, "KV_CPU_CAPACITY_BYTES": "0", "KV_DISK_CAPACITY_BYTES": "0"}
    store = TieredStore.from_config(StoreConfig.from_env(only_s3))
    producer = KVProducer(model, list(prompt.storage_ids))
    written = 0
    for questions, scope in zip(sets, scopes, strict=True):
        for item in questions:
            for chunk in producer.compute(item["chunks"]):
                store.put(chunk, tiers=[], scope=scope)
                written += 1
    return written


def _start_workers(shared: str, env: dict[str, str], logs: Path) -> list[subprocess.Popen]:
    processes = []
    for index in (1, 2):
        worker_env = {
            **env,
            "INFERENCE_QUEUE": shared,
            "INFERENCE_NODE_NAME": f"{shared}-{index}@%h",
            "HEARTBEAT_KEY": f"routebench:{shared}:{index}",
        }
        log = open(logs / f"{shared}-{index}.log", "wb")  # noqa: SIM115 - the child keeps it
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "kvservice.worker"],
                cwd=REPO_ROOT,
                env=worker_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=services.die_with_parent(),
            )
        )
        log.close()
    return processes


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def run_policy(policy: str, sets, scopes, args, env, logs) -> list[dict[str, Any]]:
    import redis
    from celery import Celery

    from kvservice.protocol import (
        GENERATE_TASK,
        RECORD_QUEUE,
        ChunkRef,
        GenerateRequest,
        routing,
        worker_alive,
    )

    client = redis.Redis.from_url(env["REDIS_URL"])
    sender = Celery("routebench", broker=env["REDIS_URL"])
    shared = f"routebench-{policy}-{uuid.uuid4().hex[:6]}"
    processes = _start_workers(shared, env, logs)
    workers = [f"{socket.gethostname()}:{p.pid}" for p in processes]
    chooser = random.Random(args.seed)
    rows = []
    try:
        _wait(lambda: all(worker_alive(client, w) for w in workers), 300, "both workers")
        order = [(s, i) for i in range(args.per_set) for s in (0, 1)]
        for round_index in range(args.rounds):
            for set_index, item_index in order:
                item = sets[set_index][item_index]
                refs = [
                    ChunkRef(chunk_id=n, token_ids=ids, kv_scope=scopes[set_index])
                    for n, ids in enumerate(item["chunks"])
                ]
                if policy == "random":
                    queue = routing.worker_queue(chooser.choice(workers), shared)
                else:
                    queue = routing.choose_queue(client, refs, shared).queue
                request = GenerateRequest(
                    request_id=str(uuid.uuid4()),
                    question=item["question"],
                    chunks=refs,
                    mode="blend",
                    recompute_ratio=BLEND_RATIO,
                    max_new_tokens=1,
                )
                sender.send_task(GENERATE_TASK, args=[request.to_dict()], queue=queue)

                def final(request_id=request.request_id):
                    """The worker's report (its record task's message: no web side runs here
                    to record it and end the stream)."""
                    for raw in client.lrange(RECORD_QUEUE, 0, -1):
                        args = json.loads(base64.b64decode(json.loads(raw)["body"]))[0]
                        if args[2:] == [request_id]:
                            client.lrem(RECORD_QUEUE, 1, raw)
                            return args[1]
                    return None

                metrics = _wait(final, 300, "an answer").get("metrics") or {}
                tiers = list(metrics.get("chunk_tiers", {}).values())
                rows.append(
                    {
                        "policy": policy,
                        "round": round_index,
                        "set": set_index,
                        "worker": workers.index(metrics["worker"])
                        if metrics.get("worker") in workers
                        else None,
                        "ttft_s": metrics.get("ttft_s"),
                        "hot": sum(t in ("cpu", "device") for t in tiers),
                        "chunks": len(tiers),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
                time.sleep(args.settle_s)  # the worker's hot set reaches Redis
    finally:
        stop_all(processes)
        client.close()
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in sorted({r["policy"] for r in rows}):
        mine = [r for r in rows if r["policy"] == policy]
        ttft = sorted(r["ttft_s"] for r in mine if r["ttft_s"] is not None)
        out[policy] = {
            "questions": len(mine),
            "hot_hit_rate": round(sum(r["hot"] for r in mine) / sum(r["chunks"] for r in mine), 3),
            "ttft_median_s": round(statistics.median(ttft), 3),
            "ttft_p90_s": round(quantile(ttft, 0.9), 3),
            "per_worker": {str(w): sum(r["worker"] == w for r in mine) for w in (0, 1)},
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.routing", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--first", type=int, default=20, help="first Musique example")
    parser.add_argument("--per-set", type=int, default=4, help="examples per document set")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policies", default="cache-aware,random")
    parser.add_argument(
        "--cpu-tier",
        default="400MiB",
        help="each worker's memory tier (a set of 4 examples is ~320 MB)",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=0.5,
        help="pause after each answer (the hot set reaches Redis)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from kvservice.model.bundled import resolve_llm_path
    from kvservice.protocol.models import default_cache_dir

    model_dir = resolve_llm_path(None, default_cache_dir())
    sets = _documents(args.data, args.first, args.per_set, AutoTokenizer.from_pretrained(model_dir))
    scopes = ["rba", "rbb"]
    with tempfile.TemporaryDirectory(prefix="ragblend-routebench-") as directory:
        work = Path(directory)
        started = []
        try:
            s3 = start_gateway(work)
            started.append(s3)
            valkey = services.start_valkey(work, port=services.free_port(), password="bench")
            started.append(valkey)
            env = {
                **os.environ,
                **s3.env,
                **valkey.env,
                "PYTHONUNBUFFERED": "1",
                "KV_S3_BUCKET": BUCKET,
                "KV_CPU_CAPACITY_BYTES": args.cpu_tier,
                "KV_DISK_CAPACITY_BYTES": "0",
                "INFERENCE_CONCURRENCY": "2",
            }
            written = _precompute_into_s3(sets, scopes, model_dir, env)
            print(f"precomputed {written} chunks into S3", flush=True)
            rows = []
            for policy in args.policies.split(","):
                rows += run_policy(policy, sets, scopes, args, env, work)
        finally:
            stop_all(started)
    summary = {
        "policies": summarize(rows),
        "rows": rows,
        "settings": {
            "first": args.first,
            "per_set": args.per_set,
            "rounds": args.rounds,
            "cpu_tier": args.cpu_tier,
            "blend_ratio": BLEND_RATIO,
            "cores": os.cpu_count(),
            "load_avg_after": os.getloadavg(),
        },
    }
    for policy, figures in summary["policies"].items():
        print(
            f"{policy:12s} hot-tier hit rate {figures['hot_hit_rate']:.0%}  TTFT median "
            f"{figures['ttft_median_s']:.2f} s  p90 {figures['ttft_p90_s']:.2f} s  "
            f"questions per worker {figures['per_worker']}"
        )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
