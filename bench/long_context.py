"""The long-context benchmark: TTFT, memory and loading of the prefill modes on a random-weight
model of a real model's shape (``kvservice.tools.synthetic``), at any context length.

    python -m kvservice.bench --synthetic llama3-8b [--layers N] --context 16384 --chunks 12 \\
        --modes full,reuse,blend --ratio 0.15 [--device cuda] [--dtype bfloat16] --json out.json

The prompt is a short random head (the system prompt's stand-in), ``--chunks`` random chunks
of equal length filling ``--context``, and a short random question. The chunks' KV is
precomputed after the head and staged in ``--tier`` before any timing, and each mode reads it
through the store's loader (``bench.staging``, as the Musique bench does). Each mode
runs ``--warmup`` untimed prefills, then ``--repeats`` timed ones, the modes interleaved.

Per mode (``modes.<mode>`` in the JSON, the Musique bench's names where they mean the same):

* ``ttft_median_s``, ``ttft_ratio_to_full``: median time to first token, and relative to full;
* ``prefill_tokens_per_s``: prompt tokens over that TTFT (for reuse and blend an effective
  rate: they compute only some of the tokens);
* ``peak_memory_bytes``: on CUDA, ``torch.cuda.max_memory_allocated`` over the mode's timed
  runs (weights and staged chunks included; ``memory.baseline_bytes`` is what was allocated
  before any run). On CPU there is no per-mode figure: ``memory`` gives the process's max
  resident set over the whole run instead, labelled as such;
* ``load_s``, ``load_wait_s``, ``hidden_load_fraction``: the loader's time with a fetch in
  flight, the time the prefill waited for it, and the share of the load it did not wait for;
* ``kl_to_full``, ``agrees_with_full``: KL(mode || full) of the first token's distribution and
  whether its top-1 is full's. On random weights these mean little (attention is near uniform,
  so which tokens blend recomputes barely matters): a check that the modes ran the same model,
  not a quality figure; quality is the Musique bench's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
from collections.abc import Mapping
from dataclasses import asdict

import torch

from bench.codec import decode_speed
from bench.opcount import count_ops
from bench.prefill import chunk_sources
from bench.staging import bench_of, on_device
from bench.timing import cpu_name, synchronize, timed
from kvservice.blend.graphs import PassGraphs, graphs_from_env, graphs_report, use_pass_graphs
from kvservice.blend.prefill import BlendSettings, Mode, blend_prefill
from kvservice.chunk import ChunkKV
from kvservice.model.producer import KVProducer
from kvservice.model.transformer import Transformer
from kvservice.protocol.codecs import codec_by_name
from kvservice.store.config import StoreConfig
from kvservice.store.format import encode_chunk
from kvservice.store.loader import DECODE_LAYERS
from kvservice.tools.synthetic import SYNTHETIC_CONFIGS, random_model, synthetic_config

HEAD_TOKENS = 32  # the system prompt's stand-in, before the chunks
QUESTION_TOKENS = 32
FIDELITY_NOTE = (
    "kl_to_full / agrees_with_full are on random weights: they show the modes run the same "
    "model, not answer quality (see the Musique bench)"
)


def synthetic_prompt(
    vocab_size: int, context: int, chunks: int, *, seed: int = 0
) -> tuple[list[int], list[list[int]], list[int]]:
    """Random ``(head, chunks, question)`` token ids: ``HEAD_TOKENS`` and
    ``QUESTION_TOKENS`` long, and ``chunks`` chunks of equal length filling the rest of
    ``context`` (the remainder of the division is left out)."""
    chunk_tokens = (context - HEAD_TOKENS - QUESTION_TOKENS) // chunks
    if chunk_tokens < 1:
        raise ValueError(f"--context {context} leaves no tokens for {chunks} chunks")
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=generator).tolist()

    return (
        tokens(HEAD_TOKENS),
        [tokens(chunk_tokens) for _ in range(chunks)],
        tokens(QUESTION_TOKENS),
    )


def first_token_fidelity(logits: torch.Tensor, full_logits: torch.Tensor) -> dict:
    """KL(mode || full) of the next-token distributions ``[V]``, and top-1 agreement."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    full = torch.log_softmax(full_logits.float(), dim=-1)
    kl = (logp.exp() * (logp - full)).sum().item()
    return {"kl_to_full": max(kl, 0.0), "agrees_with_full": bool(logp.argmax() == full.argmax())}


def build_model(args: argparse.Namespace) -> Transformer:
    config = synthetic_config(args.synthetic, layers=args.layers)
    return random_model(config, seed=args.seed, dtype=args.dtype, device=args.device)


