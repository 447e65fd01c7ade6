"""Fuzzing the parsers and the chunker (hypothesis): whatever the bytes, a parser returns text
or refuses with a ``ParseError`` (its message is what the user reads), never anything else;
and chunks always hold all the text, within the token limit."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.webapp.documents import files
from webapp.documents import parsing
from webapp.documents.chunking import chunk_text, llm_tokenizer

FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
KINDS = ["pdf", "docx", "html", "markdown", "text"]
VALID = {
    kind: getattr(files, f"{kind}_bytes")("fuzzing keeps every parser honest") for kind in KINDS
}


@st.composite
def mutated(draw, kind: str) -> bytes:
    """A valid file of ``kind`` with some bytes overwritten, cut short or spliced."""
    data = bytearray(VALID[kind])
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(data) - 1))
        data[at : at + 4] = draw(st.binary(min_size=1, max_size=4))
    if draw(st.booleans()):
        data = data[: draw(st.integers(1, len(data)))]
    return bytes(data)


def _parse_or_refuse(data: bytes, kind: str) -> None:
    try:
        parsed = parsing.parse(data, kind)
    except parsing.ParseError as err:
        assert str(err).strip()  # a message for the user
        return
    assert parsed.text.strip() and "\x00" not in parsed.text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
@FUZZ
@given(data=st.data())
def test_a_damaged_file_is_parsed_or_refused_with_a_message(kind, data) -> None:
    _parse_or_refuse(data.draw(mutated(kind)), kind)


@pytest.mark.timeout(300)
@FUZZ
@given(
    blob=st.binary(max_size=4096), name=st.sampled_from(["a.pdf", "a.docx", "a.md", "a.txt", ""])
)
def test_any_bytes_are_detected_or_refused(blob, name) -> None:
    try:
        kind = parsing.detect_type(blob, name)
    except parsing.ParseError as err:
        assert str(err).strip()
        return
    assert kind in KINDS
    _parse_or_refuse(blob, kind)


WORDS = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=12
)


@pytest.mark.timeout(300)
@FUZZ
@given(
    sentences=st.lists(st.lists(WORDS, min_size=1, max_size=30).map(" ".join), max_size=40),
    ends=st.lists(st.sampled_from([". ", "! ", "? ", "\n\n", "… ", " "]), min_size=40, max_size=40),
    max_tokens=st.integers(8, 64),
)
def test_chunks_keep_all_the_text_within_the_token_limit(sentences, ends, max_tokens) -> None:
    text = parsing.normalize_text("".join(s + e for s, e in zip(sentences, ends, strict=False)))
    tokenizer = llm_tokenizer()
    chunks = chunk_text(text, tokenizer=tokenizer, max_tokens=max_tokens)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    for chunk in chunks:
        assert chunk.text.strip() and 0 < chunk.token_count <= max_tokens
    # Every character but whitespace is kept, in order (a word longer than the limit is cut
    # into pieces, and whitespace between sentences may change).
    assert "".join("".join(c.text for c in chunks).split()) == "".join(text.split())
