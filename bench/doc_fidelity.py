"""Fidelity on the product's own kind of documents: blend and reuse against full prefill over
a handbook's passages, with chunk KV computed after the head alone or after the retrieval
preamble (``KV_PREAMBLE``), for the decision Musique's KL cannot make alone.

    .venv/bin/python -m bench.doc_fidelity --handbook tests/data/handbook --json out.json

The documents of ``--handbook`` are parsed and chunked as on upload (``chunk_text`` at
``--chunk-tokens``, the product's ``CHUNK_TOKENS``), embedded with the product's MiniLM, and
each question of its ``questions.json`` gets its top ``--top-k`` passages from
``--min-score`` on, by cosine (the chat's retrieval, without its full-text half). The prompt
is the product's (``PromptFormat.for_tokenizer``: numbered passages, markers computed, passages
cached). Per question and run: teacher-forced KL to full over the first 16 tokens of full's
greedy answer and top-1 agreement (``bench.prefill``'s metrics), and whether the run's own
greedy answer holds the question's ``fact`` (full's too).

Runs: ``reuse`` and ``blend`` at each ``--ratios``, once with chunk KV computed after the head
(``off``) and once after the preamble (``on``), then blend again with each
``--stale-key-scales`` in place of the default (0.95 was tuned with the preamble on Musique
1-19; 1.0 is none).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.answers import handbook_texts
from bench.prefill import (
    GAP_TOKENS,
    TF_TOKENS,
    _greedy,
    _teacher_forced_logits,
    _without_stop,
    blend_settings,
    teacher_forced_fidelity,
)
from bench.stats import quantile
from kvservice.blend import BlendSettings, blend_prefill
from kvservice.kernels import DEFAULT_PRECISION
from kvservice.model import Transformer, precompute_chunks, precompute_head
from kvservice.prompt import PromptFormat, stop_token_ids

MAX_NEW_TOKENS = 48  # the answer checked for the fact: a sentence or two


@dataclass
class Case:
    question: str
    fact: str | None
    passages: list[str]


def handbook_cases(
    directory: Path, model_path: Path, chunk_tokens: int, top_k: int, min_score: float
) -> list[Case]:
    """Each question with the passages the chat's vector retrieval would give it."""
    from webapp.documents.chunking import chunk_text, llm_tokenizer
    from webapp.documents.embeddings import embed_texts

    tokenizer = llm_tokenizer(str(model_path))
    passages = [
        chunk.text
        for text in handbook_texts(directory)
        for chunk in chunk_text(text, tokenizer=tokenizer, max_tokens=chunk_tokens)
    ]
    questions = json.loads((directory / "questions.json").read_text())["questions"]
    vectors = torch.tensor(embed_texts(passages))
    asked = torch.tensor(embed_texts([q["question"] for q in questions]))
    cases = []
    for item, scores in zip(questions, (asked @ vectors.T).tolist(), strict=True):
        order = sorted(range(len(passages)), key=lambda i: -scores[i])[:top_k]
        kept = [passages[i] for i in order if scores[i] >= min_score]
        if kept:  # none kept: the chat answers "not found" without the model
            cases.append(Case(item["question"], item["fact"], kept))
    return cases


def run_case(model, tokenizer, formats, case: Case, runs, stop_ids) -> dict[str, Any]:
    """Full prefill, then each run, on one question's prompt."""
    base = formats["off"]
    passages = [base.chunk_ids(text) for text in case.passages]
    segments = base.numbered(passages)
    head, question = list(base.head_ids), base.question_ids(case.question)
    chunk_kv = {
        name: precompute_chunks(model, fmt.storage_ids, passages,
                                head_kv=precompute_head(model, fmt.storage_ids))
        for name, fmt in formats.items()
    }  # fmt: skip
    head_kv = precompute_head(model, head)
    extra = max(MAX_NEW_TOKENS, GAP_TOKENS)

    def prefill(mode: str, ratio: float, kvs=None, settings: BlendSettings | None = None):
        sources = [None] * len(segments)
        if kvs is not None:
            sources[1::2] = kvs  # the markers are computed, the passages read
        return blend_prefill(model, head, sources, question, mode=mode, recompute_ratio=ratio,
                             chunk_ids=segments, head_kv=head_kv, extra_capacity=extra,
                             settings=settings or BlendSettings())  # fmt: skip

    full = prefill("full", 0.0)
    answer_ids = _greedy(model, full, max(MAX_NEW_TOKENS, GAP_TOKENS), stop_ids)
    forced = answer_ids[:GAP_TOKENS]
    full_answer = _without_stop(answer_ids, stop_ids)[:MAX_NEW_TOKENS]
    positions = min(len(full_answer) + 1, TF_TOKENS)
    full_logits = _teacher_forced_logits(model, full, forced)
    row = {
        "question": case.question, "fact": case.fact, "passages": len(passages),
        "prompt_tokens": full.num_tokens, "runs": {"full": _answer(tokenizer, case, full_answer)},
    }  # fmt: skip
    for key, (kv_name, mode, ratio, settings) in runs.items():
        result = prefill(mode, ratio, chunk_kv[kv_name], settings)
        metrics = teacher_forced_fidelity(
            _teacher_forced_logits(model, result, forced), full_logits, forced, positions
        )
        own = _without_stop(_greedy(model, result, MAX_NEW_TOKENS, stop_ids), stop_ids)
        row["runs"][key] = {**metrics, **_answer(tokenizer, case, own)}
    return row


