"""TTFT of the prefill modes with vLLM as the engine, beside the native engine, same run.

    python -m kvservice.bench --data ../shared/data/musique_dev.json --examples 3 \\
        --passages 6 --modes full,blend --engine vllm --json vllm.json

Per example the passages' KV is precomputed by the native model (after the bench's prompt
head) and put in a disk-tier store in a temporary directory, which vLLM's connector opens
too. Then, per mode:

* ``native``: one request through the native ``Engine`` with ``max_tokens=1``, submit to first
  token (its batcher thread runs ``blend_prefill``, as in the inference worker), chunk KV
  already in memory (as the native bench's ``--tier cpu``), all examples before vLLM starts;
* ``vllm``: one request through ``VllmEngine`` with ``max_tokens=1``, timed from submit to
  the first token in the caller's thread (so it includes vLLM's process hops and, for
  ``reuse``/``blend``, the connector's store read and blend in vLLM's worker). An untimed
  ``reuse`` request per example first brings that example's chunks into the worker's
  memory tier, so both engines read KV from memory.

Then each engine's greedy answer (``--max-new-tokens``) per mode, to report whether the two
engines agree token for token, and each engine's decode rate on it (tokens after the first,
per second after the first). TTFT ratios are to vLLM's own ``full`` of the same prompt,
for both engines: what a user who would otherwise run vLLM waits for (issue #30: blend at
least 3x lower, native full within 1.25x of it). ``--precision``/``--kernel`` set the native
engine's products (``kvservice.model.kernels``); vLLM runs its own (float32 on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from bench.data import passage_texts
from bench.prefill import INSTRUCTION, QUESTION_PREFIX, SYSTEM_PROMPT
from bench.timing import cpu_name
from kvservice.model.bundled import resolve_llm_path
from kvservice.model.producer import KVProducer
from kvservice.model.sampling import SamplingParams
from kvservice.model.transformer import Transformer
from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.models import default_cache_dir
from kvservice.protocol.prompt import Prompt, PromptFormat, preamble_passages
from kvservice.serve.engine import Engine, Request
from kvservice.store import StoreConfig, TieredStore
from kvservice.store.compute_threads import run_in_passing_thread, single_threaded


def _prompts(args: argparse.Namespace, fmt: PromptFormat) -> list[Prompt]:
    """The bench's prompts: the first ``--passages`` passages and the question of each."""
    examples = json.loads(args.data.read_text())[args.first : args.first + args.examples]
    return [fmt.build(passage_texts(e, args.passages), e["question"]) for e in examples]


