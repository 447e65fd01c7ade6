"""Follow-ups and two-part questions measured: is the passage that answers a question asked
second in a conversation ranked first (recall@1) and given to the model at all (recall@6)?

The documents of ``--data`` (tests/data/follow_ups: who to ask, meeting rooms, opening
hours, travel, IT and leave of a made-up institute) are stored one paragraph a chunk, so
that a person's e-mail and the next person's are separate passages, as in longer documents,
embedded with MiniLM, in the dev stack's PostgreSQL (``bench.retrieval.start_database``).
Each pair of ``questions.json`` is asked as the chat asks it: the first question on its
own, then the second, a follow-up ("And what is her e-mail?") or a question of its own,
whose passages are ranked under:

- ``alone``: the second question as in a fresh conversation;
- ``before``: the rule of 0fbca6d: a follow-up searched alone and with the earlier question
  joined on, the passages of both ranked by their relevance score;
- ``after``: ``services._retrieve``'s rule (``follow_ups.follow_up_chunks``, unchanged; a
  question of its own: ``retrieval.retrieve_question``, each part of a question in several).

Printed per kind (follow-up, question of its own) and set (``tune``, ``heldout``): recall@1
and @6 of the answering passage, its rank's mean and median (missing: 7), and how many got a
worse rank than ``before``. The two-part questions: every answerable part's passage among
the 6, before (the whole question searched once) and after (``retrieve_question``), each
part's rank, and the parts named as found in no passage.

``--tune`` also tries another follow-up ranking: a passage's score (the better of the two
searches'), plus ``own`` times its relevance to the question alone, ``topic`` times that to
the earlier question, and ``cited`` if it was the previous answer's first passage (taken as
the one it cited), chosen on the ``tune`` follow-ups, measured on the ``heldout`` ones.

    .venv/bin/python -m bench.follow_ups --json follow_ups.json [--tune]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.retrieval import holds, start_database

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "follow_ups"
TOP_K = 6  # RETRIEVAL_TOP_K's default; a passage not among them ranks TOP_K + 1


@dataclass(frozen=True)
class Pair:
    set: str
    kind: str  # "follow_up" or "standalone"
    first: str
    question: str
    fact: str


@dataclass(frozen=True)
class TwoPart:
    question: str
    facts: tuple[str | None, ...]  # one a part; None: no document answers that part


def load(data: Path) -> tuple[list[Pair], list[TwoPart]]:
    spec = json.loads((data / "questions.json").read_text())
    pairs = [Pair(**row) for row in spec["pairs"]]
    return pairs, [TwoPart(row["question"], tuple(row["facts"])) for row in spec["two_part"]]


def paragraphs(text: str) -> list[str]:
    """A document's chunks here: its paragraphs, less headings."""
    return [p.strip() for p in text.split("\n\n") if p.strip() and not p.startswith("#")]


def store_paragraphs(owner: Any, name: str, texts: Sequence[str]) -> None:
    """One document, each text a chunk, embedded and indexed as ingest does."""
    from django.contrib.postgres.search import SearchVector

    from webapp.documents.embeddings import embed_texts
    from webapp.documents.models import SEARCH_CONFIG, Chunk, Document

    document = Document.objects.create(
        owner=owner,
        title=name,
        status=Document.Status.READY,
        content_sha256=hashlib.sha256("\n\n".join(texts).encode()).hexdigest(),
    )
    Chunk.objects.bulk_create(
        Chunk(
            document=document,
            index=index,
            text=text,
            token_ids=[],
            token_count=0,
            token_ids_sha256=hashlib.sha256(text.encode()).hexdigest(),
            embedding=vector,
        )
        for index, (text, vector) in enumerate(zip(texts, embed_texts(texts), strict=True))
    )
    Chunk.objects.filter(document=document).update(
        search_vector=SearchVector("text", config=SEARCH_CONFIG)
    )


