"""Fidelity on the product's own kind of documents: blend and reuse against full prefill over
passages retrieved as the chat retrieves them, with chunk KV computed after the head alone,
after the retrieval preamble (``KV_PREAMBLE``) or after the chunk's document predecessor, for
the decisions Musique's KL in prompt order cannot make alone.

    .venv/bin/python -m bench.doc_fidelity --handbook tests/data/handbook --json out.json
    .venv/bin/python -m bench.doc_fidelity --musique ../shared/data/musique_dev.json \
        --first 0 --examples 20 --kv off,nb --min-score 0

The documents (``--handbook``'s files, or each Musique example's ten passages as a library of
its own, ``--musique``) are parsed and chunked as on upload (``chunk_text`` at
``--chunk-tokens``, the product's ``CHUNK_TOKENS``), embedded with the product's MiniLM, and
each question gets its top ``--top-k`` passages from ``--min-score`` on, by cosine (the chat's
retrieval, without its full-text half); ``--order grouped`` then puts a document's
consecutive chunks together in its order (``bench.neighbours.keep_neighbours_together``). The
prompt is the product's (``PromptFormat.for_tokenizer``: numbered passages, markers computed,
passages cached). Per question and run: teacher-forced KL to full over the first 16 tokens of
full's greedy answer and top-1 agreement (``bench.prefill``'s metrics), and whether the run's
own greedy answer holds the question's ``fact`` (full's too).

Runs: ``reuse`` and ``blend`` at each ``--ratios`` for each ``--kv`` form of the stored chunks
(``off``: after the head; ``on``: after the preamble; ``nb``: a chunk that follows its
document predecessor in the prompt after that predecessor, the others as ``off``), then blend
again with each ``--stale-key-scales`` in place of the default (0.95 was tuned with the
preamble on Musique 1-19; 1.0 is none).
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
from bench.fidelity import (
    greedy_answer,
    teacher_forced_fidelity,
    teacher_forced_logits,
    without_stop,
)
from bench.neighbours import keep_neighbours_together, precompute_after_previous
from bench.prefill import GAP_TOKENS, TF_TOKENS, blend_settings
from bench.stats import quantile
from kvservice.blend.prefill import BlendSettings, blend_prefill
from kvservice.model.kernels import DEFAULT_PRECISION
from kvservice.model.producer import KVProducer
from kvservice.model.transformer import Transformer
from kvservice.protocol.prompt import PromptFormat, stop_token_ids

MAX_NEW_TOKENS = 48  # the answer checked for the fact: a sentence or two


@dataclass
class Case:
    question: str
    fact: str | None
    passages: list[str]
    follows: list[bool]  # passage i comes right after its predecessor in its document


@dataclass(frozen=True)
class Retrieval:
    """The chat's retrieval, as far as these benches need it."""

    chunk_tokens: int
    top_k: int
    min_score: float
    grouped: bool  # neighbours kept together (``keep_neighbours_together``), else by score


def retrieved_cases(
    documents: list[str], questions: list[dict], model_path: Path, retrieval: Retrieval
) -> list[Case]:
    """Each question with the passages the chat's vector retrieval gives it from
    ``documents``, chunked as on upload, in the chat's order."""
    from webapp.documents.chunking import chunk_text, llm_tokenizer
    from webapp.documents.embeddings import embed_texts

    tokenizer = llm_tokenizer(str(model_path))
    chunks = [
        ((doc, index), chunk.text)
        for doc, text in enumerate(documents)
        for index, chunk in enumerate(
            chunk_text(text, tokenizer=tokenizer, max_tokens=retrieval.chunk_tokens)
        )
    ]
    vectors = torch.tensor(embed_texts([text for _, text in chunks]))
    asked = torch.tensor(embed_texts([q["question"] for q in questions]))
    cases = []
    for item, scores in zip(questions, (asked @ vectors.T).tolist(), strict=True):
        best = sorted(range(len(chunks)), key=lambda i: -scores[i])[: retrieval.top_k]
        kept = [i for i in best if scores[i] >= retrieval.min_score]
        if not kept:  # none kept: the chat answers "not found" without the model
            continue
        if retrieval.grouped:
            kept = [kept[r] for r in keep_neighbours_together([chunks[i][0] for i in kept])]
        where = [chunks[i][0] for i in kept]
        follows = [i > 0 and where[i - 1] == (doc, n - 1) for i, (doc, n) in enumerate(where)]
        passages = [chunks[i][1] for i in kept]
        cases.append(Case(item["question"], item["fact"], passages, follows))
    return cases


