"""What the user reads, measured: loops, inline citations and honest "not found", with the
product's prompt (numbered passages) and decoding (``kvservice.serve.answer``), on the bundled
model in full prefill (what the answer says, not how fast; blending changes little of it).

Two question sets:

- ``--handbook DIR``: the documents of DIR (parsed as on upload, one passage each) and its
  ``questions.json`` (a ``fact`` per question, null when the handbook does not say). Passages
  are ranked by MiniLM cosine and kept from ``--min-score`` on, as the chat's retrieval does
  (``RETRIEVAL_MIN_SCORE``); none kept is the "not found" answer, without generation.
- ``--musique FILE``: the paper's Musique examples, their passages numbered as given.

Printed: loop rate, inline-citation rate (a valid [n] marker), the rate of answers citing a
passage that holds the fact, "not found" precision and recall; ``--json`` writes each answer.

    .venv/bin/python -m bench.answers --handbook tests/data/handbook --json out.json
    .venv/bin/python -m bench.answers --musique ../shared/data/musique_dev.json \\
        --examples 20
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.data import passage_texts
from kvservice.serve.citing import cited_ranks, says_not_found, verdict

_WORD = re.compile(r"\w+", re.UNICODE)
LOOP_NGRAM, LOOP_REPEATS = 6, 3


def loops(text: str) -> bool:
    """An answer loops when some run of ``LOOP_NGRAM`` words comes back ``LOOP_REPEATS``
    times (a sentence said over and over, the failure users saw)."""
    words = _WORD.findall(text.lower())
    counts: dict[tuple[str, ...], int] = {}
    for at in range(len(words) - LOOP_NGRAM + 1):
        gram = tuple(words[at : at + LOOP_NGRAM])
        counts[gram] = counts.get(gram, 0) + 1
        if counts[gram] >= LOOP_REPEATS:
            return True
    return False


@dataclass
class Case:
    question: str
    passages: list[str]
    fact: str | None  # None: the answer is not in the documents


@dataclass
class Outcome:
    question: str
    fact: str | None
    answer: str
    passages: int
    finish_reason: str
    tokens: int
    seconds: float
    loops: bool
    model_cited: bool  # the model wrote a valid [n] itself
    citation: str  # kvservice.serve.citing.verdict's "model", "attributed", ...
    cited: list[int]
    cites_fact: bool
    not_found: bool


def handbook_texts(directory: Path) -> list[str]:
    """The text of every document in ``directory`` (all but ``questions.json``), parsed as
    on upload, in name order."""
    from webapp.documents.parsing import detect_type, parse

    texts = []
    for path in sorted(directory.iterdir()):
        if path.name != "questions.json":
            data = path.read_bytes()
            texts.append(parse(data, detect_type(data, path.name)).text)
    return texts


def handbook_cases(directory: Path, min_score: float) -> list[Case]:
    from webapp.documents.embeddings import embed_texts

    texts = handbook_texts(directory)
    questions = json.loads((directory / "questions.json").read_text())["questions"]
    doc_vectors = embed_texts(texts)
    cases = []
    for item, vector in zip(
        questions, embed_texts([q["question"] for q in questions]), strict=True
    ):
        scores = [sum(a * b for a, b in zip(vector, doc, strict=True)) for doc in doc_vectors]
        order = sorted(range(len(texts)), key=lambda i: -scores[i])
        kept = [texts[i] for i in order if scores[i] >= min_score]
        cases.append(Case(item["question"], kept, item["fact"]))
    return cases


def musique_cases(path: Path, examples: int, passages: int) -> list[Case]:
    cases = []
    for example in json.loads(path.read_text())[:examples]:  # the prefill bench's format
        texts = passage_texts(example, passages)
        lowered = [t.lower() for t in texts]
        fact = next((a for a in example["answers"] if any(a.lower() in t for t in lowered)), None)
        cases.append(Case(example["question"], texts, fact))
    return cases


def run(cases: list[Case], engine: Any, sampling: Any) -> list[Outcome]:
    from kvservice.protocol.prompt import Prompt
    from kvservice.serve.engine import Request

    fmt, outcomes = engine.format, []
    for case in cases:
        started = time.perf_counter()
        if not case.passages:  # the chat's "not found" path: nothing is generated
            text, finish, tokens = "I could not find this in your documents.", "stop", 0
        else:
            segments = fmt.numbered([fmt.chunk_ids(t) for t in case.passages])
            prompt = Prompt(list(fmt.head_ids), segments, fmt.question_ids(case.question))
            sources = [None] * len(segments)  # none cached: full prefill computes them
            completion = engine.generate(Request(prompt, sources, "full", 1.0, sampling))
            text, finish = completion.text, completion.finish_reason
            tokens = len(completion.token_ids)
        model_cited = bool(cited_ranks(text, len(case.passages)))
        how = "not_found"
        if case.passages:  # the worker's verdict: the [n] of the supporting passage, or "not found"
            judged = verdict(text, case.passages, case.question)
            text, how = judged.text, judged.citation
        cited = cited_ranks(text, len(case.passages))
        fact = (case.fact or "").lower()
        outcome = Outcome(
            question=case.question,
            fact=case.fact,
            answer=text,
            passages=len(case.passages),
            finish_reason=finish,
            tokens=tokens,
            seconds=round(time.perf_counter() - started, 2),
            loops=loops(text),
            model_cited=model_cited,
            citation=how,
            cited=cited,
            cites_fact=bool(fact) and any(fact in case.passages[r - 1].lower() for r in cited),
            not_found=says_not_found(text),
        )
        print(json.dumps(asdict(outcome))[:300], flush=True)
        outcomes.append(outcome)
    return outcomes


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    def rate(part: int, whole: int) -> float | None:
        return round(part / whole, 3) if whole else None

    answered = [o for o in outcomes if not o.not_found]
    absent = [o for o in outcomes if o.fact is None]
    said_not_found = [o for o in outcomes if o.not_found]
    present = [o for o in outcomes if o.fact is not None]
    return {
        "answers": len(outcomes),
        "loop_rate": rate(sum(o.loops for o in outcomes), len(outcomes)),
        "cut_at_length": sum(o.finish_reason == "length" for o in outcomes),
        "inline_citation_rate": rate(sum(bool(o.cited) for o in answered), len(answered)),
        "model_citation_rate": rate(sum(o.model_cited for o in answered), len(answered)),
        "cites_fact_rate": rate(sum(o.cites_fact for o in present), len(present)),
        "grounded_or_not_found": rate(
            sum(o.cites_fact or o.not_found for o in outcomes), len(outcomes)
        ),
        "not_found_precision": rate(
            sum(o.fact is None for o in said_not_found), len(said_not_found)
        ),
        "not_found_recall": rate(sum(o.not_found for o in absent), len(absent)),
        "mean_tokens": rate(sum(o.tokens for o in outcomes), len(outcomes)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--handbook", type=Path)
    source.add_argument("--musique", type=Path)
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--min-score", type=float, default=0.3)  # RETRIEVAL_MIN_SCORE
    parser.add_argument("--max-tokens", type=int, default=160)  # CHAT_MAX_NEW_TOKENS
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--frequency-penalty", type=float, default=None)
    parser.add_argument("--only", default="", help="question numbers, e.g. 1,9 (from 0)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from kvservice.blend.planning import FREQUENCY_PENALTY, REPETITION_PENALTY
    from kvservice.model.bundled import resolve_llm_path
    from kvservice.model.sampling import SamplingParams
    from kvservice.model.transformer import Transformer
    from kvservice.protocol.prompt import TURN_MARKERS, PromptFormat
    from kvservice.serve.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.handbook:
        cases = handbook_cases(args.handbook, args.min_score)
    else:
        cases = musique_cases(args.musique, args.examples, args.passages)
    if args.only:
        cases = [cases[int(i)] for i in args.only.split(",")]
    path = resolve_llm_path(None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = Engine(
        Transformer.from_pretrained(path, device="cpu"),
        tokenizer,
        PromptFormat.for_tokenizer(tokenizer),
    )
    penalty = REPETITION_PENALTY if args.repetition_penalty is None else args.repetition_penalty
    frequency = FREQUENCY_PENALTY if args.frequency_penalty is None else args.frequency_penalty
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        repetition_penalty=penalty,
        frequency_penalty=frequency,
        stop=TURN_MARKERS,
    )
    try:
        outcomes = run(cases, engine, sampling)
    finally:
        engine.close()  # its batcher thread
    chosen = {"repetition_penalty": penalty, "frequency_penalty": frequency}
    result = {"settings": vars(args) | chosen, **summary(outcomes)}
    print(json.dumps({k: v for k, v in result.items() if k != "settings"}, indent=1))
    if args.json:
        result["settings"] = {k: str(v) for k, v in result["settings"].items()}
        result["outcomes"] = [asdict(o) for o in outcomes]
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
