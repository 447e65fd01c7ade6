"""The retrieval bench's figures (the rest of it needs the database and MiniLM: run it)."""

from __future__ import annotations

from bench.retrieval import Passage, Question, hybrid_rule, keep, measure


def _passage(text: str, similarity: float, coverage: float, sha: str = "") -> Passage:
    return Passage("doc", text, sha or text, similarity, coverage, 0.0)


def test_keep_skips_low_scores_and_repeated_texts_and_stops_at_six() -> None:
    ranked = [
        _passage("low", 0.1, 0.0),
        _passage("a", 0.9, 0.0),
        _passage("a again", 0.9, 0.0, sha="a"),
    ] + [_passage(f"p{i}", 0.5, 0.0) for i in range(10)]
    kept = keep(ranked, lambda p: p.similarity, 0.3)
    assert [p.text for p in kept] == ["a", "p0", "p1", "p2", "p3", "p4"]


def test_the_hybrid_rule_weighs_coverage_by_its_share() -> None:
    verbatim = _passage("Passwords must be at least 14 characters long.", 0.2, 1.0)
    assert hybrid_rule(0.75, 0.475)([verbatim]) == [verbatim]  # 0.05 + 0.75
    assert hybrid_rule(0.0, 0.475)([verbatim]) == []  # cosine alone


def test_recall_needs_every_fact_and_not_found_counts_empty_answers() -> None:
    questions = [
        Question("tune", "two parts?", ("14 characters", "four years")),
        Question("tune", "one part?", ("four years",)),
        Question("tune", "unanswerable?", ()),
        Question("tune", "also unanswerable?", ()),
    ]
    laptops = _passage("Laptops are replaced every four years.", 0.5, 1.0)
    figures = measure(questions, [[laptops], [], [], [laptops]])
    assert (figures.found, figures.answerable) == (0, 2)  # half of one, none of the other
    assert (figures.not_found_right, figures.not_found_said) == (1, 2)
    assert figures.not_found_precision == 0.5 and figures.not_found_recall == 0.5