def run(args: argparse.Namespace, model: Transformer) -> dict:
    """Stage the prompt's chunks, time every run of ``args.plan`` and summarize."""
    device = model.device
    head, chunk_ids, question = synthetic_prompt(
        model.config.vocab_size, args.context, args.chunks, seed=args.seed
    )
    prompt_tokens = len(head) + sum(map(len, chunk_ids)) + len(question)
    producer = KVProducer(model, head)
    head_kv, chunks = producer.head_kv, producer.compute(chunk_ids)
    for tier in {args.tier, *args.run_tiers.values()}:  # before any timing
        bench_of(args, tier).stage(chunks)
    plan: dict[str, tuple[Mode, float]] = args.plan

    def prefill(key: str, mode: Mode, ratio: float) -> tuple[torch.Tensor, float]:
        result = blend_prefill(
            model,
            head,
            chunk_sources(chunks, args, mode, key),
            question,
            mode=mode,
            recompute_ratio=ratio,
            chunk_ids=chunk_ids,
            head_kv=head_kv,
            settings=BlendSettings(**args.blend),
        )
        int(result.logits.argmax())  # the first token: TTFT ends here
        # Only the logits are kept: a run's cache must not count in the next run's memory.
        return result.logits, result.recompute_ratio_effective

    for _ in range(args.warmup):
        for key, (mode, ratio) in plan.items():
            prefill(key, mode, ratio)
    for tier in {args.tier, *args.run_tiers.values()}:  # report the timed runs' loads only
        bench_of(args, tier).stage(chunks)
    synchronize(device)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    ttft: dict[str, list[float]] = {key: [] for key in plan}
    peak: dict[str, int] = {}
    logits: dict[str, torch.Tensor] = {}
    ratios: dict[str, float] = {}
    for _ in range(args.repeats):
        for key, (mode, ratio) in plan.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            (logits[key], ratios[key]), seconds = timed(
                lambda key=key, mode=mode, ratio=ratio: prefill(key, mode, ratio), device
            )
            ttft[key].append(seconds)
            if device.type == "cuda":
                peak[key] = max(peak.get(key, 0), torch.cuda.max_memory_allocated(device))

    # Operators each run dispatches, counted on an untimed run of its own (bench.opcount).
    ops = {
        key: count_ops(functools.partial(prefill, key, mode, ratio), model.config.n_layers)
        for key, (mode, ratio) in plan.items()
    }
    full_logits = logits["full"] if "full" in logits else prefill("full", "full", 0.0)[0]
    full_ttft = statistics.median(ttft["full"]) if "full" in ttft else None
    modes = {}
    for key in plan:
        median = statistics.median(ttft[key])
        bench = bench_of(args, args.run_tiers.get(key, args.tier))
        modes[key] = {
            "ttft_median_s": median,
            "ttft_s": ttft[key],
            "ttft_ratio_to_full": median / full_ttft if full_ttft else None,
            "prefill_tokens_per_s": prompt_tokens / median,
            "recompute_ratio": ratios[key],
            "peak_memory_bytes": peak.get(key),
            "ops_per_layer": ops[key].per_layer,
            **bench.report(
                key,
                prompt_tokens=prompt_tokens,
                num_layers=model.config.n_layers,
                full_ttft_s=full_ttft,
            ),
            **first_token_fidelity(logits[key], full_logits),
        }
    return {
        "synthetic": args.synthetic,
        "modes": modes,
        "codecs": codec_report(chunks, model, args.synthetic),
        "memory": memory_report(model, baseline),
        "fidelity_note": FIDELITY_NOTE,
        "prompt": {
            "tokens": prompt_tokens,
            "head_tokens": len(head),
            "chunks": len(chunk_ids),
            "chunk_tokens": len(chunk_ids[0]),
            "question_tokens": len(question),
        },
    }


def codec_report(chunks: list[ChunkKV], model: Transformer, name: str) -> dict:
    """Per stored form (``fp16`` and the store's codec, ``KV_CODEC``): the objects' bytes a
    token, those at the full model's depth (``--layers`` keeps fewer), and decoding's speed in
    GB/s of float16 KV on this device's threads, layer by layer (the loader on the CPU) and
    in runs of ``DECODE_LAYERS`` (the loader on CUDA)."""
    config = StoreConfig.from_env()
    full_layers = SYNTHETIC_CONFIGS[name]["num_hidden_layers"]
    tokens = sum(chunk.num_tokens for chunk in chunks)
    report = {}
    for codec_name in dict.fromkeys(["fp16", config.codec]):
        codec = codec_by_name(codec_name)
        objects = [
            encode_chunk(on_device(chunk, model.device), codec=codec, narrow_to=config.narrow_to)
            for chunk in chunks
        ]
        per_token = sum(map(len, objects)) / tokens
        report[codec_name] = {
            "bytes_per_token": per_token,
            "bytes_per_token_all_layers": per_token * full_layers / model.config.n_layers,
            "decode_gb_per_s": decode_speed(objects, str(model.device)),
            "decode_gb_per_s_in_runs": decode_speed(
                objects, str(model.device), layers_per_call=DECODE_LAYERS
            ),
        }
    return report


