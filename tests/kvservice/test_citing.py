from __future__ import annotations

from kvservice.serve.citing import (
    UNSUPPORTED,
    attribute,
    cited_ranks,
    claim_for,
    highlights,
    says_not_found,
    sentences,
    supporting_sentence,
    verdict,
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


def _split(text: str) -> list[str]:
    return [text[start:end] for start, end in sentences(text)]


def test_sentences_end_neither_in_decimals_nor_e_mail_addresses_nor_urls() -> None:
    text = (
        "The cooperative reported revenue of 48.2 million euros in 2024. Write to "
        "helpdesk@brightwater.coop for a copy. The timetable is at "
        "https://brightwater.coop/timetable.html?season=2025 online. Fares rose 3.5%!"
    )
    assert _split(text) == [
        "The cooperative reported revenue of 48.2 million euros in 2024.",
        "Write to helpdesk@brightwater.coop for a copy.",
        "The timetable is at https://brightwater.coop/timetable.html?season=2025 online.",
        "Fares rose 3.5%!",
    ]


def test_sentences_end_neither_after_abbreviations_nor_list_numbers() -> None:
    text = "Ask Dr. Lee, e.g. by phone. The U.S. Coast Guard inspects No. 4 yearly.\n2. Lock up."
    assert _split(text) == [
        "Ask Dr. Lee, e.g. by phone.",
        "The U.S. Coast Guard inspects No. 4 yearly.",
        "2. Lock up.",
    ]


def test_a_period_before_a_capital_ends_a_sentence_even_after_a_number_or_a_short_word() -> None:
    text = "The answer is no. The ferry seats 48. It sails at 9 a.m. Boarding ends at 8.45."
    assert _split(text) == [
        "The answer is no.",
        "The ferry seats 48.",
        "It sails at 9 a.m.",
        "Boarding ends at 8.45.",
    ]
    # A line a PDF wrapped goes on in lowercase: one sentence; a new line in capitals: two.
    assert _split("Laptops are replaced\nevery four years.\nPasswords") == [
        "Laptops are replaced\nevery four years.",
        "Passwords",
    ]


def test_the_highlight_is_the_whole_sentence_with_its_decimal_and_e_mail_address() -> None:
    passage = (
        "Brightwater runs four ferries. The cooperative reported revenue of 48.2 million "
        "euros in 2024. Questions go to helpdesk@brightwater.coop by e-mail. Fares rose."
    )
    answer = "Revenue was 48.2 million euros [1]. Write to helpdesk@brightwater.coop [2]."
    spans = highlights(answer, [passage, passage])
    assert passage[slice(*spans[1])] == (
        "The cooperative reported revenue of 48.2 million euros in 2024."
    )
    assert passage[slice(*spans[2])] == "Questions go to helpdesk@brightwater.coop by e-mail."


def test_a_supported_answer_is_one_verdict_without_a_not_found_note() -> None:
    question = "How much is the home office allowance?"
    cited = verdict("The allowance is 750 euros [2].", PASSAGES, question)
    assert (cited.citation, cited.text, cited.withheld) == (
        "model",
        "The allowance is 750 euros [2].",
        "",
    )
    attributed = verdict("It is 750 euros.", PASSAGES, question)
    assert attributed.citation == "attributed" and attributed.text == "It is 750 euros. [2]"
    assert attributed.streamed == " [2]"
    for supported in (cited, attributed):
        assert not says_not_found(supported.text) and UNSUPPORTED not in supported.text


def test_an_unsupported_answer_becomes_not_found_and_its_words_are_withheld() -> None:
    judged = verdict("The answer is: 4", PASSAGES, "How many ferries sail on Sundays?")
    assert judged.citation == "unsupported"
    assert judged.text == UNSUPPORTED and says_not_found(judged.text)
    assert "4" not in judged.text and judged.withheld == "The answer is: 4"
    # The stream already carried the words: what it adds withdraws them.
    assert judged.streamed.lstrip().startswith("(Withdrawn:")
    assert verdict("", PASSAGES, "Anything?").text == UNSUPPORTED
