"""TTFT and fidelity of the prefill modes on Musique (the CacheBlend paper's subset).

    python -m kvservice.bench --data ../shared/data/musique_dev.json --examples 10 \\
        --passages 6 --modes full,prefix,reuse,blend --ratio 0.15 --json out.json

Per example: the passages' KV is precomputed (after the prompt head) before any timing and
held in CPU memory; then each mode prefills the same prompt and picks its first token (TTFT),
HF ``transformers`` prefills it too (``hf_full``), and fidelity to ``full`` is measured:

* ``tf_agreement`` / ``tf_kl``: the first 16 tokens of the ``full`` answer are fed after the
  mode's prefill; top-1 agreement with ``full`` and mean KL(mode || full) per position;
* ``fidelity_f1`` / ``gold_f1``: token F1 of the mode's free-running greedy answer against
  the ``full`` answer and against the gold answers.

``--first``/``--examples`` pick the examples (the blend defaults were tuned on 10-29);
``--blend NAME=VALUE`` passes a ``blend_prefill`` setting (e.g. ``smooth_window=1``) to
compare selections on the same prompts.

Storage tiers plug in through ``chunk_sources`` (the store replaces it: ``--tier``, pipelining).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import platform
import re
import statistics
import string
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from kvservice.blend import MODES, BlendResult, Mode, blend_prefill
from kvservice.bundled import default_cache_dir, resolve_llm_path
from kvservice.chunk import ChunkKV, LayeredKV
from kvservice.model import Transformer, precompute_chunks, precompute_head
from kvservice.prompt import PromptFormat
from kvservice.store.benchio import TIERS, store_bench

SYSTEM_PROMPT = "You are a helpful assistant. Answer questions using the given passages."
INSTRUCTION = (
    "You will be asked a question after reading several passages. Please directly answer the "
    "question based on the given passages. Do NOT repeat the question. The answer should be "
    "within 5 words.\nPassages:\n"
)
QUESTION_PREFIX = (
    "Answer the question directly based on the given passages. Do NOT repeat the question. "
    "The answer should be within 5 words.\nQuestion: "
)
TF_TOKENS = 16


# --------------------------------------------------------------------------------------------
# Hooks and metrics


def chunk_sources(
    chunks: Sequence[ChunkKV], args: argparse.Namespace, mode: str = "blend"
) -> list[LayeredKV | None]:
    """Where the blender reads chunk KV from: the store's loader over the tier the chunks
    were staged in (``--tier cpu|disk|s3``), layer by layer, prefetching unless
    ``--no-pipeline``."""
    return store_bench(args.tier, not args.no_pipeline).sources(chunks, mode)


def _normalize(text: str) -> list[str]:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = _normalize(prediction), _normalize(reference)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------------------------
# One example


@torch.no_grad()
def _teacher_forced_logits(
    model: Transformer, result: BlendResult, answer: list[int]
) -> torch.Tensor:
    """Next-token logits ``[len(answer), V]`` after the prefill, fed ``answer`` token by token
    (one forward). The cache is rolled back afterwards."""
    n = result.num_tokens
    fed = torch.tensor([answer[:-1]], device=model.device)
    positions = torch.arange(n, n + fed.shape[1], device=model.device)[None]
    later, _ = (
        model(fed, positions, result.cache, all_logits=True) if fed.shape[1] else (None, None)
    )
    result.cache.truncate(n)
    first = result.logits[None]
    return first if later is None else torch.cat([first, later[0]])


@torch.no_grad()
def _greedy(model: Transformer, result: BlendResult, max_new: int, stop_ids: set[int]) -> list[int]:
    """Free-running greedy answer from the prefill (the cache is rolled back afterwards)."""
    n, logits, out = result.num_tokens, result.logits, []
    for step in range(max_new):
        token = int(logits.argmax())
        if token in stop_ids:
            break
        out.append(token)
        logits, _ = model(
            torch.tensor([[token]], device=model.device),
            torch.tensor([[n + step]], device=model.device),
            result.cache,
        )
        logits = logits[0]
    result.cache.truncate(n)
    return out


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run_example(model, hf_model, tokenizer, fmt, example, args, stop_ids) -> dict:
    passages = example["ctxs"][: args.passages]
    texts = [f"{p['title']}\n{p['text']}" if p.get("title") else p["text"] for p in passages]
    prompt = fmt.build(texts, example["question"])
    head_kv = precompute_head(model, prompt.head_ids)
    chunks = precompute_chunks(model, prompt.head_ids, prompt.chunk_ids)
    store_bench(args.tier, not args.no_pipeline).stage(chunks)  # before any timing
    extra = TF_TOKENS + args.max_new_tokens
    modes: list[Mode] = args.modes

    def prefill(mode: Mode) -> BlendResult:
        result = blend_prefill(
            model,
            prompt.head_ids,
            chunk_sources(chunks, args, mode),
            prompt.question_ids,
            mode=mode,
            recompute_ratio=args.ratio,
            chunk_ids=prompt.chunk_ids,
            head_kv=head_kv,
            extra_capacity=extra,
            **args.blend,
        )
        int(result.logits.argmax())  # the first token: TTFT ends here
        return result

    # Timed runs, the modes interleaved so that load from other processes hits all alike.
    ttft: dict[str, list[float]] = {m: [] for m in [*modes, "hf_full"]}
    results: dict[str, BlendResult] = {}
    ids = torch.tensor([prompt.token_ids])
    for _ in range(args.repeats):
        for mode in modes:
            results[mode], seconds = _timed(lambda mode=mode: prefill(mode))
            ttft[mode].append(seconds)
        if hf_model is not None:
            _, seconds = _timed(lambda: int(hf_model(ids, logits_to_keep=1).logits[0, -1].argmax()))
            ttft["hf_full"].append(seconds)

    full = results["full"] if "full" in results else prefill("full")
    full_answer = _greedy(model, full, args.max_new_tokens, stop_ids)
    tf_answer = (full_answer + [next(iter(stop_ids))])[:TF_TOKENS]
    full_tf = torch.log_softmax(_teacher_forced_logits(model, full, tf_answer), dim=-1)
    full_text = tokenizer.decode(full_answer, skip_special_tokens=True)
    row: dict = {"num_tokens": full.num_tokens, "full_answer": full_text, "modes": {}}
    for mode in modes:
        result = results[mode]
        logp = torch.log_softmax(_teacher_forced_logits(model, result, tf_answer), dim=-1)
        agreement = (logp.argmax(-1) == full_tf.argmax(-1)).float().mean().item()
        kl = (logp.exp() * (logp - full_tf)).sum(-1).mean().item()
        answer = tokenizer.decode(
            _greedy(model, result, args.max_new_tokens, stop_ids), skip_special_tokens=True
        )
        row["modes"][mode] = {
            "ttft_s": statistics.median(ttft[mode]),
            "tf_agreement": agreement,
            "tf_kl": max(kl, 0.0),
            "fidelity_f1": token_f1(answer, full_text),
            "gold_f1": max(token_f1(answer, gold) for gold in example["answers"]),
            "answer": answer,
            "recompute_ratio": result.recompute_ratio_effective,
            **store_bench(args.tier, not args.no_pipeline).report(
                mode,
                prompt_tokens=full.num_tokens,
                num_layers=model.config.n_layers,
                full_ttft_s=statistics.median(ttft["full"]) if ttft.get("full") else None,
            ),
        }
    if ttft["hf_full"]:
        row["hf_full"] = {"ttft_s": statistics.median(ttft["hf_full"])}
    return row


# --------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvservice.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--examples", type=int, default=10)
    parser.add_argument("--first", type=int, default=0, help="index of the first example")
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--modes", default="full,prefix,reuse,blend")
    parser.add_argument("--ratio", type=float, default=0.15, help="blend recompute ratio")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--model-path", default=os.environ.get("MODEL_PATH"), help="HF checkpoint dir"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed prefills per mode and example"
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--tier", choices=TIERS, default="cpu", help="where chunk KV starts")
    parser.add_argument("--no-pipeline", action="store_true", help="load all KV, then compute")
    parser.add_argument(
        "--engine", choices=("native", "vllm"), default="native",
        help="vllm: the same modes through vLLM with the Ragblend KV connector (kvservice.vllm)",
    )  # fmt: skip
    parser.add_argument(
        "--blend", action="append", default=[], metavar="NAME=VALUE",
        help="a blend_prefill setting for every mode, e.g. smooth_window=1 (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    try:
        args.blend = blend_settings(args.blend)
    except ValueError as err:
        parser.error(str(err))
    if args.blend and args.engine != "native":
        parser.error("--blend applies to the native engine only")
    return args


# Settings of blend_prefill that the bench sets itself and --blend may not.
_BENCH_OWNED = {"model", "head_ids", "chunks", "question_ids", "mode", "recompute_ratio",
                "chunk_ids", "head_kv", "extra_capacity"}  # fmt: skip


def blend_settings(pairs: Sequence[str]) -> dict:
    """``["smooth_window=1", "measure=kv"]`` -> keyword arguments of ``blend_prefill``, values
    read as Python literals (numbers, True/False), else kept as text."""
    known = set(inspect.signature(blend_prefill).parameters) - _BENCH_OWNED
    settings = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in known:
            raise ValueError(f"--blend {pair!r}: expected NAME=VALUE, NAME one of {sorted(known)}")
        try:
            settings[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            settings[name] = text
    return settings


def summarize(rows: list[dict], modes: Sequence[str]) -> dict:
    summary: dict = {"modes": {}}
    full_ttft = (
        statistics.median(r["modes"]["full"]["ttft_s"] for r in rows) if "full" in modes else None
    )
    for mode in modes:
        values = [r["modes"][mode] for r in rows]
        ttft = statistics.median(v["ttft_s"] for v in values)
        summary["modes"][mode] = {
            "ttft_median_s": ttft,
            "ttft_ratio_to_full": ttft / full_ttft if full_ttft else None,
            "tf_agreement": statistics.fmean(v["tf_agreement"] for v in values),
            "tf_kl": statistics.fmean(v["tf_kl"] for v in values),
            "fidelity_f1": statistics.fmean(v["fidelity_f1"] for v in values),
            "gold_f1": statistics.fmean(v["gold_f1"] for v in values),
            "recompute_ratio": statistics.fmean(v["recompute_ratio"] for v in values),
            **_store_means(values),
        }
    hf = [r["hf_full"]["ttft_s"] for r in rows if "hf_full" in r]
    summary["hf_full"] = {"ttft_median_s": statistics.median(hf) if hf else None}
    return summary


def _store_means(values: list[dict]) -> dict:
    """Per-mode means of the store's numbers (None where the mode read no cached KV)."""
    out = {}
    for name in ("load_s", "hidden_load_fraction", "ratio_chosen"):
        known = [v[name] for v in values if v.get(name) is not None]
        out[name] = statistics.fmean(known) if known else None
    return out


