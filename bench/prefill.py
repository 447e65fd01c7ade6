"""TTFT and fidelity of the prefill modes on Musique (the CacheBlend paper's subset).

    python -m kvservice.bench --data ../shared/data/musique_dev.json --examples 10 \\
        --passages 6 --modes full,prefix,reuse,blend --ratio 0.15 --json out.json

Per example: the passages' KV is precomputed (after the prompt head) before any timing and
held in CPU memory; then each mode prefills the same prompt and picks its first token (TTFT),
HF ``transformers`` prefills it too (``hf_full``), and fidelity to ``full`` is measured:

* ``tf_agreement`` / ``tf_kl``: the first 16 tokens of the ``full`` answer are fed after the
  mode's prefill; top-1 agreement with ``full`` and mean KL(mode || full) per position;
* ``tf_logprob_gap``: the ``full`` answer up to 32 tokens (through its stop token) fed the
  same way; the mean of ``log p_full(token) - log p_mode(token)`` over its tokens (how much
  less likely the mode finds full's own answer, further into the answer than ``tf_kl``);
* ``fidelity_f1`` / ``gold_f1``: token F1 of the mode's free-running greedy answer against
  the ``full`` answer and against the gold answers.

The summary gives each mode's ``tf_kl`` as a distribution (mean with a bootstrap 95 %
interval, median, p90) and counts the examples where it is worse or better than ``reuse``'s
on the same prompt: a mean can hide a few prompts that blend gets badly wrong.

``--ratios 0.05,0.10,...`` also runs blend at each ratio (run keys ``blend@0.05``) and adds
the ``curve`` users choose a ratio from: TTFT relative to full against fidelity, for full,
reuse and each blend ratio; ``--plot curve.svg`` draws it (``webapp.dashboard.curve_chart``,
which the dashboard draws it with too).

``--first``/``--examples`` pick the examples: the blend defaults were tuned on 0-19 and are
reported on 20-39; ``--blend NAME=VALUE`` passes a ``blend_prefill`` setting (e.g.
``attention_from_depth=0.5``) to compare selections on the same prompts.

Storage tiers plug in through ``chunk_sources`` (``bench.staging``: ``--tier``, pipelining).

``--device cuda`` and ``--dtype float32|bfloat16|float16`` place the model (float32 on CPU,
bfloat16 on CUDA by default). ``--synthetic llama3-8b`` runs the long-context benchmark on a
random-weight model of that shape instead of Musique (``bench.long_context``); ``--engine vllm``
runs the prompts through vLLM beside the native engine (``bench.prefill_vllm``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from bench.data import passage_texts
from bench.fidelity import (
    greedy_answer,
    progressive_greedy,
    progressive_logits,
    teacher_forced_fidelity,
    teacher_forced_logits,
    without_stop,
)
from bench.opcount import count_ops
from bench.staging import TIERS, after_full, bench_of, parse_link_rate
from bench.stats import bootstrap_ci, quantile
from bench.timing import cpu_name, timed
from kvservice.blend.prefill import MODES, BlendResult, BlendSettings, Mode, blend_prefill, refresh
from kvservice.chunk import ChunkKV, LayeredKV
from kvservice.model.bundled import resolve_llm_path
from kvservice.model.kernels import DEFAULT_PRECISION, KERNELS, PRECISIONS
from kvservice.model.producer import KVProducer
from kvservice.model.transformer import Transformer
from kvservice.protocol.models import default_cache_dir
from kvservice.protocol.prompt import Prompt, PromptFormat, preamble_from_env, preamble_passages
from kvservice.protocol.ratio import DEFAULT_RECOMPUTE_RATIO
from kvservice.serve.engine import stop_token_ids
from kvservice.store.config import StoreConfig
from kvservice.tools.synthetic import SYNTHETIC_CONFIGS
from webapp.dashboard.curve_chart import ratio_curve_svg
from webapp.dashboard.fidelity import token_f1

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
TF_TOKENS = 16  # tf_kl / tf_agreement: the first 16 tokens of full's answer
GAP_TOKENS = 32  # tf_logprob_gap: up to 32 tokens of full's answer, through its stop token
BETTER_OR_WORSE = 1e-4  # a tf_kl difference to reuse's smaller than this counts as a tie

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------
# Hooks and metrics


def chunk_sources(
    chunks: Sequence[ChunkKV],
    args: argparse.Namespace,
    mode: str = "blend",
    key: str | None = None,
    ratio: float = 0.0,
) -> list[LayeredKV | None]:
    """Where the blender reads chunk KV from: the store's loader over the tier the chunks
    were staged in (``--tier cpu|disk|s3``, S3 throttled by ``--s3-mbps``), layer by layer,
    prefetching unless ``--no-pipeline``. The loads are reported under the run ``key``
    (``blend@0.05``)."""
    tier = args.run_tiers.get(key, args.tier)
    ratio = ratio if mode == "blend" else 0.0
    return bench_of(args, tier).sources(chunks, mode, key=key, ratio=ratio)


# --------------------------------------------------------------------------------------------
# One example


def example_prompt(fmt: PromptFormat, example: dict, passages: int) -> Prompt:
    """A Musique example's prompt: its first ``passages`` passages as chunks, its question."""
    return fmt.build(passage_texts(example, passages), example["question"])


