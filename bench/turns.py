"""Follow-up questions: TTFT and fidelity of turns 2-5 when the previous turn's context KV is
read as it stands (``kvservice.serve.prefix``), against blending the chunks again and full prefill.

    python -m bench.turns --data ../shared/data/musique_dev.json --first 20 --conversations 4

A conversation is the product's prompt (``PromptFormat.for_tokenizer``: numbered passages,
earlier questions in the question part, as ``kvservice.serve.answer`` builds it) over one Musique
example's passages, asked ``--turns`` questions in a row: the example's own, then the next
examples' (a follow-up retrieves the same passages; whether they answer it does not matter to
the prefill's fidelity). Each turn is prefilled four ways, interleaved, from chunk KV in CPU
memory: ``full``; ``blend`` at ``--ratio``; ``reuse``; and ``turn_kv``, which reads the
context KV the first turn's blend left (kept in the store's float16, as the worker keeps it)
and computes only the question part. Fidelity is the prefill bench's (``bench.prefill``):
teacher-forced KL over full's answer, top-1 agreement, log-probability gap.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.data import passage_texts, shared_data
from bench.fidelity import (
    greedy_answer,
    teacher_forced_fidelity,
    teacher_forced_logits,
    without_stop,
)
from bench.prefill import GAP_TOKENS, TF_TOKENS
from bench.stats import quantile
from bench.timing import cpu_name, timed
from kvservice.blend.prefill import blend_prefill
from kvservice.model.bundled import resolve_llm_path
from kvservice.model.producer import KVProducer
from kvservice.model.transformer import Transformer
from kvservice.protocol.models import default_cache_dir
from kvservice.protocol.prompt import PromptFormat
from kvservice.serve.engine import stop_token_ids
from kvservice.serve.prefix import PrefixKV

RUNS = ("full", "blend", "reuse", "turn_kv")


def conversation(model, fmt, head_kv, examples, args, stop_ids) -> list[dict]:
    """One conversation over ``examples[0]``'s passages: a row per turn."""
    chunk_ids = [fmt.chunk_ids(text) for text in passage_texts(examples[0], args.passages)]
    chunks = KVProducer(model, fmt.storage_ids).compute(chunk_ids)
    segments = fmt.numbered(chunk_ids)
    sources = [part for chunk in chunks for part in (None, chunk)]  # markers computed fresh
    context = len(fmt.head_ids) + sum(map(len, segments))
    asked: list[tuple[str, str]] = []
    prefix, rows = None, []
    for turn, example in enumerate(examples[: args.turns], start=1):
        question = fmt.question_ids(example["question"], asked)
        asked.append(("user", example["question"]))

        def prefill(run: str, question=question, prefix=prefix):
            mode = "blend" if run == "turn_kv" else run
            result = blend_prefill(
                model,
                fmt.head_ids,
                sources,
                question,
                mode=mode,
                recompute_ratio=args.ratio,
                chunk_ids=segments,
                head_kv=head_kv,
                extra_capacity=GAP_TOKENS,
                cached_prefix=prefix if run == "turn_kv" else None,
            )
            int(result.logits.argmax())  # the first token: TTFT ends here
            return result

        runs = RUNS if prefix is not None else RUNS[:3]
        results, ttft = {}, {}
        for run in runs:
            results[run], ttft[run] = timed(lambda run=run: prefill(run), model.device)
        answer = greedy_answer(model, results["full"], GAP_TOKENS, stop_ids)
        positions = min(len(without_stop(answer, stop_ids)) + 1, TF_TOKENS)
        full_logits = teacher_forced_logits(model, results["full"], answer)
        row = {"turn": turn, "prompt_tokens": results["full"].num_tokens, "runs": {}}
        for run in runs:
            logits = teacher_forced_logits(model, results[run], answer)
            fidelity = teacher_forced_fidelity(logits, full_logits, answer, positions)
            row["runs"][run] = {"ttft_s": ttft[run], **fidelity}
        rows.append(row)
        if prefix is None:  # what the worker keeps after the first turn's blend
            prefix = PrefixKV.from_cache(results["blend"].cache, context, torch.float16)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Over the follow-ups (turn >= 2): each run's TTFT and fidelity distribution, turn_kv's
    TTFT over blend's and full's per turn, and how many turns turn_kv is worse than blend or
    reuse on (tf_kl)."""
    follow = [row for row in rows if "turn_kv" in row["runs"]]
    out: dict = {"follow_ups": len(follow), "runs": {}}
    for run in RUNS:
        ttft = [row["runs"][run]["ttft_s"] for row in follow]
        kl = [row["runs"][run]["tf_kl"] for row in follow]
        out["runs"][run] = {
            "ttft_median_s": statistics.median(ttft),
            "tf_kl_mean": statistics.fmean(kl),
            "tf_kl_median": statistics.median(kl),
            "tf_kl_p90": quantile(kl, 0.9),
            "tf_agreement": statistics.fmean(row["runs"][run]["tf_agreement"] for row in follow),
            "tf_logprob_gap": statistics.fmean(
                row["runs"][run]["tf_logprob_gap"] for row in follow
            ),
        }
    for other in ("blend", "full"):
        ratios = [r["runs"]["turn_kv"]["ttft_s"] / r["runs"][other]["ttft_s"] for r in follow]
        out[f"turn_kv_over_{other}_ttft_median"] = statistics.median(ratios)
    for other in ("blend", "reuse"):
        out[f"turn_kv_worse_than_{other}"] = sum(
            r["runs"]["turn_kv"]["tf_kl"] > r["runs"][other]["tf_kl"] for r in follow
        )
    return out


def print_table(summary: dict) -> None:
    columns = ("TTFT s", "KL mean", "median", "p90", "gap", "agree")
    print(f"{'run':<8} " + " ".join(f"{c:>8}" for c in columns))
    for run, v in summary["runs"].items():
        values = (
            v["ttft_median_s"],
            v["tf_kl_mean"],
            v["tf_kl_median"],
            v["tf_kl_p90"],
            v["tf_logprob_gap"],
            v["tf_agreement"],
        )
        print(f"{run:<8} " + " ".join(f"{x:8.4f}" for x in values))
    print(
        f"turn_kv TTFT: {summary['turn_kv_over_blend_ttft_median']:.3f}x blend's, "
        f"{summary['turn_kv_over_full_ttft_median']:.3f}x full's (median over "
        f"{summary['follow_ups']} follow-ups); worse than blend on "
        f"{summary['turn_kv_worse_than_blend']}, "
        f"than reuse on {summary['turn_kv_worse_than_reuse']}"
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.turns", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--data", type=Path, default=shared_data())
    parser.add_argument("--first", type=int, default=20, help="first example (20-39: validation)")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = resolve_llm_path(args.model_path, default_cache_dir())
    model = Transformer.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fmt = PromptFormat.for_tokenizer(tokenizer)
    head_kv = KVProducer(model, fmt.head_ids).head_kv
    stop_ids = stop_token_ids(tokenizer)
    examples = json.loads(args.data.read_text())
    rows = []
    with torch.no_grad():
        for c in range(args.conversations):
            start = args.first + c * args.turns
            for row in conversation(
                model, fmt, head_kv, examples[start : start + args.turns], args, stop_ids
            ):
                row["conversation"] = start
                rows.append(row)
                brief = "  ".join(
                    f"{run}={v['ttft_s']:.2f}s/{v['tf_kl']:.3f}" for run, v in row["runs"].items()
                )
                print(f"[conversation {start}, turn {row['turn']}] {brief}", flush=True)
    summary = {
        **summarize(rows),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "ratio": args.ratio,
        "first": args.first,
        "rows": rows,
    }
    print_table(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