def print_table(summary: dict) -> None:
    header = (
        f"{'mode':8} {'TTFT s':>8} {'x full':>7} {'speedup':>8} {'tf_agree':>9} {'tf_kl':>7} "
        f"{'fid_F1':>7} {'gold_F1':>8}"
    )
    print(header)
    print("-" * len(header))
    for mode, m in summary["modes"].items():
        ratio = m["ttft_ratio_to_full"]
        speedup = f"{1 / ratio:7.2f}x" if ratio else "     n/a"
        print(
            f"{mode:8} {m['ttft_median_s']:8.3f} {ratio or float('nan'):7.3f} {speedup:>8} "
            f"{m['tf_agreement']:9.3f} {m['tf_kl']:7.4f} {m['fidelity_f1']:7.3f} "
            f"{m['gold_f1']:8.3f}"
        )
    hf = summary["hf_full"]["ttft_median_s"]
    if hf is not None:
        full = summary["modes"].get("full", {}).get("ttft_median_s")
        vs = f" (our full / hf_full = {full / hf:.3f})" if full else ""
        print(f"{'hf_full':8} {hf:8.3f}{vs}")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.engine == "vllm":
        from kvservice.vllm.bench import main as vllm_main

        return vllm_main(args)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_llm_path(args.model_path, default_cache_dir())
    model = Transformer.from_pretrained(model_dir, device="cpu", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_model = None
    if not args.no_hf:
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    fmt = PromptFormat(tokenizer, SYSTEM_PROMPT, INSTRUCTION, QUESTION_PREFIX)
    stop_ids = {tokenizer.eos_token_id} | {tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None}
    stop_ids = {t for t in stop_ids if isinstance(t, int) and t != tokenizer.unk_token_id}
    examples = json.loads(args.data.read_text())[args.first : args.first + args.examples]
    load_before = os.getloadavg()
    rows: list[dict] = []

    def env() -> dict:
        return _env(args, model, model_dir, rows, load_before)

    with torch.no_grad():
        for index, example in enumerate(examples):
            row = run_example(model, hf_model, tokenizer, fmt, example, args, stop_ids)
            rows.append(row)
            brief = "  ".join(
                f"{m}={v['ttft_s']:.2f}s/{v['tf_agreement']:.2f}/{v['tf_kl']:.3f}"
                for m, v in row["modes"].items()
            )
            hf = f"  hf_full={row['hf_full']['ttft_s']:.2f}s" if "hf_full" in row else ""
            print(
                f"[{index + 1}/{len(examples)}] {row['num_tokens']} tokens  {brief}{hf}", flush=True
            )
            if args.json:  # a partial summary after every example, in case of interruption
                partial = {**summarize(rows, args.modes), "env": env(), "examples": rows}
                args.json.write_text(json.dumps(partial, indent=2))
    summary = {**summarize(rows, args.modes), "env": env(), "examples": rows}
    print_table(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return summary


def _env(args, model, model_dir, rows, load_before) -> dict:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "model": str(model_dir),
        "model_fingerprint": model.fingerprint,
        "dtype": "float32",
        "examples": len(rows),
        "first_example": args.first,
        "passages": args.passages,
        "ratio": args.ratio,
        "blend_settings": args.blend,
        "tier": args.tier,
        "pipeline": not args.no_pipeline,
        "mean_prompt_tokens": statistics.fmean(r["num_tokens"] for r in rows),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),  # other processes share these cores
    }


if __name__ == "__main__":
    main()
