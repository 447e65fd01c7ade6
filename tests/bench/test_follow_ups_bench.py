"""The follow-up bench's figures, and its tiny run on the first questions of
tests/data/follow_ups in the test database (the whole run: ``python -m bench.follow_ups``)."""

from __future__ import annotations

import pytest

from bench.follow_ups import TOP_K, candidate_rank, figures, rank_of, run, two_part_summary


def test_the_rank_is_that_of_the_first_passage_holding_the_fact() -> None:
    texts = ["Her extension is 214.", "Her e-mail is dana@harwick.org.", "dana@harwick.org"]
    assert rank_of(texts, "DANA@harwick.org") == 2
    assert rank_of(texts, "omar@harwick.org") == TOP_K + 1
    assert rank_of(["x"] * TOP_K + ["dana@harwick.org"], "dana@harwick.org") == TOP_K + 1


def test_figures_count_recall_and_what_got_worse_or_better() -> None:
    counted = figures([1, 3, TOP_K + 1, 2], before=[1, 1, 2, 5])
    assert counted["recall_at_1"] == 1 and counted[f"recall_at_{TOP_K}"] == 3
    assert counted["median_rank"] == 2.5 and counted["mean_rank"] == 3.25
    assert counted["worse_than_before"] == 2 and counted["better_than_before"] == 1


def test_the_other_ranking_adds_its_weights_to_the_score() -> None:
    # (score, own, topic, cited, holds the fact): the answer scores less than a passage on
    # the topic alone, and more on the question alone
    candidates = [(0.9, 0.3, 0.9, True, False), (0.85, 0.8, 0.5, False, True)]
    assert candidate_rank(candidates, (0.0, 0.0, 0.0)) == 2
    assert candidate_rank(candidates, (1.0, 0.0, 0.0)) == 1
    assert candidate_rank(candidates, (1.0, 0.0, 0.5)) == 2  # the cited one, favoured


def test_two_part_summary_counts_parts_found_and_named() -> None:
    rows = [
        {"facts": ["a", "b"], "before": [1, TOP_K + 1], "after": [1, 2], "parts_not_found": []},
        {
            "facts": ["a", None],
            "before": [1, None],
            "after": [1, None],
            "parts_not_found": ["where can I park?"],
        },
    ]
    summary = two_part_summary(rows)
    assert summary[f"every_answerable_part_in_{TOP_K}"] == {"before": 1, "after": 2}
    assert summary["that_part_named"] == 1 and summary["answerable_parts_named_not_found"] == 0


@pytest.mark.django_db
def test_a_tiny_run_finds_the_follow_ups_passage_that_the_question_alone_misses(
    django_user_model,
) -> None:
    owner = django_user_model.objects.create_user(username="bench")
    report = run(owner, limit=2, with_tuning=True, say=lambda line: None)
    first = report["pairs"]["follow_up tune"]  # "And what is her e-mail?" after the officer
    assert first["alone"]["recall_at_1"] == 0 and first["after"]["recall_at_1"] == 1
    assert report["detected_as_follow_up"] == {"follow_up": "2/2", "standalone": "0/2"}
    assert report["pairs"]["standalone tune"]["after"]["worse_than_before"] == 0
    assert report["two_part"][f"every_answerable_part_in_{TOP_K}"]["after"] == 2
    assert set(report["other_ranking"]["weights"]) == {"own", "topic", "cited"}
