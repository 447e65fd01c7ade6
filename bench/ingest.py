"""Ingest throughput on this machine: chunks per second for parse+chunk+embed and for KV
precompute, over the Musique passages (each passage one document, as a user would upload).

    python -m bench.ingest [--documents 200] [--json bench-ingest.json]

Runs the same functions the Celery tasks run (no broker, database or S3 in the timed loops,
so the numbers are the pipeline's compute); models are loaded and warmed before timing.

With ``--url`` and ``--api-key`` it measures the issue's target instead, on a running stack
(``make dev``): 20 passages uploaded through the REST API as 20 documents, timed until all
are ``ready`` (KV in S3 included); the documents are deleted afterwards::

    python -m bench.ingest --url http://127.0.0.1:8000 --api-key KEY
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from bench.data import shared_data


def load_passages(path: Path, limit: int) -> list[str]:
    examples = json.loads(path.read_text())
    texts = [f"{ctx['title']}\n\n{ctx['text']}" for ex in examples for ctx in ex["ctxs"]]
    return list(dict.fromkeys(texts))[:limit]


def bench_ingest(passages: list[str], chunk_tokens: int) -> tuple[dict, list[list[int]]]:
    from webapp.documents import parsing
    from webapp.documents.chunking import chunk_text, llm_tokenizer
    from webapp.documents.embeddings import embed_texts

    tokenizer = llm_tokenizer()
    embed_texts(["warm-up"])
    timings = {"parse": 0.0, "chunk": 0.0, "embed": 0.0}
    all_ids: list[list[int]] = []
    for text in passages:
        data = text.encode()
        t0 = time.perf_counter()
        parsed = parsing.parse(data, parsing.detect_type(data, "passage.txt"))
        t1 = time.perf_counter()
        chunks = chunk_text(parsed.text, tokenizer=tokenizer, max_tokens=chunk_tokens)
        t2 = time.perf_counter()
        embed_texts([c.text for c in chunks])  # per document, as the ingest task does
        t3 = time.perf_counter()
        timings["parse"] += t1 - t0
        timings["chunk"] += t2 - t1
        timings["embed"] += t3 - t2
        all_ids.extend(c.token_ids for c in chunks)
    total = sum(timings.values())
    return {
        "documents": len(passages),
        "chunks": len(all_ids),
        "tokens": sum(len(ids) for ids in all_ids),
        "seconds": round(total, 3),
        "seconds_by_step": {k: round(v, 3) for k, v in timings.items()},
        "chunks_per_s": round(len(all_ids) / total, 2),
    }, all_ids


def bench_kv(chunks_ids: list[list[int]], batch: int) -> dict:
    import torch

    from kvservice.store.format import encode_chunk
    from worker.kv import kv_producer

    producer = kv_producer()
    producer.compute(chunks_ids[:2])  # warm-up
    compute_s = encode_s = 0.0
    nbytes = 0
    for start in range(0, len(chunks_ids), batch):
        t0 = time.perf_counter()
        kvs = producer.compute(chunks_ids[start : start + batch])
        t1 = time.perf_counter()
        for chunk_kv in kvs:
            nbytes += len(encode_chunk(chunk_kv))
        compute_s += t1 - t0
        encode_s += time.perf_counter() - t1
    total = compute_s + encode_s
    return {
        "chunks": len(chunks_ids),
        "batch": batch,
        "head_tokens": len(producer.head_ids),
        "seconds": round(total, 3),
        "seconds_by_step": {"forward": round(compute_s, 3), "encode": round(encode_s, 3)},
        "chunks_per_s": round(len(chunks_ids) / total, 2),
        "tokens_per_s": round(sum(len(i) for i in chunks_ids) / total, 1),
        "mib_per_chunk": round(nbytes / len(chunks_ids) / 2**20, 3),
        "torch_threads": torch.get_num_threads(),
    }


def bench_twenty(passages: list[str], chunk_tokens: int, batch: int) -> dict:
    """The issue's target load, compute only: 20 passages, each ingested as its own document
    and its chunks precomputed in batches as the Celery tasks do (one worker process)."""
    from webapp.documents import parsing
    from webapp.documents.chunking import chunk_text, llm_tokenizer
    from webapp.documents.embeddings import embed_texts
    from worker.kv import kv_producer

    tokenizer, producer = llm_tokenizer(), kv_producer()
    start = time.perf_counter()
    chunks = 0
    for text in passages[:20]:
        data = text.encode()
        parsed = parsing.parse(data, parsing.detect_type(data, "passage.txt"))
        doc_chunks = chunk_text(parsed.text, tokenizer=tokenizer, max_tokens=chunk_tokens)
        embed_texts([c.text for c in doc_chunks])
        for i in range(0, len(doc_chunks), batch):
            producer.compute([c.token_ids for c in doc_chunks[i : i + batch]])
        chunks += len(doc_chunks)
    return {
        "documents": len(passages[:20]),
        "chunks": chunks,
        "seconds": round(time.perf_counter() - start, 2),
    }


def bench_stack(url: str, api_key: str, passages: list[str], count: int = 20) -> dict:
    """Upload ``count`` passages as documents to a running stack; seconds until all ready.
    Each run marks its passages (a first line), so nothing is served from an earlier run."""
    import uuid

    from bench.api import Api

    api, run = Api(url, api_key), uuid.uuid4().hex[:8]
    start = time.perf_counter()
    ids = {
        api.upload(f"bench-{run}-{i}.txt", f"Passage {i} (run {run})\n\n{text}")["id"]
        for i, text in enumerate(passages[:count])
    }
    uploaded = time.perf_counter() - start
    states: dict[int, str] = {}
    while True:
        listing = api.json("GET", "/api/v1/documents?limit=100")
        states = {d["id"]: d["status"] for d in listing["items"] if d["id"] in ids}
        if len(states) == len(ids) and all(s in ("ready", "failed") for s in states.values()):
            break
        if time.perf_counter() - start > 900:
            raise SystemExit(f"not ready after 15 minutes: {states}")
        time.sleep(1)
    seconds = time.perf_counter() - start
    for document_id in ids:
        api.json("DELETE", f"/api/v1/documents/{document_id}")
    failed = sorted(i for i, s in states.items() if s == "failed")
    return {
        "documents": len(ids),
        "failed": failed,
        "upload_s": round(uploaded, 2),
        "seconds_to_ready": round(seconds, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=shared_data())
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument(
        "--chunk-tokens", type=int, default=int(os.environ.get("CHUNK_TOKENS", 512))
    )
    parser.add_argument(
        "--kv-batch", type=int, default=int(os.environ.get("KV_PRECOMPUTE_BATCH", 8))
    )
    parser.add_argument("--skip-kv", action="store_true")
    parser.add_argument("--url", help="a running stack: time 20 documents to ready through it")
    parser.add_argument("--api-key", help="an API key of that stack (with --url)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    passages = load_passages(args.data, args.documents)
    if args.url:
        if not args.api_key:
            parser.error("--url needs --api-key")
        result = bench_stack(args.url, args.api_key, passages)
        print(
            f"{result['documents']} passages as documents through the stack: all ready "
            f"(KV included) in {result['seconds_to_ready']:.1f} s (uploads took "
            f"{result['upload_s']:.1f} s; failed: {result['failed'] or 'none'})"
        )
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return
    ingest, chunks_ids = bench_ingest(passages, args.chunk_tokens)
    steps = ingest["seconds_by_step"]
    print(
        f"parse+chunk+embed: {ingest['chunks']} chunks from {ingest['documents']} documents "
        f"in {ingest['seconds']:.2f} s -> {ingest['chunks_per_s']:.1f} chunks/s "
        f"(parse {steps['parse']:.2f} s, chunk {steps['chunk']:.2f} s, "
        f"embed {steps['embed']:.2f} s)"
    )
    results = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "ingest": ingest,
    }
    if not args.skip_kv:
        kv_result = bench_kv(chunks_ids, args.kv_batch)
        results["kv_precompute"] = kv_result
        print(
            f"KV precompute:     {kv_result['chunks']} chunks in {kv_result['seconds']:.2f} s -> "
            f"{kv_result['chunks_per_s']:.1f} chunks/s, {kv_result['tokens_per_s']:.0f} tokens/s "
            f"(batch {kv_result['batch']}, after a {kv_result['head_tokens']}-token prompt head; "
            f"{kv_result['mib_per_chunk']:.2f} MiB per chunk)"
        )
        twenty = bench_twenty(passages, args.chunk_tokens, args.kv_batch)
        results["twenty_passages"] = twenty
        print(
            f"20 Musique passages as 20 documents, parse to KV (compute only, one process): "
            f"{twenty['seconds']:.1f} s for {twenty['chunks']} chunks"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