def store_corpus(owner: Any, data: Path) -> int:
    files = sorted(p for p in data.iterdir() if p.suffix in {".md", ".txt"})
    for path in files:
        store_paragraphs(owner, path.name, paragraphs(path.read_text()))
    return len(files)


# --- the rules -------------------------------------------------------------------------------


def alone(user: Any, question: str) -> list[Any]:
    from webapp.chat.retrieval import retrieve_chunks
    from webapp.documents.embeddings import embed_texts

    return retrieve_chunks(
        user=user,
        question=question,
        query_embedding=embed_texts([question])[0],
        top_k=TOP_K,
        min_score=_min_score(),
    )


def before_follow_up(user: Any, question: str, topic: Sequence[str]) -> list[Any]:
    """0fbca6d's ``services._retrieve`` of a follow-up: both searches' passages by score."""
    from webapp.chat.retrieval import retrieve_chunks
    from webapp.documents.embeddings import embed_texts

    queries = [question, "\n".join([*topic, question])]
    best: dict[str, Any] = {}
    for query, vector in zip(queries, embed_texts(queries), strict=True):
        for chunk in retrieve_chunks(
            user=user, question=query, query_embedding=vector, top_k=TOP_K, min_score=_min_score()
        ):
            known = best.get(chunk.token_ids_sha256)
            if known is None or chunk.score > known.score:
                best[chunk.token_ids_sha256] = chunk
    return sorted(best.values(), key=lambda chunk: -chunk.score)[:TOP_K]


def _min_score() -> float:
    from django.conf import settings

    return settings.RETRIEVAL_MIN_SCORE


@dataclass
class Asked:
    """One pair's second question: the texts each rule gave it, best first, and a
    follow-up's candidates (score, own, topic, cited, holds the fact) for ``--tune``."""

    pair: Pair
    is_follow_up: bool
    given: dict[str, list[str]]
    candidates: list[tuple[float, float, float, bool, bool]]


def relevance_of_all(user: Any, question: str) -> dict[int, float]:
    """Every chunk's relevance score to ``question`` (the corpus is small: all are ranked)."""
    from webapp.chat.retrieval import rank_candidates
    from webapp.documents.embeddings import embed_texts

    ranked = rank_candidates(
        user=user, question=question, query_embedding=embed_texts([question])[0], limit=10_000
    )
    return {chunk.id: chunk.score for chunk in ranked}


def ask_pair(user: Any, pair: Pair, with_candidates: bool = False) -> Asked:
    from webapp.chat.follow_ups import follow_up_chunks, topic_questions
    from webapp.chat.retrieval import retrieve_question

    topic = topic_questions([pair.first], pair.question)  # the product's call
    given = {"alone": alone(user, pair.question)}
    candidates: list[tuple[float, float, float, bool, bool]] = []
    if topic:
        given["before"] = before_follow_up(user, pair.question, topic)
        given["after"] = follow_up_chunks(
            user=user, question=pair.question, topic=topic, top_k=TOP_K, min_score=_min_score()
        )
        if with_candidates:
            candidates = follow_up_candidates(user, pair, topic)
    else:  # a question of its own: searched alone before, each part of it after
        given["before"] = given["alone"]
        given["after"] = retrieve_question(
            user=user, question=pair.question, top_k=TOP_K, min_score=_min_score()
        ).chunks
    texts = {rule: [chunk.text for chunk in chunks] for rule, chunks in given.items()}
    return Asked(pair, bool(topic), texts, candidates)


def follow_up_candidates(
    user: Any, pair: Pair, topic: Sequence[str]
) -> list[tuple[float, float, float, bool, bool]]:
    """What the other ranking reads of each passage ``before`` considers (the two searches'
    first 20): its score, its relevance to the question alone and to the topic, whether the
    previous answer's first passage, and whether it holds the fact."""
    from webapp.chat.follow_ups import follow_up_chunks
    from webapp.chat.retrieval import retrieve_question

    found = follow_up_chunks(
        user=user, question=pair.question, topic=topic, top_k=20, min_score=_min_score()
    )
    first = retrieve_question(
        user=user, question=pair.first, top_k=1, min_score=_min_score()
    ).chunks
    own = relevance_of_all(user, pair.question)
    about = relevance_of_all(user, "\n".join(topic))
    return [
        (
            c.score,
            own.get(c.id, 0.0),
            about.get(c.id, 0.0),
            bool(first) and c.id == first[0].id,
            holds(c.text, pair.fact),
        )
        for c in found
    ]


