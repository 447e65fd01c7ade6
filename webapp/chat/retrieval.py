"""Hybrid retrieval over the ready chunks a user may read (their own, or a conversation's
scope): pgvector cosine and PostgreSQL full text, fused by reciprocal rank, deduplicated by
content, and kept only from a relevance score on.

Reciprocal-rank fusion orders chunks but says nothing of how relevant the best one is (the
first of five unrelated chunks is still first), so each chunk also gets an absolute score,
``relevance``: its cosine similarity to the question and its term coverage, weighted 1/4 and
3/4 (``FULL_TEXT_SHARE``). Coverage is the share of the question's words (stemmed, no stop
words) that the chunk holds, each word weighted by its rarity among the chunks the user may
read (BM25's inverse document frequency); for a question in two parts, that of the part the
chunk covers best. A word no readable chunk holds ("football") counts as the rarest and is
missing, so an unrelated question sharing only the documents' common words ("cooperative")
scores low, and a passage stating the question's words ("How long must passwords be?")
scores high even where MiniLM's cosine to a 512-token chunk is 0.2.

Measured with bench/retrieval.py on tests/data/kestrel, held-out questions (docs/retrieval.md,
2026-11-27): the rule before (cosine + 0.5 x ``ts_rank`` normalized to 0..1, from 0.3) gave
the answering passage within 6 for 25 of 36 questions and said "not found" to 6 of 12 that
no document answers, and 4 times to a question it could have answered; this one gives 31 of
36, 6 of 12, and 2. ``ts_rank`` knows no word's rarity and gave a verbatim match 0.03-0.07:
too little to lift a long chunk's cosine over the bar. The share and the threshold
(``RETRIEVAL_MIN_SCORE``) were chosen on the tuning questions only (``--tune``)."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from django.contrib.postgres.search import SearchQuery, SearchRank
from django.db import connection, transaction
from django.db.models import Case, Count, Expression, F, FloatField, Q, QuerySet, Value, When
from django.db.models.functions import Greatest
from pgvector.django import CosineDistance

from webapp.documents.embeddings import embed_texts
from webapp.documents.models import SEARCH_CONFIG, Chunk, Document
from webapp.documents.selectors import EVERYTHING, Scope, documents_searchable

T = TypeVar("T")

RRF_K = 60  # the usual constant of reciprocal-rank fusion
FULL_TEXT_SHARE = 0.75  # chosen on the tuning questions (module doc)
_WORD = re.compile(r"\w{2,}", re.UNICODE)
# Stemmed words that ask for a kind of answer ("how much", "how many", "how often") rather
# than name what it is about, and that PostgreSQL's English stop words keep: a passage states
# "every four years", not "often", and a word no passage holds counts as the rarest.
QUESTION_WORDS = frozenset({"much", "mani", "often"})
# An ordinal asks for an item of a numbered list, which states the number ("3. Sign the
# sheet"), not the word: "third" is found as either, one term of the question ("third|3"),
# the number only where it starts a line as a list's does (not "day 3" in a sentence).
# The noun it counts ("the third step") names the kind of answer, as QUESTION_WORDS do: a
# list says "3.", not "step", and a missing word counts as the rarest.
ORDINAL_WORDS = (
    "first second third fourth fifth sixth seventh eighth ninth tenth eleventh "
    "twelfth thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth "
    "nineteenth twentieth"
).split()
_NUMBERED_ORDINAL = re.compile(r"(\d{1,4})(?:st|nd|rd|th)", re.IGNORECASE)  # "3rd"
_COUNTED_NOUN = re.compile(
    rf"\b((?:{'|'.join(ORDINAL_WORDS)}|\d{{1,4}}(?:st|nd|rd|th))\s+)"
    r"(?:step|item|point|stage|task|instruction|entry|phase|thing)s?\b",
    re.IGNORECASE,
)
EITHER = "|"  # between the forms of one term: "third|3"
# Where a question asks a second thing ("Which moon has an ocean, and which rice goes into a
# risotto?", "When does it open and does it have a cafe?"): a passage answering one part holds
# half the words, and is scored on that part. A second yes/no question is told from a plain
# "and" by its verb and subject ("and is there", "and can I"; not "cats and dogs").
_SECOND_QUESTION = (
    r"(?:who|what|when|where|which|why|how)\b"
    r"|(?:is|are|was|were|does|do|did|can|could|will|would|should|has|have|may|must)\s+"
    r"(?:it|there|they|she|he|i|we|you|the|a|an|this|that|these|those|my|our|your|its)\b"
)
_CLAUSE_BREAK = re.compile(
    rf"[?!;]+\s+|,\s*(?:and|or|but)\s+|\s+and\s+(?=(?:{_SECOND_QUESTION}))", re.IGNORECASE
)


def ready_chunks(user, scope: Scope) -> QuerySet[Chunk]:
    return Chunk.objects.filter(
        document__in=documents_searchable(user=user, scope=scope),
        document__status=Document.Status.READY,
    )


def has_ready_chunks(user, scope: Scope = EVERYTHING) -> bool:
    return ready_chunks(user, scope).exists()


def full_text_query(question: str) -> SearchQuery | None:
    """Any of the question's words (websearch syntax: ``a or b``); an AND of every word of a
    natural-language question would rarely match anything."""
    words = _WORD.findall(question)
    if not words:
        return None
    words += [number for number in map(ordinal_number, words) if number]
    return SearchQuery(" or ".join(words), search_type="websearch", config=SEARCH_CONFIG)


def question_parts(question: str) -> list[str]:
    """The parts of a question that asks several things (most ask one: itself)."""
    return [part.strip() for part in _CLAUSE_BREAK.split(question) if part.strip()]


def question_clauses(question: str) -> list[list[str]]:
    """Each part of the question (most have one) as its words stand in the full-text index
    (stemmed, no stop words), less ``QUESTION_WORDS``; parts without such words left out."""
    parts = question_parts(question)
    if not parts:
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tsvector_to_array(to_tsvector(%s::regconfig, part))"
            " FROM unnest(%s::text[]) WITH ORDINALITY AS parts(part, at) ORDER BY at",
            [SEARCH_CONFIG, [_COUNTED_NOUN.sub(r"\1", part) for part in parts]],
        )
        clauses = [[_either(t) for t in terms if t not in QUESTION_WORDS] for (terms,) in cursor]
    return [terms for terms in clauses if terms]


def ordinal_number(word: str) -> str | None:
    """The number an ordinal stands for ("third", "3rd": "3"); None for any other word."""
    word = word.lower()
    if word in ORDINAL_WORDS:
        return str(ORDINAL_WORDS.index(word) + 1)
    numbered = _NUMBERED_ORDINAL.fullmatch(word)
    return numbered.group(1) if numbered else None


def _either(term: str) -> str:
    number = ordinal_number(term)
    return f"{term}{EITHER}{number}" if number else term


def _holds(term: str) -> Q:
    # 'simple' leaves a stemmed term as it is (no second stemming, no stop words)
    word, _, number = term.partition(EITHER)
    holds = Q(search_vector=SearchQuery(word, config="simple"))
    if number:  # an ordinal (``_either``): the word, or the number that starts a list's line
        holds |= Q(text__regex=rf"(^|\n)[ \t]*{number}[.)][ \t]")
    return holds


def term_weights(chunks: QuerySet[Chunk], terms: Sequence[str]) -> dict[str, float]:
    """Each term's BM25 inverse document frequency among ``chunks``: ln(1 + (N - n + 0.5) /
    (n + 0.5)) for n of N chunks holding it, n at least 1: a term no chunk holds weighs as
    much as the rarest that one does, not more (in a scope of one chunk it would otherwise
    weigh 4.8 times a term the chunk holds, and one missing word outweigh two found). One
    pass over the chunks, counting every term."""
    if not terms:
        return {}
    counts = chunks.aggregate(
        total=Count("id"),
        **{f"t{i}": Count("id", filter=_holds(term)) for i, term in enumerate(terms)},
    )
    total = max(counts["total"], 1)
    holding = [max(counts[f"t{i}"], 1) for i in range(len(terms))]
    return {
        term: math.log(1 + (total - n + 0.5) / (n + 0.5))
        for term, n in zip(terms, holding, strict=True)
    }


def _share(weights: Mapping[str, float], terms: Sequence[str]) -> Expression:
    whole = sum(weights[term] for term in terms)
    parts = [
        Case(
            When(_holds(term), then=Value(weights[term] / whole)),
            default=Value(0.0),
            output_field=FloatField(),
        )
        for term in terms
    ]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def coverage(weights: Mapping[str, float], clauses: Sequence[Sequence[str]]) -> Expression:
    """SQL: the weighted share (0..1) of a question part's terms that a chunk holds, for the
    part it covers best."""
    shares = [_share(weights, terms) for terms in clauses]
    if not shares:
        return Value(0.0, output_field=FloatField())
    return shares[0] if len(shares) == 1 else Greatest(*shares, output_field=FloatField())


def relevance(similarity: float, text_rank: float) -> float:
    """The score the relevance threshold (``RETRIEVAL_MIN_SCORE``) applies to."""
    return (1 - FULL_TEXT_SHARE) * similarity + FULL_TEXT_SHARE * text_rank


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], k: int = RRF_K) -> list[int]:
    """Ids ordered by sum over rankings of 1/(k + rank); ties keep first-seen order."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k + rank)
    return sorted(scores, key=lambda item: -scores[item])


