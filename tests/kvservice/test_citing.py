from __future__ import annotations

from kvservice.citing import (
    attribute,
    cited_ranks,
    claim_for,
    highlights,
    says_not_found,
    supporting_sentence,
)

PASSAGES = [
    "Laptops are replaced every four years. A broken laptop is swapped within one day.",
    "Each employee receives a one-time home office allowance of 750 euros. Core hours are "
    "10:00 to 15:00.",
]


def test_cited_ranks_are_the_valid_markers_in_order() -> None:
    assert cited_ranks("Every four years [1], and 750 euros [2][1].", 2) == [1, 2]
    assert cited_ranks("See [3] and [0].", 2) == []  # no such passage
    assert cited_ranks("", 2) == []


def test_the_supporting_sentence_is_the_one_sharing_most_words_with_the_claim() -> None:
    answer = "The allowance is 750 euros [2]. Laptops last four years [1]."
    assert claim_for(answer, 2) == "The allowance is 750 euros [2]."
    start, end = supporting_sentence(PASSAGES[1], claim_for(answer, 2))
    assert PASSAGES[1][start:end].startswith("Each employee receives")
    spans = highlights(answer, PASSAGES)
    assert PASSAGES[0][slice(*spans[1])] == "Laptops are replaced every four years."
    assert supporting_sentence(PASSAGES[0], "Nothing in common here") is None


def test_attribution_picks_the_passage_holding_what_the_answer_adds() -> None:
    question = "How much is the home office allowance?"
    assert attribute("The home office allowance is 750 euros.", PASSAGES, question) == 2
    assert attribute("Every four years.", PASSAGES, "How often are laptops replaced?") == 1
    # Only the question's own words, or words in no passage: nothing supports it.
    assert attribute("The home office allowance is 12 dollars.", PASSAGES, question) is None


def test_not_found_is_recognized_in_the_products_and_the_models_words() -> None:
    assert says_not_found("I could not find this in your documents.")
    assert says_not_found("The sources do not contain the dress code.")
    assert not says_not_found("The allowance is 750 euros [2].")
