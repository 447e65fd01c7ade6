"""What bfloat16 products (``ENGINE_PRECISION=auto``, ``kvservice.model.kernels``) change against
float32, per prompt: full prefill in each precision, both fed float32 full's greedy answer.

    python -m bench.precision --data ../shared/data/musique_dev.json --first 20 --examples 20

Prints per example and in distribution (mean, median, p90) the teacher-forced KL of
bfloat16's full prefill to float32's (``tf_kl``, the benches' measure), top-1 agreement, and
whether the free-running greedy answers are the same tokens; with ``--ratio``, the same for
blend in each precision against its own precision's full (what ``kvservice.bench`` reports
as tf_kl), so the two precisions' blend fidelity can be compared on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from transformers import AutoTokenizer

from bench.data import shared_data
from bench.fidelity import (
    greedy_answer,
    teacher_forced_fidelity,
    teacher_forced_logits,
    without_stop,
)
from bench.prefill import (
    GAP_TOKENS,
    INSTRUCTION,
    QUESTION_PREFIX,
    SYSTEM_PROMPT,
    TF_TOKENS,
    example_prompt,
)
from bench.stats import quantile
from kvservice.blend.prefill import blend_prefill
from kvservice.model.bundled import resolve_llm_path
from kvservice.model.producer import KVProducer
from kvservice.model.transformer import Transformer
from kvservice.protocol.models import default_cache_dir
from kvservice.protocol.prompt import PromptFormat
from kvservice.serve.engine import stop_token_ids


def _example(model, fmt, example, args, stop_ids) -> dict:
    prompt = example_prompt(fmt, example, args.passages)
    row: dict = {}
    per: dict[str, dict] = {}
    for precision in ("float32", "auto"):
        model.prepare_kernels(precision)
        producer = KVProducer(model, prompt.head_ids)  # this precision's
        head_kv, chunks = producer.head_kv, producer.compute(prompt.chunk_ids)

        def prefill(mode, chunks=chunks, head_kv=head_kv):
            return blend_prefill(
                model,
                prompt.head_ids,
                chunks,
                prompt.question_ids,
                mode=mode,
                recompute_ratio=args.ratio,
                chunk_ids=prompt.chunk_ids,
                head_kv=head_kv,
                extra_capacity=GAP_TOKENS,
            )

        per[precision] = {"full": prefill("full"), "blend": prefill("blend")}
        if precision == "float32":
            answer = greedy_answer(model, per["float32"]["full"], GAP_TOKENS, stop_ids)
            forced = answer[:GAP_TOKENS]
            positions = min(len(without_stop(answer, stop_ids)) + 1, TF_TOKENS)
        per[precision]["logits"] = {
            mode: teacher_forced_logits(model, per[precision][mode], forced)
            for mode in ("full", "blend")
        }
        per[precision]["greedy"] = greedy_answer(
            model, per[precision]["full"], args.max_new, stop_ids
        )
    logits32, logits16 = per["float32"]["logits"], per["auto"]["logits"]
    row["full_auto_vs_float32"] = teacher_forced_fidelity(
        logits16["full"], logits32["full"], forced, positions
    )
    row["same_greedy"] = per["auto"]["greedy"] == per["float32"]["greedy"]
    for precision, logits in (("float32", logits32), ("auto", logits16)):
        row[f"blend_{precision}"] = teacher_forced_fidelity(
            logits["blend"], logits["full"], forced, positions
        )
    return row


def _spread(values: list[float]) -> str:
    return (
        f"mean {statistics.fmean(values):.4f} median {statistics.median(values):.4f} "
        f"p90 {quantile(values, 0.9):.4f}"
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=shared_data())
    parser.add_argument("--first", type=int, default=20)
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    model_dir = resolve_llm_path(None, default_cache_dir())
    model = Transformer.from_pretrained(model_dir)
    if not model.kernel_choice.cpu_bf16:
        raise SystemExit("this CPU has no native bfloat16: auto is float32 here")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fmt = PromptFormat(tokenizer, SYSTEM_PROMPT, INSTRUCTION, QUESTION_PREFIX)
    stop_ids = stop_token_ids(tokenizer)
    examples = json.loads(args.data.read_text())[args.first : args.first + args.examples]
    rows = []
    for index, example in enumerate(examples, start=args.first):
        row = _example(model, fmt, example, args, stop_ids)
        rows.append(row)
        print(
            f"example {index}: full auto vs float32 tf_kl "
            f"{row['full_auto_vs_float32']['tf_kl']:.4f} same greedy {row['same_greedy']}; "
            f"blend tf_kl float32 {row['blend_float32']['tf_kl']:.4f} "
            f"auto {row['blend_auto']['tf_kl']:.4f}",
            flush=True,
        )
    summary = {
        "full_auto_vs_float32_tf_kl": _spread([r["full_auto_vs_float32"]["tf_kl"] for r in rows]),
        "full_auto_vs_float32_agreement": statistics.fmean(
            r["full_auto_vs_float32"]["tf_agreement"] for r in rows
        ),
        "same_greedy": sum(r["same_greedy"] for r in rows),
        "blend_float32_tf_kl": _spread([r["blend_float32"]["tf_kl"] for r in rows]),
        "blend_auto_tf_kl": _spread([r["blend_auto"]["tf_kl"] for r in rows]),
        "blend_auto_worse": sum(
            r["blend_auto"]["tf_kl"] > r["blend_float32"]["tf_kl"] + 1e-4 for r in rows
        ),
        "examples": len(rows),
    }
    for key, value in summary.items():
        print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    return summary


if __name__ == "__main__":
    main()
