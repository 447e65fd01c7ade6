"""Where a blend's time goes, and the most a faster attention kernel could give it.

    python -m bench.blend_cost --data ../shared/data/musique_dev.json --first 20 --examples 5

Per example, ``full`` and ``blend`` prefill the same prompt (chunk KV precomputed and in CPU
memory, as in ``kvservice.bench``): a warm-up, ``--repeats`` timed runs (the median), then
one run with every ``scaled_dot_product_attention`` call timed and its (query, key) pairs
counted. Full prefill's attention is those calls (the causal prompt); blend's are its
recompute pass (the selected tokens and the question in groups; its reuse pass weighs the
question's attention with its own product and holds no SDPA call, so it is in "the rest").

For each run it prints the total, the SDPA time, the pairs a query may see (``visible``) and
the pairs the kernel was given (``given``, the masked ones included), and the nanoseconds per
visible pair. Then two bounds for blend, full's time divided by:

* ``at_full_rate``: blend with its attention at full prefill's own rate per visible pair (a
  kernel that skips masked work and runs small query groups as fast as the big causal one);
* ``free_attention``: blend with attention that costs nothing (the linear layers, the reuse
  pass and moving the cached KV into place only).

Then what blend adds to reuse (``reuse`` runs too), part by part beside its floor at full
prefill's own rates, measured in the same run: attention (every SDPA call and the question's
weighed attention) at full's time per visible (query, key) pair; the linear layers' products
(``FusedLinear``) at full's time per row; the rest (norms, RoPE, the MLP's activation,
residuals, selection) at full's rest per row. ``(b-r)/full`` against ``floor`` says how much
of blend's extra time is the work it does and how much is the rate it does it at.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.data import shared_data
from bench.prefill import INSTRUCTION, QUESTION_PREFIX, SYSTEM_PROMPT, example_prompt
from bench.timing import cpu_name, timed
from kvservice.blend import attention
from kvservice.blend.prefill import blend_prefill
from kvservice.model.bundled import resolve_llm_path
from kvservice.model.kernels import DEFAULT_PRECISION, PRECISIONS, FusedLinear
from kvservice.model.producer import KVProducer
from kvservice.model.transformer import Transformer
from kvservice.protocol.models import default_cache_dir
from kvservice.protocol.prompt import PromptFormat


@dataclass
class AttentionMeter:
    seconds: float = 0.0
    visible: int = 0  # (query, key) pairs a query may attend to, summed over query heads
    given: int = 0  # pairs handed to the kernel, masked ones included, summed likewise
    weighed_seconds: float = 0.0  # the question's weighed attention (not SDPA), and ...
    weighed_visible: int = 0  # ... its pairs, summed over query heads


@dataclass
class ProductMeter:
    seconds: float = 0.0  # in the linear layers' products (``FusedLinear``)
    rows: int = 0  # the rows they multiplied, over every product
    calls: int = 0


def visible_pairs(queries: int, keys: int, attn_mask: torch.Tensor | None, is_causal: bool) -> int:
    """The (query, key) pairs one SDPA call lets a query see (per head)."""
    if attn_mask is not None:
        allowed = attn_mask if attn_mask.dtype == torch.bool else torch.isfinite(attn_mask)
        one_head = allowed.expand(*allowed.shape[:-2], queries, keys).reshape(-1, queries, keys)[0]
        return int(one_head.sum())
    if is_causal:  # top-left aligned: query i sees keys 0..i
        seen = min(queries, keys)
        return seen * (seen + 1) // 2 + (queries - seen) * keys
    return queries * keys


@contextmanager
def metered_attention() -> Iterator[AttentionMeter]:
    """Time and count every ``F.scaled_dot_product_attention`` call inside the block, and
    every group the CPU attends explicitly (``attention._attend_explicitly``) with them, and
    the question's weighed attention (``attention.attend_and_weigh``) apart."""
    meter = AttentionMeter()
    original = F.scaled_dot_product_attention
    original_explicit = attention._attend_explicitly
    original_weigh = attention.attend_and_weigh

    def weighed(q, k, v, query_pos, key_pos, *rest, **kwargs):
        start = time.perf_counter()
        out = original_weigh(q, k, v, query_pos, key_pos, *rest, **kwargs)
        meter.weighed_seconds += time.perf_counter() - start
        seen = (key_pos[None, :] <= query_pos[:, None]).sum()  # causal by position
        meter.weighed_visible += q.shape[0] * int(seen)
        return out

    def metered(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        start = time.perf_counter()
        out = original(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs
        )
        meter.seconds += time.perf_counter() - start
        # Per query head: a call may stack several heads' queries as rows (attend_grouped).
        heads, queries, keys = q.shape[-3], q.shape[-2], k.shape[-2]
        meter.given += heads * queries * keys
        meter.visible += heads * visible_pairs(queries, keys, attn_mask, is_causal)
        return out

    def explicit(rows, k, v, mask):
        start = time.perf_counter()
        out = original_explicit(rows, k, v, mask)
        meter.seconds += time.perf_counter() - start
        heads, queries, keys = rows.shape[0], rows.shape[1], k.shape[1]
        meter.given += heads * queries * keys
        meter.visible += heads * visible_pairs(queries, keys, mask, False)
        return out

    F.scaled_dot_product_attention = metered
    attention._attend_explicitly = explicit
    attention.attend_and_weigh = weighed
    try:
        yield meter
    finally:
        F.scaled_dot_product_attention = original
        attention._attend_explicitly = original_explicit
        attention.attend_and_weigh = original_weigh


@contextmanager
def metered_products() -> Iterator[ProductMeter]:
    """Time every linear layers' product (``FusedLinear``) inside the block, and count its rows."""
    meter = ProductMeter()
    original = FusedLinear.forward

    def metered(self, x):
        start = time.perf_counter()
        out = original(self, x)
        meter.seconds += time.perf_counter() - start
        meter.rows += x.numel() // x.shape[-1]
        meter.calls += 1
        return out

    FusedLinear.forward = metered
    try:
        yield meter
    finally:
        FusedLinear.forward = original


@torch.no_grad()
def measure_example(model: Transformer, fmt: PromptFormat, example: dict, args) -> dict:
    prompt = example_prompt(fmt, example, args.passages)
    producer = KVProducer(model, prompt.head_ids)
    head_kv, chunks = producer.head_kv, producer.compute(prompt.chunk_ids)

    def prefill(mode: str) -> None:
        result = blend_prefill(
            model,
            prompt.head_ids,
            chunks,
            prompt.question_ids,
            mode=mode,
            recompute_ratio=args.ratio,
            chunk_ids=prompt.chunk_ids,
            head_kv=head_kv,
        )
        int(result.logits.argmax())

    row: dict = {"num_tokens": len(prompt.token_ids)}
    for mode in ("full", "reuse", "blend"):
        prefill(mode)  # warm-up
        run = functools.partial(prefill, mode)
        seconds = [timed(run, model.device)[1] for _ in range(args.repeats)]
        with metered_attention() as meter, metered_products() as products:
            prefill(mode)
        heads = model.config.n_heads  # pairs below are per (query token, key token)
        row[mode] = {
            "seconds": statistics.median(seconds),
            "sdpa_seconds": meter.seconds,
            "visible_pairs": meter.visible / heads,
            "given_pairs": meter.given / heads,
            "ns_per_visible_pair": 1e9 * meter.seconds * heads / max(1, meter.visible),
            "weighed_seconds": meter.weighed_seconds,
            "weighed_pairs": meter.weighed_visible / heads,
            "products_seconds": products.seconds,
            "product_rows": products.rows,
        }
    row["beyond_reuse"] = beyond_reuse(row["full"], row["reuse"], row["blend"])
    full, blend = row["full"], row["blend"]
    full_rate = full["sdpa_seconds"] / full["visible_pairs"]
    rest = blend["seconds"] - blend["sdpa_seconds"]
    row["speedup"] = full["seconds"] / blend["seconds"]
    row["speedup_at_full_rate"] = full["seconds"] / (rest + blend["visible_pairs"] * full_rate)
    row["speedup_free_attention"] = full["seconds"] / rest
    if args.profile:
        print_profile(functools.partial(prefill, "blend"))
    return row


def beyond_reuse(full: dict, reuse: dict, blend: dict) -> dict:
    """Blend's time beyond reuse's, part by part, each beside its floor at full prefill's
    own rates (seconds; ``share``/``floor_share``: over full's time). A part's floor is the
    work blend adds to reuse's (pairs, rows) at the time full spends per unit of it."""

    def parts(run: dict) -> dict:
        attention = run["sdpa_seconds"] + run["weighed_seconds"]
        return {
            "attention": attention,
            "products": run["products_seconds"],
            "rest": run["seconds"] - attention - run["products_seconds"],
            "pairs": run["visible_pairs"] + run["weighed_pairs"],
            "rows": run["product_rows"],
        }

    f, r, b = parts(full), parts(reuse), parts(blend)
    added_pairs, added_rows = b["pairs"] - r["pairs"], b["rows"] - r["rows"]
    floors = {
        "attention": added_pairs * f["attention"] / f["pairs"],
        "products": added_rows * f["products"] / f["rows"],
        "rest": added_rows * f["rest"] / f["rows"],
    }
    out = {name: {"seconds": b[name] - r[name], "floor": floors[name]} for name in floors}
    out["pairs_of_full"], out["rows_of_full"] = added_pairs / f["pairs"], added_rows / f["rows"]
    out["share"] = (blend["seconds"] - reuse["seconds"]) / full["seconds"]
    out["floor_share"] = sum(floors.values()) / full["seconds"]
    return out


def print_profile(run) -> None:
    """One run under torch's profiler: the ops that took the most time, self time first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def print_beyond_reuse(rows: list[dict], first: int) -> None:
    print(
        f"\nblend beyond reuse: measured (floor at full's rates); pairs and rows it adds, of"
        f" full's; seconds by part\n{'':6} {'reuse s':>7} {'(b-r)/full':>13} {'pairs':>5}"
        f" {'rows':>5}" + "".join(f" {name:>15}" for name in ("attention", "products", "rest"))
    )
    for index, row in enumerate(rows):
        added = row["beyond_reuse"]
        cells = "".join(
            f" {added[name]['seconds']:6.3f} ({added[name]['floor']:6.3f})"
            for name in ("attention", "products", "rest")
        )
        print(
            f"{first + index:6} {row['reuse']['seconds']:7.3f}"
            f" {added['share']:.3f} ({added['floor_share']:.3f})"
            f" {added['pairs_of_full']:5.3f} {added['rows_of_full']:5.3f}{cells}",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m bench.blend_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--data", type=Path, default=shared_data())
    parser.add_argument("--first", type=int, default=20)
    parser.add_argument("--examples", type=int, default=5)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default=DEFAULT_PRECISION, choices=PRECISIONS)
    parser.add_argument("--profile", action="store_true", help="print blend's top ops")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = resolve_llm_path(args.model_path, default_cache_dir())
    model = Transformer.from_pretrained(model_dir, device="cpu", precision=args.precision)
    fmt = PromptFormat(
        AutoTokenizer.from_pretrained(model_dir), SYSTEM_PROMPT, INSTRUCTION, QUESTION_PREFIX
    )
    data = json.loads(args.data.read_text())[args.first : args.first + args.examples]
    print(
        f"{'':6} {'tokens':>6} {'full s':>7} {'attn':>6} {'ns/pair':>7}"
        f" {'blend s':>7} {'attn':>6} {'ns/pair':>7} {'given/vis':>9}"
        f" {'speedup':>7} {'at full rate':>12} {'free attn':>9}"
    )
    rows = []
    for index, example in enumerate(data):
        row = measure_example(model, fmt, example, args)
        rows.append(row)
        full, blend = row["full"], row["blend"]
        print(
            f"{args.first + index:6} {row['num_tokens']:6} {full['seconds']:7.3f}"
            f" {full['sdpa_seconds']:6.3f} {full['ns_per_visible_pair']:7.2f}"
            f" {blend['seconds']:7.3f} {blend['sdpa_seconds']:6.3f}"
            f" {blend['ns_per_visible_pair']:7.2f}"
            f" {blend['given_pairs'] / blend['visible_pairs']:9.2f}"
            f" {row['speedup']:7.2f} {row['speedup_at_full_rate']:12.2f}"
            f" {row['speedup_free_attention']:9.2f}",
            flush=True,
        )
    summary = {
        key: statistics.median(row[key] for row in rows)
        for key in ("speedup", "speedup_at_full_rate", "speedup_free_attention")
    }
    summary["blend_visible_pairs_per_full"] = statistics.median(
        row["blend"]["visible_pairs"] / row["full"]["visible_pairs"] for row in rows
    )
    for key in ("share", "floor_share"):
        summary[f"beyond_reuse_{key}"] = statistics.median(row["beyond_reuse"][key] for row in rows)
    print(
        f"median over {len(rows)}: full / blend {summary['speedup']:.2f}x now,"
        f" {summary['speedup_at_full_rate']:.2f}x with blend's attention at full's rate per pair,"
        f" {summary['speedup_free_attention']:.2f}x with free attention; blend's attention sees"
        f" {summary['blend_visible_pairs_per_full']:.3f} of full's (query, key) pairs"
        f" at ratio {args.ratio}"
    )
    print_beyond_reuse(rows, args.first)
    print(
        f"median over {len(rows)}: blend beyond reuse {summary['beyond_reuse_share']:.3f} of"
        f" full's time, {summary['beyond_reuse_floor_share']:.3f} at full's own rates"
    )
    result = {"summary": summary, "examples": rows, "cpu": cpu_name(), "args": vars(args)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