def _by_vector(chunks: QuerySet[Chunk], embedding: list[float], limit: int) -> list[int]:
    """The ``limit`` chunks nearest the question. Where PostgreSQL walks the HNSW index (all
    users' chunks), the readable ones are filtered from what the walk returns: by default at
    most ``hnsw.ef_search`` (40) rows, which other users' chunks, or rows deleted and not yet
    vacuumed, can fill, leaving the user none. An iterative scan (pgvector 0.8) walks on
    until ``limit`` rows pass the filter, in order of distance, or ``hnsw.max_scan_tuples``
    (20,000) were visited; the exact scan of the user's chunks, which the planner picks
    while they are few, is unchanged."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL hnsw.iterative_scan = strict_order")
        ef_search = min(max(limit, 40), 1000)  # pgvector's default and its largest
        cursor.execute("SELECT set_config('hnsw.ef_search', %s, true)", [str(ef_search)])
        return list(
            chunks.exclude(embedding=None)
            .order_by(CosineDistance("embedding", embedding), "id")
            .values_list("id", flat=True)[:limit]
        )


def _by_text(chunks: QuerySet[Chunk], question: str, covered: Expression, limit: int) -> list[int]:
    """Chunks holding any of the question's words (the GIN index), best ``covered`` first,
    then by ``ts_rank`` (normalization 32: rank / (rank + 1))."""
    query = full_text_query(question)
    if query is None:
        return []
    return list(
        chunks.filter(search_vector=query)
        .annotate(covered=covered, rank=SearchRank(F("search_vector"), query, normalization=32))
        .order_by("-covered", "-rank", "id")
        .values_list("id", flat=True)[:limit]
    )


def rank_candidates(
    *,
    user,
    question: str,
    query_embedding: Sequence[float],
    limit: int,
    scope: Scope = EVERYTHING,
) -> list[Chunk]:
    """Up to ``limit`` chunks by vector and up to ``limit`` by full text, fused by reciprocal
    rank, best first, each carrying ``similarity`` (cosine), ``text_rank`` (term coverage,
    0..1) and ``score`` (their mean, weighted by ``FULL_TEXT_SHARE``). No threshold."""
    chunks = ready_chunks(user, scope)
    embedding = list(query_embedding)
    clauses = question_clauses(question)
    terms = list(dict.fromkeys(term for clause in clauses for term in clause))
    covered = coverage(term_weights(chunks, terms), clauses)
    fused = reciprocal_rank_fusion(
        [_by_vector(chunks, embedding, limit), _by_text(chunks, question, covered, limit)]
    )
    rows = (
        Chunk.objects.select_related("document")
        .annotate(distance=CosineDistance("embedding", embedding), covered=covered)
        .in_bulk(fused)
    )
    ranked = [rows[chunk_id] for chunk_id in fused]
    for chunk in ranked:
        chunk.similarity = 0.0 if chunk.distance is None else 1.0 - float(chunk.distance)
        chunk.text_rank = float(chunk.covered)
        chunk.score = relevance(chunk.similarity, chunk.text_rank)
    return ranked


def retrieve_chunks(
    *,
    user,
    question: str,
    query_embedding: Sequence[float],
    top_k: int,
    min_score: float = 0.0,
    scope: Scope = EVERYTHING,
) -> list[Chunk]:
    """The ``top_k`` most relevant chunks the user may read within ``scope`` (by default all
    of their own), in fused order, one per distinct text, whose score reaches ``min_score``
    (see :func:`rank_candidates` for what each carries)."""
    candidates = rank_candidates(
        user=user,
        question=question,
        query_embedding=query_embedding,
        limit=max(top_k * 4, 20),
        scope=scope,
    )
    # the same text in two documents is cited once
    return first_distinct(
        candidates, lambda c: c.token_ids_sha256, lambda c: c.score, min_score, top_k
    )


@dataclass
class Retrieved:
    """A question's passages, best first, and the parts of a question in several parts that
    no passage answers (their own search kept none), to be named in the answer."""

    chunks: list[Chunk]
    parts_not_found: list[str] = field(default_factory=list)


def retrieve_question(
    *, user, question: str, top_k: int, min_score: float = 0.0, scope: Scope = EVERYTHING
) -> Retrieved:
    """:func:`retrieve_chunks` for the question; one that asks several things ("When does the
    office open and who do I call for keys?") is also searched part by part, and the parts'
    passages are taken in turn, each part's best first, then the whole question's: searched
    whole, one part's several close passages filled the places, and the other part's
    passage was not among them (tests/data/follow_ups, bench/follow_ups.py)."""
    parts = [part for part in question_parts(question) if question_clauses(part)]
    queries = [question, *parts] if len(parts) > 1 else [question]
    vectors = embed_texts(queries)
    found = [
        retrieve_chunks(
            user=user,
            question=query,
            query_embedding=vector,
            top_k=top_k,
            min_score=min_score,
            scope=scope,
        )
        for query, vector in zip(queries, vectors, strict=True)
    ]
    if len(found) == 1:
        return Retrieved(found[0])
    in_turn = itertools.chain.from_iterable(itertools.zip_longest(*found[1:], found[0]))
    chunks = first_distinct(
        (c for c in in_turn if c is not None),
        lambda c: c.token_ids_sha256,
        lambda c: c.score,
        min_score,
        top_k,
    )
    return Retrieved(
        chunks, [part for part, kept in zip(parts, found[1:], strict=True) if not kept]
    )


def first_distinct(
    ranked: Iterable[T],
    text_of: Callable[[T], str],
    score_of: Callable[[T], float],
    min_score: float,
    limit: int,
) -> list[T]:
    """The first ``limit`` of ``ranked`` with distinct texts (``text_of``: an identity of the
    text) whose score reaches ``min_score``, in ranked order: how retrieval keeps passages,
    and how ``bench/retrieval.py`` measures a rule."""
    kept: list[T] = []
    seen: set[str] = set()
    for item in ranked:
        if text_of(item) in seen or score_of(item) < min_score:
            continue
        seen.add(text_of(item))
        kept.append(item)
        if len(kept) == limit:
            break
    return kept
