"""The sentence a citation highlights is the one that holds the fact the answer states: a list
item with its number (a PDF's numbered steps reach the passage joined on one line, "desk. 2.
Found items are kept", where "2." was read as a sentence and highlighted alone), chosen by
the answer's facts and the question's own words, not by the words it repeats from the
question (a title line), a list number sharing a digit with the answer, or a tie that the
first sentence won (the evening sailing's, asked about the morning one)."""

from __future__ import annotations

from kvservice.serve.citing import highlights, passage_uses, sentences, supporting_sentence

# Numbered steps as the chunker joins a PDF's lines: each after the one before, on one line.
STEPS = (
    "Found property at Kestrel Quay\n1. Bring what you find to the ticket office. "
    "2. Found items are kept for two months at the office. 3. Collect an item with its "
    "receipt number."
)
STEP_2 = "2. Found items are kept for two months at the office."


def _highlighted(passage: str, answer: str, question: str) -> str | None:
    span = highlights(answer, [passage], question).get(1)
    return passage[slice(*span)] if span else None


def test_a_list_number_starts_its_item_and_is_no_sentence_of_its_own() -> None:
    assert [STEPS[start:end] for start, end in sentences(STEPS)] == [
        "Found property at Kestrel Quay",
        "1. Bring what you find to the ticket office.",
        STEP_2,
        "3. Collect an item with its receipt number.",
    ]
    lettered = "Before you leave: a. switch off the lights. b. Lock the door. iv. Rest."
    assert [lettered[start:end] for start, end in sentences(lettered)] == [
        "Before you leave: a. switch off the lights.",
        "b. Lock the door.",
        "iv. Rest.",
    ]


def test_the_highlight_is_the_list_item_not_its_number() -> None:
    """The answer's "2" is no reason to highlight the list number "2." (it was, alone)."""
    question = "How long are found items kept?"
    assert _highlighted(STEPS, "They stay 2 months [1].", question) == STEP_2
    assert _highlighted(STEPS, "Two months.\n[1]", question) == STEP_2


def test_the_highlight_is_the_fact_not_a_title_repeating_the_question() -> None:
    question = "How long is found property kept at Kestrel Quay?"
    answer = "Found property at Kestrel Quay is kept for two months [1]."
    assert _highlighted(STEPS, answer, question) == STEP_2


def test_the_question_tells_the_morning_sailing_from_the_evening_one() -> None:
    passage = (
        "Sailings from Kestrel Quay. The evening sailing leaves Kestrel Quay at 18:40. "
        "The morning sailing leaves Kestrel Quay at 07:15."
    )
    question = "When does the morning sailing leave?"
    morning = "The morning sailing leaves Kestrel Quay at 07:15."
    assert _highlighted(passage, "It leaves Kestrel Quay at quarter past seven [1].", question) == (
        morning
    )
    assert _highlighted(passage, "At 7:15 [1].", question) == morning  # "07" is "7"


def test_the_highlight_is_the_step_that_says_it_not_its_neighbour() -> None:
    passage = (
        "1. Bring what you find to the ticket office. 2. After two months they go to charity. "
        "3. Found items are kept for two months."
    )
    question = "How long are found items kept?"
    assert _highlighted(passage, "They are kept two months [1].", question) == (
        "3. Found items are kept for two months."
    )


def test_a_citation_on_a_numbered_line_of_its_own_cites_the_answer_before_it() -> None:
    """The bundled model writes "1. <answer>\n2. [1]": the "2." is no claim of its own (its
    digit matched the "pier 2" of another sentence)."""
    passage = (
        "The morning ferry leaves from pier 2. The safety officer of Kestrel Quay is Olga Brandt."
    )
    answer = "1. The safety officer is Olga Brandt.\n2. [1]"
    assert _highlighted(passage, answer, "Who is the safety officer?") == (
        "The safety officer of Kestrel Quay is Olga Brandt."
    )


def test_the_worker_reports_the_highlight_chosen_with_the_question() -> None:
    answer = "Found property at Kestrel Quay is kept for two months [1]."
    question = "How long is found property kept at Kestrel Quay?"
    (use,) = passage_uses(answer, [STEPS], [7], {"7": "cpu"}, question)
    assert use.cited and STEPS[slice(*use.highlight)] == STEP_2
    assert supporting_sentence(STEPS, "Nothing in common here", question) is None