def run_example(model, hf_model, tokenizer, fmt, example, args, stop_ids) -> dict:
    """One Musique example: every run of ``args.plan`` timed (:func:`_timed_runs`), then
    each one's fidelity to full prefill's answer (:func:`_mode_row`)."""
    prompt = example_prompt(fmt, example, args.passages)
    producer = KVProducer(model, fmt.storage_ids)  # --kv-preamble
    chunks = producer.compute(prompt.chunk_ids)
    texts = [text + fmt.chunk_separator for text in passage_texts(example, args.passages)]
    for tier in {args.tier, *args.run_tiers.values()}:  # before any timing
        bench_of(args, tier).stage(chunks, texts=texts, head=fmt.head_text)
    prefill = _Prefill(model, prompt, producer.heads.get(prompt.head_ids), chunks, args)
    timings = _timed_runs(model, hf_model, prompt, prefill, args)
    full = timings.results["full"] if "full" in timings.results else prefill("full", "full")
    reference = _Reference.of(model, tokenizer, full, args, stop_ids)
    row: dict = {"num_tokens": full.num_tokens, "full_answer": reference.text, "modes": {}}
    for key, (mode, ratio) in args.plan.items():
        row["modes"][key] = _mode_row(
            key, prefill, timings, reference, tokenizer, example, stop_ids
        )
        # Counted on an untimed run of its own (the profiler slows what it watches).
        run = functools.partial(prefill, f"{key}/ops", mode, ratio)
        ops = count_ops(run, model.config.n_layers)
        row["modes"][key]["ops_per_layer"] = ops.per_layer
        row["modes"][key]["ops_top"] = dict(ops.top())
    if timings.ttft["hf_full"]:
        row["hf_full"] = {"ttft_s": statistics.median(timings.ttft["hf_full"])}
    return row


@dataclasses.dataclass
class _Prefill:
    """A run's prefill of one prompt, its chunks read as ``chunk_sources`` gives them (from
    the run's tier), up to the first token (where TTFT ends), with room after the prompt for
    the longest greedy or teacher-forced answer (each is rolled back before the next)."""

    model: Transformer
    prompt: Prompt
    head_kv: ChunkKV
    chunks: list[ChunkKV]
    args: argparse.Namespace

    def __call__(self, key: str, mode: Mode, ratio: float | None = None, sources=None):
        args, prompt = self.args, self.prompt
        ratio = args.ratio if ratio is None else ratio
        result = blend_prefill(
            self.model,
            prompt.head_ids,
            chunk_sources(self.chunks, args, mode, key, ratio) if sources is None else sources,
            prompt.question_ids,
            mode=mode,
            recompute_ratio=ratio,
            chunk_ids=prompt.chunk_ids,
            head_kv=self.head_kv,
            extra_capacity=max(args.max_new_tokens, GAP_TOKENS),
            settings=BlendSettings(**args.blend),
        )
        int(result.logits.argmax())  # the first token: TTFT ends here
        return result

    def in_memory(self) -> tuple[float, int]:
        """Blend with every chunk's KV in memory: what the loading controller prices blend's
        compute by (``--s3-mbps``; not a result)."""
        result, seconds = timed(
            lambda: self("blend", "blend", self.args.ratio, list(self.chunks)), self.model.device
        )
        return seconds, sum(result.recomputed_per_layer)


@dataclasses.dataclass
class _Timings:
    ttft: dict[str, list[float]]  # run key (and hf_full) -> TTFT of each repeat
    second: dict[str, list[float]]  # progressive runs: time to the second token's logits
    results: dict[str, BlendResult]  # run key -> its last timed prefill