def _answer(tokenizer, case: Case, ids: list[int]) -> dict[str, Any]:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    fact = (case.fact or "").lower()
    return {"answer": text, "has_fact": bool(fact) and fact in text.lower()}


def summary(rows: list[dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    out = {"full": {"has_fact": sum(r["runs"]["full"]["has_fact"] for r in rows)}}
    for key in keys:
        kl = [r["runs"][key]["tf_kl"] for r in rows]
        out[key] = {
            "tf_kl_mean": statistics.mean(kl), "tf_kl_median": statistics.median(kl),
            "tf_kl_p90": quantile(kl, 0.9),
            "tf_agreement": statistics.mean(r["runs"][key]["tf_agreement"] for r in rows),
            "has_fact": sum(r["runs"][key]["has_fact"] for r in rows),
            "lost_fact": sum(r["runs"]["full"]["has_fact"] and not r["runs"][key]["has_fact"]
                             for r in rows),
        }  # fmt: skip
    return out


def plan_runs(ratios: list[float], scales: list[float], blend: dict) -> dict[str, tuple]:
    runs: dict[str, tuple] = {}
    for kv_name in ("off", "on"):
        runs[f"reuse[{kv_name}]"] = (kv_name, "reuse", 0.0, BlendSettings(**blend))
        for ratio in ratios:
            settings = BlendSettings(**blend)
            runs[f"blend@{ratio:.2f}[{kv_name}]"] = (kv_name, "blend", ratio, settings)
    for kv_name in ("off", "on"):
        for scale in scales:
            for ratio in ratios:
                settings = BlendSettings(**{**blend, "stale_key_scale": scale})
                runs[f"blend@{ratio:.2f}[{kv_name},x{scale:g}]"] = (
                    kv_name,
                    "blend",
                    ratio,
                    settings,
                )
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handbook", type=Path, required=True)
    parser.add_argument("--chunk-tokens", type=int, default=512)  # CHUNK_TOKENS
    parser.add_argument("--top-k", type=int, default=6)  # RETRIEVAL_TOP_K
    parser.add_argument("--min-score", type=float, default=0.3)  # RETRIEVAL_MIN_SCORE
    parser.add_argument("--ratios", default="0.10,0.15")
    parser.add_argument("--stale-key-scales", default="0.95")
    parser.add_argument(
        "--blend", action="append", default=[], metavar="NAME=VALUE",
        help="a blend_prefill setting for every run, e.g. stale_ramp_tokens=1200 (repeatable)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from kvservice.bundled import resolve_llm_path

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_llm_path(None)
    cases = handbook_cases(args.handbook, path, args.chunk_tokens, args.top_k, args.min_score)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = Transformer.from_pretrained(path, device="cpu", precision=DEFAULT_PRECISION)
    formats = {name: PromptFormat.for_tokenizer(tokenizer, preamble=name == "on")
               for name in ("off", "on")}  # fmt: skip
    ratios = [float(r) for r in args.ratios.split(",") if r]
    scales = [float(s) for s in args.stale_key_scales.split(",") if s]
    runs = plan_runs(ratios, scales, blend_settings(args.blend))
    stop_ids = stop_token_ids(tokenizer, path)
    rows = []
    for i, case in enumerate(cases):
        rows.append(run_case(model, tokenizer, formats, case, runs, stop_ids))
        brief = {k: round(v["tf_kl"], 4) for k, v in rows[-1]["runs"].items() if "tf_kl" in v}
        print(f"[{i + 1}/{len(cases)}] {case.question[:50]!r} {brief}", flush=True)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "questions": len(rows),
              "summary": summary(rows, list(runs)), "rows": rows}  # fmt: skip
    print(json.dumps(report["summary"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