def handbook_cases(directory: Path, model_path: Path, retrieval: Retrieval) -> list[Case]:
    """Each handbook question with the passages the chat's vector retrieval would give it."""
    questions = json.loads((directory / "questions.json").read_text())["questions"]
    return retrieved_cases(handbook_texts(directory), questions, model_path, retrieval)


def musique_cases(
    path: Path, first: int, examples: int, model_path: Path, retrieval: Retrieval
) -> list[Case]:
    """Musique as a user's library: each example's passages (title and text) uploaded as
    documents of their own, and its question asked over them alone."""
    cases = []
    for example in json.loads(path.read_text())[first : first + examples]:
        documents = [f"{p['title']}\n{p['text']}" for p in example["ctxs"]]
        question = {"question": example["question"], "fact": example["answers"][0]}
        cases += retrieved_cases(documents, [question], model_path, retrieval)
    return cases


def run_case(model, tokenizer, formats, case: Case, runs, stop_ids) -> dict[str, Any]:
    """Full prefill, then each run, on one question's prompt."""
    base = formats["off"]
    passages = [base.chunk_ids(text) for text in case.passages]
    segments = base.numbered(passages)
    head, question = list(base.head_ids), base.question_ids(case.question)
    chunk_kv, wants_nb = {}, any(kv_name == "nb" for kv_name, *_ in runs.values())
    for name, fmt in formats.items():
        producer = KVProducer(model, fmt.storage_ids)
        storage_kv, plain = producer.head_kv, producer.compute(passages)
        chunk_kv[name] = plain
        if name == "off" and wants_nb:  # each chunk after its predecessor where it has one
            marker = fmt.passage_marker(2)
            chunk_kv["nb"] = [
                precompute_after_previous(model, storage_kv, plain[i - 1], marker, ids)
                if case.follows[i]
                else plain[i]
                for i, ids in enumerate(passages)
            ]
    head_kv = KVProducer(model, head).head_kv
    extra = max(MAX_NEW_TOKENS, GAP_TOKENS)

    def prefill(mode: str, ratio: float, kvs=None, settings: BlendSettings | None = None):
        sources = [None] * len(segments)
        if kvs is not None:
            sources[1::2] = kvs  # the markers are computed, the passages read
        return blend_prefill(
            model,
            head,
            sources,
            question,
            mode=mode,
            recompute_ratio=ratio,
            chunk_ids=segments,
            head_kv=head_kv,
            extra_capacity=extra,
            settings=settings or BlendSettings(),
        )

    full = prefill("full", 0.0)
    answer_ids = greedy_answer(model, full, max(MAX_NEW_TOKENS, GAP_TOKENS), stop_ids)
    forced = answer_ids[:GAP_TOKENS]
    full_answer = without_stop(answer_ids, stop_ids)[:MAX_NEW_TOKENS]
    positions = min(len(full_answer) + 1, TF_TOKENS)
    full_logits = teacher_forced_logits(model, full, forced)
    row = {
        "question": case.question,
        "fact": case.fact,
        "passages": len(passages),
        "follows": sum(case.follows),
        "prompt_tokens": full.num_tokens,
        "runs": {"full": _answer(tokenizer, case, full_answer)},
    }
    for key, (kv_name, mode, ratio, settings) in runs.items():
        result = prefill(mode, ratio, chunk_kv[kv_name], settings)
        metrics = teacher_forced_fidelity(
            teacher_forced_logits(model, result, forced), full_logits, forced, positions
        )
        own = without_stop(greedy_answer(model, result, MAX_NEW_TOKENS, stop_ids), stop_ids)
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
            "tf_kl_mean": statistics.mean(kl),
            "tf_kl_median": statistics.median(kl),
            "tf_kl_p90": quantile(kl, 0.9),
            "tf_agreement": statistics.mean(r["runs"][key]["tf_agreement"] for r in rows),
            "has_fact": sum(r["runs"][key]["has_fact"] for r in rows),
            "lost_fact": sum(
                r["runs"]["full"]["has_fact"] and not r["runs"][key]["has_fact"] for r in rows
            ),
        }
    return out