def _timed_runs(model, hf_model, prompt: Prompt, prefill: _Prefill, args) -> _Timings:
    """Every run of the plan ``--repeats`` times, the modes interleaved so that load from
    other processes hits all alike; the store's controller learns from each (and, with
    ``--s3-mbps``, the throttled link is set after full's first run)."""
    timings = _Timings({key: [] for key in [*args.plan, "hf_full"]}, {}, {})
    ttft, results = timings.ttft, timings.results
    ids = torch.tensor([prompt.token_ids], device=model.device)
    for _ in range(args.repeats):
        for key, (mode, ratio) in args.plan.items():
            results[key], seconds = timed(
                lambda key=key, mode=mode, ratio=ratio: prefill(key, mode, ratio), model.device
            )
            ttft[key].append(seconds)
            if key in args.refresh_keys:  # progressive: the second token's logits come next
                first = [int(results[key].logits.argmax())]
                _, more = timed(
                    lambda key=key, first=first: refresh(
                        model, results[key], first, args.refresh_keys[key]
                    ),
                    model.device,
                )
                timings.second.setdefault(key, []).append(seconds + more)
            if (tier := args.run_tiers.get(key, args.tier)) != "kdn":  # the controller learns
                bench_of(args, tier).observe_run(key, seconds)  # from each timed run
            if key == "full" and len(ttft[key]) == 1:  # --s3-mbps: the link follows full
                for tier in {args.tier, *args.run_tiers.values()}:
                    after_full(
                        args,
                        tier,
                        prompt_tokens=len(prompt.token_ids),
                        num_layers=model.config.n_layers,
                        seconds=seconds,
                        blend_in_memory=prefill.in_memory,
                    )
        if hf_model is not None:
            _, seconds = timed(
                lambda: int(hf_model(ids, logits_to_keep=1).logits[0, -1].argmax()), model.device
            )
            ttft["hf_full"].append(seconds)
    return timings


@dataclasses.dataclass
class _Reference:
    """Full prefill's answer, what every run is measured against."""

    forced: list[int]  # the tokens teacher-forced (GAP_TOKENS of the greedy answer)
    positions: int  # how many of them tf_kl reads
    logits: torch.Tensor  # full's teacher-forced logits
    text: str  # full's answer cut at --max-new-tokens
    num_tokens: int

    @classmethod
    def of(cls, model, tokenizer, full: BlendResult, args, stop_ids) -> _Reference:
        # Full's greedy answer, long enough for both teacher-forced windows: tf_kl's is the
        # first TF_TOKENS positions of the answer cut at --max-new-tokens then a stop token,
        # as before tf_logprob_gap existed; the logits there depend only on the tokens fed,
        # which are the first tokens of the gap's answer, so one forward serves both.
        answer_ids = greedy_answer(model, full, max(args.max_new_tokens, GAP_TOKENS), stop_ids)
        answer = without_stop(answer_ids, stop_ids)[: args.max_new_tokens]
        forced = answer_ids[:GAP_TOKENS]
        return cls(
            forced=forced,
            positions=min(len(answer) + 1, TF_TOKENS),
            logits=teacher_forced_logits(model, full, forced),
            text=tokenizer.decode(answer, skip_special_tokens=True),
            num_tokens=full.num_tokens,
        )


def _mode_row(
    key, prefill: _Prefill, timings: _Timings, reference: _Reference, tokenizer, example, stop_ids
) -> dict:
    """One run's row: its median TTFT, its teacher-forced fidelity to full and its greedy
    answer's (a progressive run's through a refresh of an untimed prefill: its timed one was
    refreshed already), and the store's numbers."""
    model, args = prefill.model, prefill.args
    mode, ratio = args.plan[key]
    result = timings.results[key]
    progressive = {}  # a progressive run's second token, and the ratio it refreshed to
    if key in args.refresh_keys:
        upgrade = args.refresh_keys[key]
        again = functools.partial(prefill, f"{key}/untimed", mode, ratio)
        logits = progressive_logits(model, again, upgrade, reference.forced, args.refresh_lag)
        greedy = progressive_greedy(model, again, upgrade, args.max_new_tokens, stop_ids)
        progressive = {
            "second_token_s": statistics.median(timings.second[key]),
            "refresh_ratio": upgrade,
        }
    else:
        logits = teacher_forced_logits(model, result, reference.forced)
        greedy = greedy_answer(model, result, args.max_new_tokens, stop_ids)
    fidelity = teacher_forced_fidelity(
        logits, reference.logits, reference.forced, reference.positions
    )
    answer = tokenizer.decode(without_stop(greedy, stop_ids), skip_special_tokens=True)
    full_ttft = timings.ttft.get("full")
    return {
        "ttft_s": statistics.median(timings.ttft[key]),
        **progressive,
        **fidelity,
        "fidelity_f1": token_f1(answer, reference.text),
        "gold_f1": max(token_f1(answer, gold) for gold in example["answers"]),
        "answer": answer,
        "recompute_ratio": result.recompute_ratio_effective,
        **bench_of(args, args.run_tiers.get(key, args.tier)).report(
            key,
            prompt_tokens=reference.num_tokens,
            num_layers=model.config.n_layers,
            full_ttft_s=statistics.median(full_ttft) if full_ttft else None,
        ),
    }