# --- the figures -----------------------------------------------------------------------------

RULES = ["alone", "before", "after"]
OWN_WEIGHTS = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
TOPIC_WEIGHTS = [0.0, 0.1, 0.2, 0.3, 0.5, 1.0]
CITED_WEIGHTS = [0.0, 0.05, 0.1, 0.2]


def rank_of(texts: Sequence[str], fact: str) -> int:
    """The rank (1-based) of the first text holding ``fact``; ``TOP_K + 1`` if none does."""
    return next((at for at, text in enumerate(texts[:TOP_K], 1) if holds(text, fact)), TOP_K + 1)


def figures(ranks: Sequence[int], before: Sequence[int]) -> dict[str, Any]:
    return {
        "questions": len(ranks),
        "recall_at_1": sum(r == 1 for r in ranks),
        f"recall_at_{TOP_K}": sum(r <= TOP_K for r in ranks),
        "mean_rank": round(statistics.mean(ranks), 3) if ranks else None,
        "median_rank": statistics.median(ranks) if ranks else None,
        "worse_than_before": sum(r > b for r, b in zip(ranks, before, strict=True)),
        "better_than_before": sum(r < b for r, b in zip(ranks, before, strict=True)),
    }


def summarize(asked: Sequence[Asked]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per kind and set, per rule: ``figures`` of the answering passage's rank."""
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for kind, set_name in itertools.product(("follow_up", "standalone"), ("tune", "heldout")):
        rows = [a for a in asked if a.pair.kind == kind and a.pair.set == set_name]
        ranks = {rule: [rank_of(a.given[rule], a.pair.fact) for a in rows] for rule in RULES}
        summary[f"{kind} {set_name}"] = {
            rule: figures(ranks[rule], ranks["before"]) for rule in RULES
        }
    return summary


def candidate_rank(
    candidates: Sequence[tuple[float, float, float, bool, bool]],
    weights: tuple[float, float, float],
) -> int:
    """The rank the other ranking gives the first candidate holding the fact."""
    own, topic, cited = weights
    ranked = sorted(candidates, key=lambda c: -(c[0] + own * c[1] + topic * c[2] + cited * c[3]))
    return next((at for at, c in enumerate(ranked[:TOP_K], 1) if c[4]), TOP_K + 1)


def tune(asked: Sequence[Asked]) -> dict[str, Any]:
    """The other ranking's weights (own, topic, cited) that rank the most tuning follow-ups'
    passages first (ties: the least mean rank, then the smallest weights), and what they
    give each set."""
    follow_ups = [a for a in asked if a.candidates]

    def ranks(weights: tuple[float, float, float], set_name: str) -> list[int]:
        return [candidate_rank(a.candidates, weights) for a in follow_ups if a.pair.set == set_name]

    grid = list(itertools.product(OWN_WEIGHTS, TOPIC_WEIGHTS, CITED_WEIGHTS))
    best = min(
        grid,
        key=lambda w: (
            -sum(r == 1 for r in ranks(w, "tune")),
            statistics.mean(ranks(w, "tune")),
            sum(w),
        ),
    )
    return {"weights": dict(zip(("own", "topic", "cited"), best, strict=True))} | {
        set_name: {
            "recall_at_1": sum(r == 1 for r in ranks(best, set_name)),
            f"recall_at_{TOP_K}": sum(r <= TOP_K for r in ranks(best, set_name)),
            "before_recall_at_1": sum(r == 1 for r in ranks((0.0, 0.0, 0.0), set_name)),
            "questions": len(ranks(best, set_name)),
        }
        for set_name in ("tune", "heldout")
    }


def ask_two_part(user: Any, item: TwoPart) -> dict[str, Any]:
    from webapp.chat.retrieval import retrieve_question

    retrieved = retrieve_question(
        user=user, question=item.question, top_k=TOP_K, min_score=_min_score()
    )
    given = {
        "before": [c.text for c in alone(user, item.question)],
        "after": [c.text for c in retrieved.chunks],
    }
    row: dict[str, Any] = {"question": item.question, "facts": list(item.facts)}
    for rule, texts in given.items():
        row[rule] = [rank_of(texts, fact) if fact else None for fact in item.facts]
    row["parts_not_found"] = retrieved.parts_not_found
    return row


def two_part_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    def every_part(rule: str) -> int:
        return sum(all(r is None or r <= TOP_K for r in row[rule]) for row in rows)

    unanswerable = [row for row in rows if None in row["facts"]]
    return {
        "questions": len(rows),
        f"every_answerable_part_in_{TOP_K}": {r: every_part(r) for r in ("before", "after")},
        "with_a_part_no_document_answers": len(unanswerable),
        "that_part_named": sum(len(row["parts_not_found"]) == 1 for row in unanswerable),
        "answerable_parts_named_not_found": sum(
            len(row["parts_not_found"]) - (None in row["facts"]) for row in rows
        ),
    }


# --- the run ---------------------------------------------------------------------------------


def run(
    owner: Any,
    data: Path = DATA,
    limit: int | None = None,
    with_tuning: bool = False,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Store the corpus for ``owner``, ask every pair (the first ``limit`` of each kind and
    of the two-part questions) and return the report."""
    pairs, two_part = load(data)
    if limit is not None:
        pairs = [
            p
            for kind in ("follow_up", "standalone")
            for p in [p for p in pairs if p.kind == kind][:limit]
        ]
        two_part = two_part[:limit]
    documents = store_corpus(owner, data)
    say(f"{documents} documents; {len(pairs)} pairs, {len(two_part)} two-part questions")
    asked = [ask_pair(owner, pair, with_tuning) for pair in pairs]
    report: dict[str, Any] = {
        "top_k": TOP_K,
        "detected_as_follow_up": {
            kind: f"{sum(a.is_follow_up for a in asked if a.pair.kind == kind)}"
            f"/{sum(a.pair.kind == kind for a in asked)}"
            for kind in ("follow_up", "standalone")
        },
        "pairs": summarize(asked),
    }
    for name, by_rule in report["pairs"].items():
        say(f"{name}:")
        for rule, f in by_rule.items():
            say(
                f"  {rule:<22} recall@1 {f['recall_at_1']}/{f['questions']}  recall@{TOP_K} "
                f"{f[f'recall_at_{TOP_K}']}/{f['questions']}  rank mean {f['mean_rank']} "
                f"median {f['median_rank']}  worse {f['worse_than_before']} "
                f"better {f['better_than_before']}"
            )
    rows = [ask_two_part(owner, item) for item in two_part]
    report["two_part"] = two_part_summary(rows)
    say(f"two-part: {json.dumps(report['two_part'])}")
    report["questions"] = [
        {
            **vars(a.pair),
            "detected": a.is_follow_up,
            "ranks": {rule: rank_of(a.given[rule], a.pair.fact) for rule in RULES},
        }
        for a in asked
    ] + rows
    if with_tuning:
        report["other_ranking"] = tune(asked)
        say(f"other follow-up ranking, tuned: {json.dumps(report['other_ranking'])}")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-follow-ups-") as tmp:
        started = start_database(Path(tmp))
        try:
            from django.contrib.auth import get_user_model

            owner = get_user_model().objects.create_user(username="bench")
            report = run(owner, args.data, with_tuning=args.tune)
        finally:
            from deploy.devstack import stop_all

            stop_all(started)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
