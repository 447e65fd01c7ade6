"""Retrieval measured: does the chat find the passage that answers a question, and does it say
"not found" when no document answers it?

The documents of ``--data`` (tests/data/kestrel: an IT policy, an about page, a handbook,
board minutes, safety procedures, a members' guide and a newsletter, in Markdown, HTML and
plain text) and, as distractors, those of ``--distractors`` (other organisations' handbooks
and 20 encyclopedia passages) are parsed and chunked as on upload (``CHUNK_TOKENS``),
embedded with MiniLM and written to the dev stack's services (``deploy.devstack``), started
in a temporary directory, migrated and stopped at exit. Each question of ``questions.json``
is then retrieved as the chat retrieves a question of its own (``webapp.chat.retrieval``,
top 6), under:

- ``vector only``: the MiniLM ranking, kept from cosine 0.3 (the rule the issue assumed);
- ``before``: the rule of 2026-11-24 (e169a3f): the same fused candidates as now but full
  text ranked by ``ts_rank``, each kept from cosine + 0.5 x normalized ``ts_rank`` >= 0.3;
- ``after``: ``retrieve_chunks`` as it is, from ``RETRIEVAL_MIN_SCORE``.

Printed per question set (``tune``: used to choose the share and threshold, ``heldout``:
only measured): recall@6 (an answerable question each of whose ``fact`` strings is in a
kept passage), and "not found" (nothing kept) precision and recall over the unanswerable
ones.
``--tune`` also prints the best full-text shares and thresholds on the tuning set.

    .venv/bin/python -m bench.retrieval --json retrieval.json [--tune]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
DISTRACTORS = [DATA / "handbook", DATA / "station", DATA / "musique_passages.json"]
QUESTION_FILES = {"questions.json", "conversations.json"}
TOP_K = 6
OLD_WEIGHT, OLD_MIN_SCORE = 0.5, 0.3  # e169a3f: cosine + 0.5 x ts_rank / (ts_rank + 1)
VECTOR_MIN_SCORE = 0.3


@dataclass(frozen=True)
class Question:
    set: str
    question: str
    facts: tuple[str, ...]  # each in some passage that answers it; none: no document does

    @property
    def answerable(self) -> bool:
        return bool(self.facts)


@dataclass(frozen=True)
class Passage:
    """One retrieved chunk, as a rule sees it."""

    title: str
    text: str
    sha: str
    similarity: float
    coverage: float  # the term coverage ``retrieve_chunks`` scores (text_rank)
    ts_rank: float  # the normalized ts_rank ``before`` scored


Rule = Callable[[Sequence[Passage]], list[Passage]]


# --- the database ----------------------------------------------------------------------------


def start_database(directory: Path) -> list[Any]:
    """The dev stack's services (PostgreSQL with pgvector, and valkey and the S3 gateway,
    which settings ask for and retrieval never uses) in ``directory``, Django pointed at them
    and migrated. Returns what ``deploy.devstack.stop_all`` stops."""
    from deploy.devstack import start_services

    started, env = start_services(directory)
    os.environ.update(env | {"DATA_DIR": str(directory), "DEBUG": "false", "HTTPS": "false"})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    return started


# --- the corpus ------------------------------------------------------------------------------


def corpus_files(paths: Sequence[Path]) -> list[tuple[str, bytes]]:
    """``(name, bytes)`` of each document under ``paths``: a folder's files but its question
    lists, or a JSON of passages (``{"passages": [...]}``) as one text document."""
    files = []
    for path in paths:
        if path.is_dir():
            files += [
                (p.name, p.read_bytes())
                for p in sorted(path.iterdir())
                if p.name not in QUESTION_FILES
            ]
        else:
            passages = json.loads(path.read_text())["passages"]
            files.append((path.stem + ".txt", "\n\n".join(p.strip() for p in passages).encode()))
    return files


def store_document(owner: Any, name: str, data: bytes) -> int:
    """Parse, chunk and embed ``data`` as ingest does; write its chunks. Returns how many."""
    import hashlib

    from django.conf import settings
    from django.contrib.postgres.search import SearchVector

    from webapp.documents.chunking import chunk_text, llm_tokenizer
    from webapp.documents.embeddings import embed_texts
    from webapp.documents.models import SEARCH_CONFIG, Chunk, Document
    from webapp.documents.parsing import detect_type, parse

    text = parse(data, detect_type(data, name)).text
    chunks = chunk_text(text, tokenizer=llm_tokenizer(), max_tokens=settings.CHUNK_TOKENS)
    document = Document.objects.create(
        owner=owner,
        title=name,
        content_sha256=hashlib.sha256(data).hexdigest(),
        status=Document.Status.READY,
    )
    vectors = embed_texts([chunk.text for chunk in chunks])
    Chunk.objects.bulk_create(
        Chunk(
            document=document,
            index=c.index,
            text=c.text,
            token_ids=c.token_ids,
            token_count=c.token_count,
            token_ids_sha256=c.token_ids_sha256,
            embedding=v,
        )
        for c, v in zip(chunks, vectors, strict=True)
    )
    Chunk.objects.filter(document=document).update(
        search_vector=SearchVector("text", config=SEARCH_CONFIG)
    )
    return len(chunks)


def load_questions(path: Path) -> list[Question]:
    items = json.loads(path.read_text())["questions"]
    # a question list without sets (tests/data/handbook's) is measured only
    return [Question(q.get("set", "heldout"), q["question"], _facts(q["fact"])) for q in items]


def _facts(fact: str | list[str] | None) -> tuple[str, ...]:
    return () if fact is None else (fact,) if isinstance(fact, str) else tuple(fact)


def check_facts(questions: Sequence[Question], texts: Sequence[str]) -> None:
    """Each fact is in some chunk (a typo would read as a retrieval miss)."""
    for question in questions:
        for fact in question.facts:
            if not any(holds(text, fact) for text in texts):
                raise SystemExit(f"no chunk holds {fact!r} ({question.question!r})")


# --- the rules -------------------------------------------------------------------------------


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def holds(text: str, fact: str) -> bool:
    return _normal(fact) in _normal(text)


def holds_any(text: str, question: Question) -> bool:
    return any(holds(text, fact) for fact in question.facts)


def answered(question: Question, kept: Sequence[Passage]) -> bool:
    """Every fact of the question is in a kept passage."""
    return question.answerable and all(
        any(holds(p.text, fact) for p in kept) for fact in question.facts
    )


def keep(
    ranked: Sequence[Passage], score: Callable[[Passage], float], threshold: float
) -> list[Passage]:
    """The first ``TOP_K`` distinct passages scoring ``threshold`` or more, in ranked order
    (``retrieve_chunks``' loop)."""
    from webapp.chat.retrieval import first_distinct

    return first_distinct(ranked, lambda p: p.sha, score, threshold, TOP_K)


def hybrid_rule(share: float, threshold: float) -> Rule:
    """``retrieve_chunks``' rule with another full-text share and threshold."""
    return lambda ranked: keep(
        ranked, lambda p: (1 - share) * p.similarity + share * p.coverage, threshold
    )


def _passage(chunk: Any, ts_rank: float, coverage: float) -> Passage:
    similarity = 0.0 if chunk.distance is None else 1.0 - float(chunk.distance)
    return Passage(
        chunk.document.title, chunk.text, chunk.token_ids_sha256, similarity, coverage, ts_rank
    )


def ts_ranks(user: Any, question: str, limit: int) -> dict[int, float]:
    """The ``limit`` best chunks by normalized ``ts_rank``, best first (what ``before``
    ranked full text by)."""
    from django.contrib.postgres.search import SearchRank
    from django.db.models import F

    from webapp.chat.retrieval import full_text_query, ready_chunks
    from webapp.documents.selectors import EVERYTHING

    query = full_text_query(question)
    if query is None:
        return {}
    rows = (
        ready_chunks(user, EVERYTHING)
        .filter(search_vector=query)
        .annotate(rank=SearchRank(F("search_vector"), query, normalization=32))
        .order_by("-rank", "id")
        .values_list("id", "rank")[:limit]
    )
    return {chunk_id: float(rank) for chunk_id, rank in rows}


def _with_distance(ids: Sequence[int], vector: list[float]) -> list[Any]:
    from pgvector.django import CosineDistance

    from webapp.documents.models import Chunk

    rows = (
        Chunk.objects.select_related("document")
        .annotate(distance=CosineDistance("embedding", vector))
        .in_bulk(ids)
    )
    return [rows[i] for i in ids]


@dataclass
class Retrieved:
    """One question's candidates under each ranking, and what ``after`` kept."""

    fused: list[Passage]  # rank_candidates: vector + full text by coverage
    fused_before: list[Passage]  # vector + full text by ts_rank (before)
    by_vector: list[Passage]
    after: list[Passage]
    after_s: float  # retrieve_chunks' time, the question already embedded


def retrieve(user: Any, question: str) -> Retrieved:
    from django.conf import settings

    from webapp.chat.retrieval import rank_candidates, reciprocal_rank_fusion, retrieve_chunks
    from webapp.documents.embeddings import embed_texts

    vector = embed_texts([question])[0]
    limit = max(TOP_K * 4, 20)  # retrieve_chunks' candidates
    candidates = rank_candidates(user=user, question=question, query_embedding=vector, limit=limit)
    ranks = ts_ranks(user, question, limit)
    by_vector = sorted(
        (c for c in candidates if c.distance is not None), key=lambda c: (-c.similarity, c.id)
    )[:limit]
    before = reciprocal_rank_fusion([[c.id for c in by_vector], list(ranks)])
    started = time.perf_counter()
    after = retrieve_chunks(
        user=user,
        question=question,
        query_embedding=vector,
        top_k=TOP_K,
        min_score=settings.RETRIEVAL_MIN_SCORE,
    )
    after_s = time.perf_counter() - started
    covered = {c.id: c.text_rank for c in candidates}  # only "before" reads other chunks

    def passages(chunks: Sequence[Any]) -> list[Passage]:
        return [_passage(c, ranks.get(c.id, 0.0), covered.get(c.id, 0.0)) for c in chunks]

    return Retrieved(
        fused=passages(candidates),
        fused_before=passages(_with_distance(before, vector)),
        by_vector=passages(by_vector),
        after=passages(after),
        after_s=after_s,
    )


# --- the figures -----------------------------------------------------------------------------


@dataclass
class Figures:
    found: int  # answerable questions whose every fact is in a kept passage
    answerable: int
    not_found_right: int  # unanswerable questions told "not found"
    not_found_said: int  # all questions told "not found"
    unanswerable: int

    @property
    def recall(self) -> float:
        return self.found / self.answerable if self.answerable else 0.0

    @property
    def not_found_precision(self) -> float | None:
        return self.not_found_right / self.not_found_said if self.not_found_said else None

    @property
    def not_found_recall(self) -> float:
        return self.not_found_right / self.unanswerable if self.unanswerable else 0.0

    def line(self, name: str) -> str:
        precision = self.not_found_precision
        shown = "-" if precision is None else f"{precision:.2f}"
        return (
            f"  {name:<12} recall@{TOP_K} {self.recall:.2f} ({self.found}/{self.answerable})"
            f"   not found: precision {shown} ({self.not_found_right}/{self.not_found_said})"
            f", recall {self.not_found_recall:.2f} ({self.not_found_right}/{self.unanswerable})"
        )


def measure(questions: Sequence[Question], kept: Sequence[list[Passage]]) -> Figures:
    found = sum(answered(q, k) for q, k in zip(questions, kept, strict=True))
    said = [not k for k in kept]
    right = sum(s and not q.answerable for q, s in zip(questions, said, strict=True))
    unanswerable = sum(not q.answerable for q in questions)
    return Figures(found, len(questions) - unanswerable, right, sum(said), unanswerable)


def rules() -> dict[str, Callable[[Retrieved], list[Passage]]]:
    return {
        "vector only": lambda r: keep(r.by_vector, lambda p: p.similarity, VECTOR_MIN_SCORE),
        "before": lambda r: keep(
            r.fused_before, lambda p: p.similarity + OLD_WEIGHT * p.ts_rank, OLD_MIN_SCORE
        ),
        "after": lambda r: r.after,
    }


THRESHOLDS = [step / 1000 for step in range(100, 1001, 5)]
SMOOTHING = 5  # thresholds either side (+-0.025) averaged into a threshold's objective


def tune(questions: Sequence[Question], retrieved: Sequence[Retrieved]) -> list[dict]:
    """Every (full-text share, threshold) of a grid on the tuning questions, best first. The
    objective is the mean of recall@6 and "not found" recall, averaged over the thresholds
    within +-0.025 (a step function of 50 questions peaks on knife edges, one question
    either side: a threshold good on its neighbours too is the one to ship), then the
    objective at the threshold itself, then the smaller share."""
    rows = []
    for share in [step / 20 for step in range(0, 21)]:
        figures = []
        for threshold in THRESHOLDS:
            rule = hybrid_rule(share, threshold)
            figures.append(measure(questions, [rule(r.fused) for r in retrieved]))
        objectives = [(f.recall + f.not_found_recall) / 2 for f in figures]
        for at, threshold in enumerate(THRESHOLDS):
            near = objectives[max(0, at - SMOOTHING) : at + SMOOTHING + 1]
            rows.append(
                {
                    "share": share,
                    "threshold": threshold,
                    "smoothed": round(sum(near) / len(near), 4),
                    "objective": round(objectives[at], 4),
                    **asdict(figures[at]),
                }
            )
    # to two decimals: closer than that is less than one question of either kind apart
    return sorted(rows, key=lambda row: (-round(row["smoothed"], 2), -row["objective"]))


def _json(report: dict) -> str:
    """The report, indented, one question a line."""
    questions = report.pop("questions")
    head = json.dumps(report, indent=1, ensure_ascii=False)[: -len("\n}")]
    lines = ",\n".join("  " + json.dumps(q, ensure_ascii=False) for q in questions)
    return f'{head},\n "questions": [\n{lines}\n ]\n}}\n'


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA / "kestrel")
    parser.add_argument("--distractors", type=Path, nargs="*", default=DISTRACTORS)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-retrieval-") as tmp:
        started = start_database(Path(tmp))
        try:
            report = run(args)
        finally:
            from deploy.devstack import stop_all

            stop_all(started)
    if args.json:
        args.json.write_text(_json(report))
        print(f"wrote {args.json}")
    return 0