# --------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvservice.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--data", type=Path, help="Musique JSON (all but --synthetic)")
    parser.add_argument("--examples", type=int, default=10)
    parser.add_argument("--first", type=int, default=0, help="index of the first example")
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--modes", default="full,prefix,reuse,blend")
    parser.add_argument(
        "--ratio", type=float, default=DEFAULT_RECOMPUTE_RATIO, help="blend recompute ratio"
    )
    parser.add_argument(
        "--ratios",
        default="",
        metavar="R1,R2,...",
        help="also run blend at each of these ratios (e.g. 0.05,0.10,0.15,0.25,0.40): the curve",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--plot", type=Path, default=None, help="draw the --ratios curve (SVG)")
    parser.add_argument(
        "--model-path", default=os.environ.get("MODEL_PATH"), help="HF checkpoint dir"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed prefills per mode and example (default 1; --synthetic: 3)",
    )
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:1")
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="the model's and the KV cache's dtype (default float32 on CPU, bfloat16 on CUDA)",
    )
    synthetic = parser.add_argument_group(
        "synthetic", "the long-context benchmark on a random-weight model (no --data)"
    )
    synthetic.add_argument("--synthetic", choices=sorted(SYNTHETIC_CONFIGS), default=None)
    synthetic.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    synthetic.add_argument("--context", type=int, default=None, help="prompt tokens (16384)")
    synthetic.add_argument("--chunks", type=int, default=None, help="equal chunks (12)")
    synthetic.add_argument("--seed", type=int, default=0, help="weights and tokens")
    synthetic.add_argument(
        "--warmup", type=int, default=1, help="untimed prefills per mode before the timed ones"
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument(
        "--kv-preamble",
        choices=("on", "off"),
        default=None,
        help="chunk KV computed after the head and the shipped retrieval preamble, as the product "
        "does with KV_PREAMBLE=on (default: KV_PREAMBLE's value, on unless set; off with kdn)",
    )
    parser.add_argument("--tier", choices=TIERS, default="cpu", help="where chunk KV starts")
    parser.add_argument(
        "--also-tiers",
        default="",
        metavar="T1,...",
        help="also run reuse/blend with the chunks starting in these tiers, interleaved with "
        "the --tier runs on the same prompts (keys blend[s3]); reports TTFT(tier)/TTFT(--tier)",
    )
    parser.add_argument("--kdn-url", default=None, help="--tier kdn: a server (else one starts)")
    parser.add_argument("--kdn-key", default=None, help="--tier kdn: an API key of that server")
    parser.add_argument("--no-pipeline", action="store_true", help="load all KV, then compute")
    parser.add_argument(
        "--s3-mbps",
        default=None,
        metavar="N|auto|4xauto",
        help="--tier s3 read through a throttling proxy at N MB/s; auto: per example, fp16 KV "
        "loads as long as full prefill took (bench.staging)",
    )
    parser.add_argument(
        "--load-all",
        action="store_true",
        help="with --s3-mbps: read every chunk (no per-chunk load-or-recompute choice)",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=DEFAULT_PRECISION,
        help="the linear layers' products (kvservice.model.kernels): auto takes bfloat16 "
        "where native",
    )
    parser.add_argument("--kernel", choices=KERNELS, default=None, help="force a linear kernel")
    parser.add_argument(
        "--engine",
        choices=("native", "vllm"),
        default="native",
        help="vllm: the same modes through vLLM with the Ragblend KV connector (kvservice.vllm)",
    )
    parser.add_argument(
        "--refresh",
        type=float,
        default=None,
        metavar="R",
        help="also run progressive blend: each blend run below R again (run key blend>R, "
        "blend@0.05>R), its cache upgraded to R after the first token "
        "(kvservice.blend.prefill.refresh)",
    )
    parser.add_argument(
        "--refresh-lag",
        type=int,
        default=1,
        metavar="N",
        help="with --refresh: the upgrade lands after N answer tokens (1: before the second; "
        "in the product the answer streams meanwhile and it lands a few tokens later)",
    )
    parser.add_argument(
        "--blend",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a blend_prefill setting for every mode, e.g. smooth_window=1 (repeatable)",
    )
    args = parser.parse_args(argv)
    _check_device_and_synthetic(parser, args)
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
    try:
        args.ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--ratios {args.ratios!r}: expected numbers like 0.05,0.15")
    if any(not 0 <= r <= 1 for r in [args.ratio, *args.ratios]):
        parser.error("recompute ratios are between 0 and 1")
    if args.ratios and args.engine != "native":
        parser.error("--ratios applies to the native engine only")
    if args.ratios and "full" not in args.modes:
        parser.error("--ratios needs full in --modes (the curve's TTFT is relative to it)")
    if args.plot and not args.ratios:
        parser.error("--plot draws the --ratios curve: give --ratios too")
    args.plan = run_plan(args.modes, args.ratio, args.ratios)
    args.refresh_keys = {}  # progressive runs: key -> the ratio their cache is upgraded to
    if args.refresh_lag < 1:
        parser.error(f"--refresh-lag {args.refresh_lag}: at least 1")
    if args.refresh is not None:
        if "blend" not in args.modes or args.engine != "native":
            parser.error("--refresh upgrades a native blend: give blend in --modes")
        if not args.ratio < args.refresh <= 1:
            parser.error(f"--refresh {args.refresh}: between --ratio ({args.ratio}) and 1")
        progressive = progressive_plan(args.plan, args.refresh)
        args.plan.update(progressive)
        args.refresh_keys = dict.fromkeys(progressive, args.refresh)
    try:
        args.s3_link = parse_link_rate(args.s3_mbps) if args.s3_mbps else (None, None)
    except ValueError as err:
        parser.error(str(err))
    if args.s3_mbps and (args.tier != "s3" or next(iter(args.plan), None) != "full"):
        parser.error("--s3-mbps needs --tier s3 and full first in --modes (measured first)")
    also = [t.strip() for t in args.also_tiers.split(",") if t.strip() and t.strip() != args.tier]
    if any(t not in TIERS for t in also):
        parser.error(f"--also-tiers {args.also_tiers!r}: tiers are {', '.join(TIERS)}")
    if also and args.engine != "native":
        parser.error("--also-tiers applies to the native engine only")
    kdn = "kdn" in (args.tier, *also)  # a PUT computes after a head text: no preamble there
    if args.kv_preamble is None:
        args.kv_preamble = "on" if preamble_from_env(os.environ) and not kdn else "off"
    if args.kv_preamble == "on" and kdn:
        parser.error("--kv-preamble on: the kdn tier computes chunk KV after the head alone")
    args.run_tiers = {}  # run key -> the tier its chunks start in, where not --tier
    for tier in also:
        for mode in ("reuse", "blend"):
            if mode in args.modes:
                args.plan[f"{mode}[{tier}]"] = (mode, args.ratio)
                args.run_tiers[f"{mode}[{tier}]"] = tier
    return args


def _check_device_and_synthetic(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve ``--device``/``--dtype`` and the defaults that depend on ``--synthetic``."""
    try:
        args.device = torch.device(args.device)
    except RuntimeError as err:
        parser.error(f"--device {args.device!r}: {err}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    default_dtype = "bfloat16" if args.device.type == "cuda" else "float32"
    args.dtype = DTYPES[args.dtype or default_dtype]
    synthetic_only = {"--layers": args.layers, "--context": args.context, "--chunks": args.chunks}
    if args.synthetic is None:
        if args.data is None:
            parser.error("--data is required (or --synthetic NAME)")
        given = [flag for flag, value in synthetic_only.items() if value is not None]
        if given:
            parser.error(f"{', '.join(given)}: with --synthetic only")
        args.repeats = 1 if args.repeats is None else args.repeats
    else:
        if args.engine != "native":
            parser.error("--synthetic runs the native engine only")
        if args.plot:
            parser.error("--plot draws a fidelity curve: not with --synthetic (random weights)")
        args.context = 16384 if args.context is None else args.context
        args.chunks = 12 if args.chunks is None else args.chunks
        args.repeats = 3 if args.repeats is None else args.repeats
        if args.chunks < 1 or args.context < 1:
            parser.error("--context and --chunks must be positive")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats is at least 1 and --warmup at least 0")


def run_plan(
    modes: Sequence[Mode], ratio: float, ratios: Sequence[float] = ()
) -> dict[str, tuple[Mode, float]]:
    """Run key -> (mode, recompute ratio): the modes asked at ``--ratio``, then blend at each
    of ``--ratios`` under ``blend@R``, skipping a setting already run (``blend`` at ``--ratio``)."""
    plan: dict[str, tuple[Mode, float]] = {mode: (mode, ratio) for mode in modes}
    for extra in ratios:
        if ("blend", extra) not in plan.values():
            plan[f"blend@{extra:g}"] = ("blend", extra)
    return plan


def progressive_plan(
    plan: Mapping[str, tuple[Mode, float]], refresh: float
) -> dict[str, tuple[Mode, float]]:
    """The progressive runs of ``--refresh R``: each blend run of ``plan`` below ``R`` again
    under ``<key>>R`` (``blend>0.25``, ``blend@0.05>0.25``), its cache upgraded to ``R``
    after the first token."""
    return {
        f"{key}>{refresh:g}": (mode, ratio)
        for key, (mode, ratio) in plan.items()
        if mode == "blend" and ratio < refresh
    }


# Settings of blend_prefill that the bench sets itself and --blend may not.
def blend_settings(pairs: Sequence[str]) -> dict:
    """``["smooth_window=3", "attention_from_depth=0.5"]`` -> fields of ``BlendSettings``,
    values read as Python literals (numbers, True/False), else text."""
    known = {f.name for f in dataclasses.fields(BlendSettings)}
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


def summarize(
    rows: list[dict],
    plan: Mapping[str, tuple[Mode, float]],
    *,
    curve: bool = False,
    run_tiers: Mapping[str, str] | None = None,
) -> dict:
    """Per run key: TTFT medians, fidelity means and ``tf_kl``'s distribution, and against
    ``reuse`` where it ran; with ``curve``, the points of :func:`ratio_curve` (runs at
    ``--ratios``, from ``--tier``); with ``run_tiers``, :func:`tier_slowdown`."""
    run_tiers = run_tiers or {}
    summary: dict = {"modes": {}}
    full_ttft = (
        statistics.median(r["modes"]["full"]["ttft_s"] for r in rows) if "full" in plan else None
    )
    for key in plan:
        values = [r["modes"][key] for r in rows]
        ttft = statistics.median(v["ttft_s"] for v in values)
        summary["modes"][key] = {
            "ttft_median_s": ttft,
            "ttft_ratio_to_full": ttft / full_ttft if full_ttft else None,
            "tf_agreement": statistics.fmean(v["tf_agreement"] for v in values),
            **_distribution([v["tf_kl"] for v in values]),
            "tf_logprob_gap": statistics.fmean(v["tf_logprob_gap"] for v in values),
            "tf_logprob_gap_median": statistics.median(v["tf_logprob_gap"] for v in values),
            **(_against_reuse(rows, key) if "reuse" in plan else {}),
            "fidelity_f1": statistics.fmean(v["fidelity_f1"] for v in values),
            "gold_f1": statistics.fmean(v["gold_f1"] for v in values),
            "recompute_ratio": statistics.fmean(v["recompute_ratio"] for v in values),
            **_store_means(values),
        }
        if all("second_token_s" in v for v in values):  # progressive blend (--refresh)
            second = statistics.median(v["second_token_s"] for v in values)
            summary["modes"][key].update(
                refresh_ratio=values[0]["refresh_ratio"],
                second_token_median_s=second,
                second_token_ratio_to_full=second / full_ttft if full_ttft else None,
            )
    hf = [r["hf_full"]["ttft_s"] for r in rows if "hf_full" in r]
    summary["hf_full"] = {"ttft_median_s": statistics.median(hf) if hf else None}
    if curve:  # not another tier's runs
        points = {k: v for k, v in plan.items() if k not in run_tiers}
        summary["curve"] = ratio_curve(summary["modes"], points)
    if run_tiers:
        summary["tier_slowdown"] = tier_slowdown(rows, plan, run_tiers)
    return summary


def tier_slowdown(
    rows: list[dict], plan: Mapping[str, tuple[Mode, float]], run_tiers: Mapping[str, str]
) -> dict:
    """The honest cost of where the chunks start: per run from another tier (``blend[s3]``),
    TTFT there over TTFT of the same mode from ``--tier`` on the same prompt, per example
    and its median. Unlike ``hidden_load_fraction`` (the share of the load the prefill did
    not wait for), it also counts the compute the loader took from the prefill."""
    out: dict = {}
    for key, tier in run_tiers.items():
        mode = plan[key][0]
        ratios = [r["modes"][key]["ttft_s"] / r["modes"][mode]["ttft_s"] for r in rows]
        out[key] = {
            "tier": tier,
            "relative_to": mode,
            "ttft_ratio_median": statistics.median(ratios),
            "ttft_ratio_per_example": ratios,
        }
    return out


def _distribution(kl: list[float]) -> dict:
    """``tf_kl`` (the mean, as always) and how it spreads over the examples."""
    low, high = bootstrap_ci(kl)
    return {
        "tf_kl": statistics.fmean(kl),
        "tf_kl_median": statistics.median(kl),
        "tf_kl_p90": quantile(kl, 0.9),
        "tf_kl_ci95": [low, high],
    }


def _against_reuse(rows: list[dict], key: str) -> dict:
    """On how many examples ``key``'s tf_kl is worse (or better) than reuse's on the same
    prompt, by more than a tie."""
    diffs = [r["modes"][key]["tf_kl"] - r["modes"]["reuse"]["tf_kl"] for r in rows]
    return {
        "worse_than_reuse": sum(d > BETTER_OR_WORSE for d in diffs),
        "better_than_reuse": sum(d < -BETTER_OR_WORSE for d in diffs),
    }


def ratio_curve(modes: Mapping[str, dict], plan: Mapping[str, tuple[Mode, float]]) -> list[dict]:
    """The points users choose a ratio from, by recompute ratio: reuse (0), blend at each
    ratio, full (1); each with its speed (TTFT) and fidelity to full. A progressive run
    (``--refresh R``) is a point at its first token's ratio with ``refresh_ratio`` R and its
    second token's time (``second_token_ratio_to_full``)."""
    points = []
    for key, (mode, ratio) in plan.items():
        if mode not in ("full", "reuse", "blend"):
            continue
        m = modes[key]
        label = f"blend@{ratio:g}" if mode == "blend" else mode
        progressive = {}
        if "refresh_ratio" in m:
            label += f">{m['refresh_ratio']:g}"
            progressive = {
                "refresh_ratio": m["refresh_ratio"],
                "second_token_ratio_to_full": m["second_token_ratio_to_full"],
            }
        points.append(
            {
                "label": label,
                "ratio": {"full": 1.0, "reuse": 0.0}.get(mode, ratio),
                **progressive,
                "ttft_median_s": m["ttft_median_s"],
                "ttft_ratio_to_full": m["ttft_ratio_to_full"],
                "tf_kl_mean": m["tf_kl"],
                "tf_kl_median": m["tf_kl_median"],
                "tf_kl_ci95": m["tf_kl_ci95"],
                "tf_agreement": m["tf_agreement"],
                "tf_logprob_gap_mean": m["tf_logprob_gap"],
                "fidelity_f1": m["fidelity_f1"],  # the greedy answer's token F1 against full's
            }
        )
    return sorted(points, key=lambda point: point["ratio"])


def _store_means(values: list[dict]) -> dict:
    """Per-mode means of the store's numbers (None where the mode read no cached KV) and of
    the operators a pass dispatched (None where they were not counted)."""
    out = {}
    for name in (
        "load_s",
        "hidden_load_fraction",
        "ratio_chosen",
        "kv_bytes_per_token",
        "s3_mbps",
        "recomputed_chunks",
        "ops_per_layer",
    ):
        known = [v[name] for v in values if v.get(name) is not None]
        out[name] = statistics.fmean(known) if known else None
    return out


def print_table(summary: dict) -> None:
    header = (
        f"{'run':11} {'TTFT s':>7} {'x full':>6} {'KL mean':>8} {'95% CI':>17} {'median':>7} "
        f"{'p90':>7} {'lp gap':>7} {'agree':>6} {'vs reuse -/+':>12} {'gold_F1':>7}"
    )
    print(header)
    print("-" * len(header))
    for key, m in summary["modes"].items():
        ratio = m["ttft_ratio_to_full"]
        low, high = m["tf_kl_ci95"]
        versus = (
            f"{m['worse_than_reuse']}/{m['better_than_reuse']}" if "worse_than_reuse" in m else ""
        )
        print(
            f"{key:11} {m['ttft_median_s']:7.3f} {ratio or float('nan'):6.3f} "
            f"{m['tf_kl']:8.4f} {f'[{low:.4f}, {high:.4f}]':>17} {m['tf_kl_median']:7.4f} "
            f"{m['tf_kl_p90']:7.4f} {m['tf_logprob_gap']:7.3f} {m['tf_agreement']:6.3f} "
            f"{versus:>12} {m['gold_f1']:7.3f}"
        )
    print("vs reuse -/+: examples whose tf_kl is worse / better than reuse's on the same prompt")
    counted = {
        key: m["ops_per_layer"]
        for key, m in summary["modes"].items()
        if m.get("ops_per_layer") is not None
    }
    if counted:
        print(
            "kernel-launching operators per layer (bench.opcount, every thread): "
            + ", ".join(f"{key} {ops:.1f}" for key, ops in counted.items())
        )
    for key, m in summary["modes"].items():
        if "second_token_median_s" in m:
            ratio = m["second_token_ratio_to_full"] or float("nan")
            print(
                f"{key}: second token's logits at {m['second_token_median_s']:.3f} s "
                f"(x full {ratio:.3f}), the cache upgraded after the first"
            )
    for key, slow in summary.get("tier_slowdown", {}).items():
        each = ", ".join(f"{r:.2f}" for r in slow["ttft_ratio_per_example"])
        print(
            f"{key}: TTFT {slow['ttft_ratio_median']:.3f}x {slow['relative_to']}'s (median; "
            f"per example {each})"
        )
    hf = summary["hf_full"]["ttft_median_s"]
    if hf is not None:
        full = summary["modes"].get("full", {}).get("ttft_median_s")
        vs = f" (our full / hf_full = {full / hf:.3f})" if full else ""
        print(f"{'hf_full':11} {hf:7.3f}{vs}")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.engine == "vllm":
        from bench.prefill_vllm import main as vllm_main

        return vllm_main(args)
    if args.synthetic:
        from bench.long_context import main as synthetic_main

        return synthetic_main(args)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_llm_path(args.model_path, default_cache_dir())
    model = Transformer.from_pretrained(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        precision=args.precision,
        kernel=args.kernel,
    )
    print(model.kernel_choice.describe(), flush=True)
    args.kv_dtype = model.cache_dtype  # what the store's loader decodes into (bench_of)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_model = None
    if not args.no_hf:
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=args.dtype)
        hf_model = hf_model.to(args.device).eval()
    preamble = preamble_passages() if args.kv_preamble == "on" else ()
    fmt = PromptFormat(tokenizer, SYSTEM_PROMPT, INSTRUCTION, QUESTION_PREFIX, preamble=preamble)
    stop_ids = stop_token_ids(tokenizer)
    examples = json.loads(args.data.read_text())[args.first : args.first + args.examples]
    for out in (args.json, args.plot):  # e.g. docs/ratio_curve.json in a fresh checkout
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows: list[dict] = []

    def report() -> dict:
        summary = summarize(rows, args.plan, curve=bool(args.ratios), run_tiers=args.run_tiers)
        return {**summary, "env": _env(args, model, model_dir, rows, load_before), "examples": rows}

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
                args.json.write_text(json.dumps(report(), indent=2))
    summary = report()
    print_table(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    if args.plot:
        title = (
            f"{Path(model_dir).name}: Musique {args.first}-{args.first + len(rows) - 1}, "
            f"{args.passages} passages"
        )
        args.plot.write_text(ratio_curve_svg(summary["curve"], title))
    return summary


def _env(args, model, model_dir, rows, load_before) -> dict:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "model": str(model_dir),
        "model_fingerprint": model.fingerprint,
        "kernels": model.kernel_choice.to_dict(),
        "dtype": str(args.dtype).removeprefix("torch."),
        "device": str(args.device),
        "examples": len(rows),
        "first_example": args.first,
        "passages": args.passages,
        "ratio": args.ratio,
        "ratios": args.ratios,
        "tf_tokens": TF_TOKENS,
        "gap_tokens": GAP_TOKENS,
        "blend_settings": args.blend,
        "kv_preamble": args.kv_preamble,
        "tier": args.tier,
        "kv_codec": StoreConfig.from_env().codec,  # what the chunk KV was stored in (KV_CODEC)
        "also_tiers": sorted(set(args.run_tiers.values())),
        "pipeline": not args.no_pipeline,
        "mean_prompt_tokens": statistics.fmean(r["num_tokens"] for r in rows),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),  # other processes share these cores
    }


if __name__ == "__main__":
    main()