def plan_runs(
    kv_names: list[str], ratios: list[float], scales: list[float], blend: dict
) -> dict[str, tuple]:
    runs: dict[str, tuple] = {}
    for kv_name in kv_names:
        runs[f"reuse[{kv_name}]"] = (kv_name, "reuse", 0.0, BlendSettings(**blend))
        for ratio in ratios:
            settings = BlendSettings(**blend)
            runs[f"blend@{ratio:.2f}[{kv_name}]"] = (kv_name, "blend", ratio, settings)
    for kv_name in kv_names:
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
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--handbook", type=Path)
    source.add_argument("--musique", type=Path, help="e.g. ../shared/data/musique_dev.json")
    parser.add_argument("--first", type=int, default=0)  # --musique's examples
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument(
        "--order",
        choices=("grouped", "relevance"),
        default="grouped",
        help="grouped: a document's consecutive chunks together, as the chat orders them",
    )
    parser.add_argument(
        "--kv",
        default="off,on",
        help="chunk KV after: off (the head), on (the preamble), nb (the predecessor, "
        "where the prompt has it; else off)",
    )
    parser.add_argument("--chunk-tokens", type=int, default=512)  # CHUNK_TOKENS
    parser.add_argument("--top-k", type=int, default=6)  # RETRIEVAL_TOP_K
    parser.add_argument("--min-score", type=float, default=0.3)  # RETRIEVAL_MIN_SCORE
    parser.add_argument("--ratios", default="0.10,0.15")
    parser.add_argument("--stale-key-scales", default="0.95")
    parser.add_argument(
        "--blend",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a blend_prefill setting for every run, e.g. stale_ramp_tokens=1200 (repeatable)",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from kvservice.model.bundled import resolve_llm_path

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_llm_path(None)
    retrieval = Retrieval(args.chunk_tokens, args.top_k, args.min_score, args.order == "grouped")
    if args.handbook:
        cases = handbook_cases(args.handbook, path, retrieval)
    else:
        cases = musique_cases(args.musique, args.first, args.examples, path, retrieval)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = Transformer.from_pretrained(path, device="cpu", precision=DEFAULT_PRECISION)
    kv_names = [name for name in args.kv.split(",") if name]
    formats = {
        name: PromptFormat.for_tokenizer(tokenizer, preamble=name == "on")
        for name in ("off", "on")
        if name == "off" or name in kv_names
    }
    ratios = [float(r) for r in args.ratios.split(",") if r]
    scales = [float(s) for s in args.stale_key_scales.split(",") if s]
    runs = plan_runs(kv_names, ratios, scales, blend_settings(args.blend))
    stop_ids = stop_token_ids(tokenizer, path)
    rows = []
    for i, case in enumerate(cases):
        rows.append(run_case(model, tokenizer, formats, case, runs, stop_ids))
        brief = {k: round(v["tf_kl"], 4) for k, v in rows[-1]["runs"].items() if "tf_kl" in v}
        print(
            f"[{i + 1}/{len(cases)}] {case.question[:50]!r} follows {sum(case.follows)} {brief}",
            flush=True,
        )
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "questions": len(rows),
        "summary": summary(rows, list(runs)),
        "rows": rows,
    }
    print(json.dumps(report["summary"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
