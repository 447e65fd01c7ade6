"""Split text into chunks of about N tokens of the LLM's own tokenizer, on sentence boundaries.

Each chunk's token ids are the chunk text tokenized *on its own* without special tokens.
Those exact ids are stored on the ``Chunk``: the KV cache is computed for them and the prompt
at query time is assembled from them, so the cached tokens are exactly the prompt's tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from kvservice.chunk import token_ids_sha256
from kvservice.prompt import chunk_token_ids

# A sentence ends at . ! ? (optionally followed by closing quotes/brackets) before whitespace;
# paragraph breaks always end one. Abbreviations split wrongly now and then; a chunk boundary
# at such a place costs little, since chunks hold many sentences.
_SENTENCE_END = re.compile(r"(?<=[.!?…])[\"'”’)\]]*\s+(?=\S)")
_PARAGRAPH = re.compile(r"\n\s*\n")


@dataclass(frozen=True)
class TextChunk:
    index: int
    text: str
    token_ids: list[int]

    @property
    def token_count(self) -> int:
        return len(self.token_ids)

    @property
    def token_ids_sha256(self) -> str:
        return token_ids_sha256(self.token_ids)


@cache
def llm_tokenizer(model_path: str | None = None) -> Any:
    """The LLM's tokenizer (``settings.MODEL_PATH`` or the bundled SmolLM2), loaded once per
    process."""
    from django.conf import settings
    from transformers import AutoTokenizer

    from kvservice.model.bundled import resolve_llm_path

    path = resolve_llm_path(model_path if model_path is not None else settings.MODEL_PATH or None)
    return AutoTokenizer.from_pretrained(str(path))


def tokenize(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Each text tokenized on its own, without BOS/EOS or any other special token."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def split_sentences(text: str) -> list[str]:
    """Sentences in order; a paragraph break ends a sentence (and is kept as a marker)."""
    pieces: list[str] = []
    for p_index, paragraph in enumerate(_PARAGRAPH.split(text)):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        sentences = [s.strip() for s in _SENTENCE_END.split(paragraph) if s.strip()]
        if p_index and pieces:
            sentences[0] = "\n\n" + sentences[0]
        pieces.extend(sentences)
    return pieces


def _split_long(sentence: str, tokenizer: Any, max_tokens: int) -> list[str]:
    """A sentence longer than a chunk: cut at word boundaries into pieces under the limit."""
    words = sentence.split(" ")
    pieces: list[str] = []
    current: list[str] = []
    for word in words:
        candidate = " ".join([*current, word])
        if current and len(tokenize(tokenizer, [candidate])[0]) > max_tokens:
            pieces.append(" ".join(current))
            current = [word]
        else:
            current.append(word)
    if current:
        pieces.append(" ".join(current))
    # A single "word" longer than the limit (a base64 blob, say): cut it further.
    out: list[str] = []
    for piece in pieces:
        out.extend(_cut_by_characters(piece, tokenizer, max_tokens))
    return out


def _cut_by_characters(text: str, tokenizer: Any, max_tokens: int) -> list[str]:
    """``text`` in pieces of at most ``max_tokens`` tokens each, cut between characters (the
    longest prefix that fits, found by bisection). Cutting the token ids instead and decoding
    them broke characters of several bytes (found by fuzzing: one became two U+FFFD)."""
    pieces: list[str] = []
    while text:
        fits, too_long = 0, len(text) + 1
        while too_long - fits > 1:
            middle = (fits + too_long) // 2
            if len(tokenize(tokenizer, [text[:middle]])[0]) <= max_tokens:
                fits = middle
            else:
                too_long = middle
        fits = max(fits, 1)  # one character is at most 4 byte tokens, under any limit >= 8
        pieces.append(text[:fits])
        text = text[fits:]
    return pieces


def _fit(group: list[str], tokenizer: Any, max_tokens: int) -> list[list[str]]:
    """``group`` split until each part, joined, is within ``max_tokens``: parts counted apart
    may tokenize longer together (found by fuzzing, with characters of several tokens)."""
    if len(chunk_token_ids(tokenizer, _join(group))) <= max_tokens:
        return [group]
    if len(group) == 1:
        return [[piece] for piece in _cut_by_characters(group[0], tokenizer, max_tokens)]
    middle = len(group) // 2
    return _fit(group[:middle], tokenizer, max_tokens) + _fit(group[middle:], tokenizer, max_tokens)


def _join(sentences: list[str]) -> str:
    text = ""
    for sentence in sentences:
        if not text:
            text = sentence.lstrip("\n")
        elif sentence.startswith("\n\n"):
            text += sentence
        else:
            text += " " + sentence
    return text.strip()


def chunk_text(text: str, *, tokenizer: Any, max_tokens: int = 512) -> list[TextChunk]:
    """Greedily pack whole sentences into chunks of at most ``max_tokens`` tokens."""
    if max_tokens < 8:
        raise ValueError("max_tokens must be at least 8")
    sentences = split_sentences(text)
    if not sentences:
        return []
    counts = [len(ids) for ids in tokenize(tokenizer, sentences)]
    units: list[tuple[str, int]] = []
    for sentence, count in zip(sentences, counts, strict=True):
        if count <= max_tokens:
            units.append((sentence, count))
            continue
        for piece in _split_long(sentence, tokenizer, max_tokens):
            units.append((piece, len(tokenize(tokenizer, [piece])[0])))

    groups: list[list[str]] = []
    current: list[str] = []
    current_tokens = 0
    for sentence, count in units:
        # +1: the space joining two sentences may merge into a token of its own.
        if current and current_tokens + count + 1 > max_tokens:
            groups.append(current)
            current, current_tokens = [], 0
        current.append(sentence)
        current_tokens += count + 1
    if current:
        groups.append(current)

    groups = [part for group in groups for part in _fit(group, tokenizer, max_tokens)]
    texts = [t for t in (_join(group) for group in groups) if t]
    # The stored ids come from the one function the inference side uses for a chunk's ids.
    return [
        TextChunk(index=i, text=t, token_ids=chunk_token_ids(tokenizer, t))
        for i, t in enumerate(texts)
    ]