def memory_report(model: Transformer, baseline: int | None) -> dict:
    """What the peak-memory figures measure on this device."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    device = model.device
    if device.type == "cuda":
        return {
            "device": str(device),
            "measure": "torch.cuda.max_memory_allocated per mode (modes.<mode>.peak_memory_bytes)",
            "weights_bytes": weights,
            "baseline_bytes": baseline,
        }
    # ru_maxrss is in KiB on Linux
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "device": str(device),
        "measure": "process max RSS over the whole run (no per-mode peak on CPU)",
        "process_max_rss_bytes": rss,
        "weights_bytes": weights,
    }


def bench_graphs(model: Transformer, capacity: int) -> PassGraphs | None:
    """Recorded passes (kvservice.blend.graphs) where the model runs on CUDA, unless
    ``ENGINE_COMPILE=off``: the warm-up runs record them (a shape the first time it is met,
    where the worker records it the second: the timed runs are what follows either way)."""
    if model.device.type != "cuda" or not graphs_from_env(os.environ):
        return None
    return use_pass_graphs(model, capacity, record_after=1)


def environment(args: argparse.Namespace, model: Transformer, load_before) -> dict:
    device = model.device
    return {
        "torch": torch.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "dtype": str(args.dtype).removeprefix("torch."),
        "model": args.synthetic,
        "layers": model.config.n_layers,
        "config": asdict(model.config),
        "model_fingerprint": model.fingerprint,
        "seed": args.seed,
        "context": args.context,
        "ratio": args.ratio,
        "ratios": args.ratios,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "blend_settings": args.blend,
        "tier": args.tier,
        "also_tiers": sorted(set(args.run_tiers.values())),
        "pipeline": not args.no_pipeline,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),  # other processes share these cores
    }


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def print_table(report: Mapping) -> None:
    header = (
        f"{'run':13} {'TTFT s':>8} {'x full':>6} {'tok/s':>8} {'peak GiB':>8} {'load s':>7} "
        f"{'hidden':>6} {'KL':>8} {'agree':>5} {'ops/L':>6}"
    )
    print(header)
    print("-" * len(header))
    for key, m in report["modes"].items():
        ratio, hidden = m["ttft_ratio_to_full"], m["hidden_load_fraction"]
        print(
            f"{key:13} {m['ttft_median_s']:8.3f} {ratio or float('nan'):6.3f} "
            f"{m['prefill_tokens_per_s']:8.0f} {_gib(m['peak_memory_bytes']):>8} "
            f"{m['load_s']:7.3f} {'-' if hidden is None else f'{hidden:.2f}':>6} "
            f"{m['kl_to_full']:8.2e} {'yes' if m['agrees_with_full'] else 'no':>5} "
            f"{m.get('ops_per_layer') or float('nan'):6.1f}"
        )
    memory, prompt, env = report["memory"], report["prompt"], report["env"]
    print(
        f"{env['model']} (layers: {env['layers']}, {env['dtype']}, {env['device_name']}), "
        f"{prompt['tokens']} prompt tokens: {prompt['chunks']} chunks x {prompt['chunk_tokens']}, "
        f"median of {env['repeats']} after {env['warmup']} warm-up; chunks from {env['tier']}"
    )
    graphs = env.get("pass_graphs") or {}
    if graphs.get("on"):
        failed = f"; stopped recording: {graphs['failed']}" if graphs["failed"] else ""
        took = graphs.get("recording_s")
        took = f" (each in {took['median']:.2f} s, at most {took['max']:.2f})" if took else ""
        print(
            f"passes as CUDA graphs: {graphs['recorded']} recorded{took}, "
            f"{graphs['replays']} replays{failed}"
        )
    if "process_max_rss_bytes" in memory:
        print(
            f"memory: {memory['measure']}: {_gib(memory['process_max_rss_bytes'])} GiB "
            f"(weights {_gib(memory['weights_bytes'])} GiB)"
        )
    else:
        print(
            f"memory: {memory['measure']}; weights {_gib(memory['weights_bytes'])} GiB, "
            f"allocated before the runs {_gib(memory['baseline_bytes'])} GiB"
        )
    for name, c in report.get("codecs", {}).items():
        print(
            f"stored as {name}: {c['bytes_per_token']:,.0f} B a token "
            f"({c['bytes_per_token_all_layers']:,.0f} at every layer of {env['model']}), "
            f"decoded at {c['decode_gb_per_s']:.2f} GB/s of fp16 KV layer by layer, "
            f"{c['decode_gb_per_s_in_runs']:.2f} in runs of {DECODE_LAYERS} layers"
        )
    print(FIDELITY_NOTE)


def main(args: argparse.Namespace) -> dict:
    """``python -m kvservice.bench --synthetic NAME ...`` (arguments parsed there)."""
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    model = build_model(args)
    args.kv_dtype = model.cache_dtype  # what the store's loader decodes into (bench_of)
    graphs = bench_graphs(model, args.context + 1024)
    with torch.no_grad():
        report = run(args, model)
    report["env"] = environment(args, model, load_before)
    report["env"]["pass_graphs"] = graphs_report(graphs)
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return report
