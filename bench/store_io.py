"""Store I/O benchmark: how fast chunk KV comes back from each tier, and how much of that
load the pipelined loader hides behind per-layer compute.

    python -m bench.store_io [--chunks 6 --tokens 512 --compute-ms 20 --json out.json]

Chunks are random KV of SmolLM2-135M's shape (30 layers, 3 KV heads, head dim 64, fp32).
"Compute" is real CPU work (a matmul loop calibrated to ``--compute-ms`` per layer), so the
fetch threads compete for the CPU as they do beside the model. Without ``S3_ENDPOINT`` in
the environment a SeaweedFS gateway is started for the run (``bench.s3``). Prints one line
per case and writes the JSON list.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.s3 import gateway_unless_configured
from kvservice.blend.controller import LoadingController
from kvservice.chunk import ChunkKV
from kvservice.store.config import StoreConfig
from kvservice.store.loader import KVLoader
from kvservice.store.s3 import S3Tier
from kvservice.store.tiered import TieredStore


def _calibrated_work(ms: float) -> Any:
    """A function that keeps one core busy for about ``ms`` milliseconds."""
    a = torch.randn(256, 256)

    def work(reps: int) -> None:
        for _ in range(reps):
            torch.mm(a, a)

    work(10)
    started = time.perf_counter()
    work(50)
    per_rep = (time.perf_counter() - started) / 50
    reps = max(0, round(ms / 1000 / per_rep))
    return lambda: work(reps)


def run(args: argparse.Namespace, env: dict[str, str], root: Path) -> list[dict[str, Any]]:
    config = StoreConfig.from_env(
        {**env, "KV_DISK_DIR": str(root / "disk"), "KV_CPU_CAPACITY_BYTES": "4GiB"}
    )
    store = TieredStore.from_config(config)
    shape = (args.layers, args.kv_heads, args.tokens, args.head_dim)
    chunks = [
        ChunkKV(
            list(range(i * args.tokens, (i + 1) * args.tokens)),
            torch.randn(shape),
            torch.randn(shape),
            "store-io",
            "h",
        )
        for i in range(args.chunks)
    ]
    compute = _calibrated_work(args.compute_ms)
    results = []
    for quantize in (False, True):
        keys = [store.put(chunk, tiers=[], quantize=quantize) for chunk in chunks]
        for tier in ("cpu", "disk", "s3"):
            for pipeline in (True, False):
                for key in keys:
                    store.drop_local(key)
                if tier != "s3":
                    for chunk in chunks:
                        store.put(chunk, tiers=[tier], quantize=quantize, write_through=False)
                with KVLoader(store, pipeline=pipeline, promote=False) as loader:
                    started = time.perf_counter()
                    batch = loader.open(keys)
                    for layer in range(args.layers):
                        for source in batch:
                            source.layer(layer)
                        compute()
                    total_s = time.perf_counter() - started
                    stats = batch.stats()
                row = {
                    "tier": tier,
                    "pipeline": pipeline,
                    "quantized": quantize,
                    "total_s": total_s,
                    "compute_s": args.layers * args.compute_ms / 1000,
                    "load_s": stats.load_s,
                    "wait_s": stats.wait_s,
                    "hidden_load_fraction": stats.hidden_load_fraction,
                    "bytes_read": stats.bytes_read,
                }
                results.append(row)
                print(
                    f"{tier:4s} pipeline={pipeline!s:5s} quantized={quantize!s:5s} "
                    f"total={total_s:.3f}s load={stats.load_s:.3f}s wait={stats.wait_s:.3f}s "
                    f"hidden={stats.hidden_load_fraction:.2f} MB={stats.bytes_read / 1e6:.0f}"
                )
    controller = LoadingController()
    controller.observe_store_stats(store.stats().tiers)
    print(
        "measured tier bandwidth (MB/s):",
        {k: round(v / 1e6) for k, v in controller.tier_bandwidth.items()},
    )
    plain = _plain_get_mbps(store, keys)
    print(f"plain GET of the same S3 objects, one after another: {plain:.0f} MB/s")
    return results


def _plain_get_mbps(store: TieredStore, keys: list) -> float:
    """What a bare GET of the stored objects reads (the minio client, whole objects): the
    rate the S3 tier's own figure is to be compared with."""
    s3 = next(tier for tier in store.tiers if isinstance(tier, S3Tier))
    nbytes, started = 0, time.perf_counter()
    for key in keys:
        response = s3.client.get_object(s3.bucket, s3.object_name(key))
        try:
            nbytes += len(response.read())
        finally:
            response.close()
            response.release_conn()
    return nbytes / (time.perf_counter() - started) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--compute-ms", type=float, default=20.0, help="CPU work per layer")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kv-store-io-") as tmp:
        root = Path(tmp)
        env = dict(os.environ)
        gateway = gateway_unless_configured(env, root)
        if gateway is not None:
            env.update(gateway.env)
        try:
            results = run(args, env, root)
        finally:
            if gateway is not None:
                gateway.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