def main(args: argparse.Namespace) -> dict:
    """Run the bench (``args`` as parsed by ``bench.prefill.parse_args``)."""
    from kvservice.vllm.engine import VllmEngine, VllmRequest, VllmSettings

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = resolve_llm_path(args.model_path, default_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    preamble = preamble_passages() if args.kv_preamble == "on" else ()
    fmt = PromptFormat(tokenizer, SYSTEM_PROMPT, INSTRUCTION, QUESTION_PREFIX, preamble=preamble)
    prompts = _prompts(args, fmt)
    store_config = StoreConfig(disk_dir=tempfile.mkdtemp(prefix="ragblend-vllm-bench-"))
    store = TieredStore.from_config(store_config)

    def set_up() -> Transformer:  # before any timing, and before vLLM takes its memory
        model = Transformer.from_pretrained(
            model_dir,
            device="cpu",
            dtype=torch.float32,
            precision=args.precision,
            kernel=args.kernel,
        )
        producer = KVProducer(model, fmt.storage_ids)
        for prompt in prompts:
            for chunk in producer.compute(prompt.chunk_ids):
                store.put(chunk, tiers=["disk"])
        return model

    # As the inference worker does: only the batcher thread keeps an OpenMP team.
    model = run_in_passing_thread(set_up)
    single_threaded()
    print(model.kernel_choice.describe(), flush=True)
    load_before = os.getloadavg()
    native = Engine(model, tokenizer, fmt, threads=args.threads)
    one = SamplingParams(max_tokens=1)
    answer = SamplingParams(max_tokens=args.max_new_tokens)
    keys = [
        [
            ChunkKey.for_tokens(model.fingerprint, fmt.head_hash, ids).to_string()
            for ids in prompt.chunk_ids
        ]
        for prompt in prompts
    ]

    # 1. The native engine, before vLLM starts (its idle worker threads would share the cores).
    rows: list[dict[str, Any]] = []
    native.generate(Request(prompts[0], [None] * len(prompts[0].chunk_ids), sampling=one))
    for prompt, prompt_keys in zip(prompts, keys, strict=True):
        cached = [store.get(ChunkKey.from_string(key)) for key in prompt_keys]  # in memory
        row: dict[str, Any] = {"num_tokens": len(prompt.token_ids), "modes": {}}
        for mode in args.modes:
            # Through the engine, as the worker runs it (its batcher thread), submit to first
            # token: the same span as vLLM's below.
            timed = Request(prompt, cached, mode=mode, recompute_ratio=args.ratio, sampling=one)
            seconds = [native.generate(timed).ttft_s for _ in range(args.repeats)]
            request = Request(
                prompt, cached, mode=mode, recompute_ratio=args.ratio, sampling=answer
            )
            ids, tokens_per_s = _answer(native.generate, request)
            row["modes"][mode] = {
                "native_ttft_s": statistics.median(seconds),
                "native_ids": ids,
                "native_decode_tokens_per_s": tokens_per_s,
            }
        rows.append(row)
        print(
            f"native {row['num_tokens']} tokens: "
            + "  ".join(f"{m} {v['native_ttft_s']:.2f}s" for m, v in row["modes"].items()),
            flush=True,
        )

    # 2. The same prompts through vLLM.
    engine = VllmEngine(
        model_dir,
        store_config=store_config,
        prompt_format=fmt,
        settings=VllmSettings(max_num_seqs=4, max_model_len=4096),
    )
    print(f"vLLM started in {engine.start_s:.1f} s; blender: {engine.attach_info}", flush=True)
    engine.generate(VllmRequest(prompts[0], mode="full", sampling=one))  # warm-up
    try:
        for index, (prompt, prompt_keys, row) in enumerate(zip(prompts, keys, rows, strict=True)):
            # Untimed: the worker's memory tier now holds this prompt's chunks.
            engine.generate(VllmRequest(prompt, mode="reuse", chunk_keys=prompt_keys, sampling=one))
            for mode in args.modes:
                seconds = []
                for _ in range(args.repeats):
                    request = VllmRequest(
                        prompt,
                        mode=mode,
                        chunk_keys=prompt_keys,
                        recompute_ratio=args.ratio,
                        sampling=one,
                    )
                    seconds.append(engine.generate(request).ttft_s)
                request = VllmRequest(
                    prompt,
                    mode=mode,
                    chunk_keys=prompt_keys,
                    recompute_ratio=args.ratio,
                    sampling=answer,
                )
                ids, tokens_per_s = _answer(engine.generate, request)
                entry = row["modes"][mode]
                native_ids = entry.pop("native_ids")
                entry.update(
                    vllm_ttft_s=statistics.median(seconds),
                    vllm_decode_tokens_per_s=tokens_per_s,
                    same_tokens=native_ids == ids,
                    native_answer=tokenizer.decode(native_ids, skip_special_tokens=True),
                    vllm_answer=tokenizer.decode(ids, skip_special_tokens=True),
                )
            brief = "  ".join(
                f"{m}: native {v['native_ttft_s']:.2f}s vllm {v['vllm_ttft_s']:.2f}s "
                f"same={v['same_tokens']}"
                for m, v in row["modes"].items()
            )
            print(f"[{index + 1}/{len(prompts)}] {row['num_tokens']} tokens  {brief}", flush=True)
        stats = engine.connector_stats()
    finally:
        engine.close()
    summary = _summarize(rows, args.modes)
    summary["env"] = {
        "engine": "vllm",
        "torch": torch.__version__,
        "threads": args.threads,
        "kernels": model.kernel_choice.to_dict(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "model": str(model_dir),
        "examples": len(rows),
        "passages": args.passages,
        "ratio": args.ratio,
        "repeats": args.repeats,
        "vllm_start_s": engine.start_s,
        "blender": engine.attach_info,
        "connector": stats,
        "mean_prompt_tokens": statistics.fmean(r["num_tokens"] for r in rows),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),  # other processes share these cores
    }
    summary["examples"] = rows
    _print_table(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return summary


def _summarize(rows: list[dict], modes: list[str]) -> dict:
    """Per mode the TTFT medians and the speedups (per example, then the median) against
    the native engine's own full prefill and against vLLM's, the reference users compare."""
    out: dict[str, Any] = {"modes": {}}
    if "full" in modes:
        native_full = [r["modes"]["full"]["native_ttft_s"] for r in rows]
        vllm_full = [r["modes"]["full"]["vllm_ttft_s"] for r in rows]
    for mode in modes:
        values = [r["modes"][mode] for r in rows]
        entry = {
            "native_ttft_median_s": statistics.median(v["native_ttft_s"] for v in values),
            "vllm_ttft_median_s": statistics.median(v["vllm_ttft_s"] for v in values),
            "native_speedup_vs_native_full": None,
            "native_speedup_vs_vllm_full": None,
            "vllm_speedup_vs_vllm_full": None,
            "same_tokens_share": statistics.fmean(float(v["same_tokens"]) for v in values),
            "native_decode_tokens_per_s": _median_of(values, "native_decode_tokens_per_s"),
            "vllm_decode_tokens_per_s": _median_of(values, "vllm_decode_tokens_per_s"),
        }
        if "full" in modes:
            entry["native_speedup_vs_native_full"] = _speedup(native_full, values, "native")
            entry["native_speedup_vs_vllm_full"] = _speedup(vllm_full, values, "native")
            entry["vllm_speedup_vs_vllm_full"] = _speedup(vllm_full, values, "vllm")
        out["modes"][mode] = entry
    return out


def _speedup(full_s: list[float], values: list[dict], engine: str) -> float:
    """Median over the examples of a full prefill's TTFT over ``engine``'s in this mode."""
    key = f"{engine}_ttft_s"
    return statistics.median(full / v[key] for full, v in zip(full_s, values, strict=True))


def _answer(generate, request) -> tuple[list[int], float | None]:
    """The answer's token ids and its decode rate: tokens after the first per second after
    the first (None for an answer of one token)."""
    start = time.perf_counter()
    completion = generate(request)
    decode_s = time.perf_counter() - start - completion.ttft_s
    count = len(completion.token_ids)
    return completion.token_ids, (count - 1) / decode_s if count > 1 and decode_s > 0 else None


def _median_of(values: list[dict], key: str) -> float | None:
    present = [v[key] for v in values if v.get(key) is not None]
    return statistics.median(present) if present else None


def _print_table(summary: dict) -> None:
    """TTFT medians; each engine's speedup against vLLM's full prefill of the same prompt;
    decode rates; whether the engines' greedy answers agree."""
    header = (
        f"{'mode':8} {'native s':>9} {'vllm s':>8} {'own full/native':>16} "
        f"{'vllm full/native':>17} "
        f"{'vllm full/vllm':>15} {'decode tok/s n|v':>17} {'same tokens':>12}"
    )
    print(header)
    print("-" * len(header))

    def times(value: float | None) -> str:
        return f"{value:.2f}x" if value else "n/a"

    def rate(value: float | None) -> str:
        return f"{value:.1f}" if value else "-"

    for mode, m in summary["modes"].items():
        decode = f"{rate(m['native_decode_tokens_per_s'])}|{rate(m['vllm_decode_tokens_per_s'])}"
        print(
            f"{mode:8} {m['native_ttft_median_s']:9.3f} {m['vllm_ttft_median_s']:8.3f} "
            f"{times(m['native_speedup_vs_native_full']):>16} "
            f"{times(m['native_speedup_vs_vllm_full']):>17} "
            f"{times(m['vllm_speedup_vs_vllm_full']):>15} {decode:>17} "
            f"{m['same_tokens_share']:12.2f}"
        )