def run(args: argparse.Namespace) -> dict:
    from django.conf import settings
    from django.contrib.auth import get_user_model

    from webapp.chat.retrieval import FULL_TEXT_SHARE
    from webapp.documents.models import Chunk

    owner = get_user_model().objects.create_user(username="bench")
    files = corpus_files([args.data, *args.distractors])
    chunks = sum(store_document(owner, name, data) for name, data in files)
    questions = load_questions(args.data / "questions.json")
    check_facts(questions, list(Chunk.objects.values_list("text", flat=True)))
    print(
        f"{len(files)} documents, {chunks} chunks; {len(questions)} questions; after: "
        f"{1 - FULL_TEXT_SHARE:.2f} x cosine + {FULL_TEXT_SHARE} x coverage >= "
        f"{settings.RETRIEVAL_MIN_SCORE}"
    )
    retrieved = [retrieve(owner, q.question) for q in questions]
    took = statistics.median(r.after_s for r in retrieved)
    print(f"retrieve_chunks: median {took * 1000:.0f} ms a question")
    report: dict[str, Any] = {
        "documents": len(files),
        "chunks": chunks,
        "top_k": TOP_K,
        "retrieve_median_s": round(took, 4),
        "passage_columns": PASSAGE_COLUMNS,
        "full_text_share": FULL_TEXT_SHARE,
        "min_score": settings.RETRIEVAL_MIN_SCORE,
        "sets": {},
    }
    for name in ("tune", "heldout"):
        picked = [i for i, q in enumerate(questions) if q.set == name]
        subset = [questions[i] for i in picked]
        if not subset:
            continue
        print(f"{name} ({len(subset)} questions):")
        report["sets"][name] = {}
        for rule_name, rule in rules().items():
            figures = measure(subset, [rule(retrieved[i]) for i in picked])
            print(figures.line(rule_name))
            precision = figures.not_found_precision
            report["sets"][name][rule_name] = asdict(figures) | {
                "recall": round(figures.recall, 3),
                "not_found_recall": round(figures.not_found_recall, 3),
                "not_found_precision": None if precision is None else round(precision, 3),
            }
    report["questions"] = [_question_row(q, r) for q, r in zip(questions, retrieved, strict=True)]
    if args.tune:
        picked = [i for i, q in enumerate(questions) if q.set == "tune"]
        best = tune([questions[i] for i in picked], [retrieved[i] for i in picked])
        report["tuning"] = best[:20]
        print("tuning, best first (full-text share, threshold, objective +-0.025 and at it):")
        for row in best[:10]:
            print(
                f"  share {row['share']:.2f} threshold {row['threshold']:.3f} objective "
                f"{row['smoothed']:.3f} ({row['objective']:.3f}): found {row['found']}/"
                f"{row['answerable']}, not found {row['not_found_right']}/"
                f"{row['unanswerable']} (said {row['not_found_said']})"
            )
    return report


PASSAGE_COLUMNS = ["document", "similarity", "coverage", "ts_rank", "holds_fact"]


def _question_row(question: Question, retrieved: Retrieved) -> dict:
    """What each rule kept, and the candidates holding a fact (``PASSAGE_COLUMNS``)."""

    def rows(passages: Sequence[Passage]) -> list[list]:
        return [
            [
                p.title,
                round(p.similarity, 3),
                round(p.coverage, 3),
                round(p.ts_rank, 3),
                holds_any(p.text, question),
            ]
            for p in passages
        ]

    row: dict[str, Any] = asdict(question)
    row |= {name: rows(rule(retrieved)) for name, rule in rules().items()}
    row["answering"] = rows([p for p in retrieved.fused if holds_any(p.text, question)])
    return row


if __name__ == "__main__":
    sys.exit(main())
