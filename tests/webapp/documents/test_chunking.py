from __future__ import annotations

import pytest

from kvservice.chunk import token_ids_sha256
from webapp.documents.chunking import chunk_text, llm_tokenizer, split_sentences, tokenize


@pytest.fixture(scope="module")
def tokenizer():
    return llm_tokenizer()


def test_sentences_split_on_punctuation_and_paragraphs() -> None:
    assert split_sentences("One two. Three four? Five!\n\nSix seven.") == [
        "One two.",
        "Three four?",
        "Five!",
        "\n\nSix seven.",
    ]


def test_chunks_respect_the_token_budget_on_sentence_boundaries(tokenizer) -> None:
    sentences = [f"Sentence number {i} describes the harbour at dawn." for i in range(120)]
    chunks = chunk_text(" ".join(sentences), tokenizer=tokenizer, max_tokens=64)
    assert len(chunks) > 5
    assert [c.index for c in chunks] == list(range(len(chunks)))
    for chunk in chunks:
        assert chunk.token_count <= 64
        assert chunk.text.endswith("dawn.")  # never cut inside a sentence
    # Nothing lost, nothing duplicated.
    assert " ".join(c.text for c in chunks) == " ".join(sentences)


def test_token_ids_are_the_chunk_tokenized_on_its_own_without_special_tokens(tokenizer) -> None:
    chunks = chunk_text("Hello there. " * 200, tokenizer=tokenizer, max_tokens=100)
    for chunk in chunks:
        assert chunk.token_ids == tokenizer(chunk.text, add_special_tokens=False)["input_ids"]
        assert tokenizer.bos_token_id not in chunk.token_ids
        assert chunk.token_ids_sha256 == token_ids_sha256(chunk.token_ids)


def test_a_sentence_longer_than_a_chunk_is_cut_at_words(tokenizer) -> None:
    long_sentence = " ".join(f"word{i}" for i in range(400)) + "."
    chunks = chunk_text(long_sentence, tokenizer=tokenizer, max_tokens=50)
    assert len(chunks) > 1
    assert all(c.token_count <= 50 for c in chunks)
    assert all(len(tokenize(tokenizer, [c.text])[0]) == c.token_count for c in chunks)


def test_empty_text_has_no_chunks(tokenizer) -> None:
    assert chunk_text("  \n\n ", tokenizer=tokenizer) == []
