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

from kvservice.protocol import token_ids_sha256
from kvservice.protocol.prompt import chunk_token_ids

# A sentence ends at . ! ? (optionally followed by closing quotes/brackets) before whitespace;
# paragraph breaks always end one. Abbreviations split wrongly now and then; a chunk boundary
# at such a place costs little, since chunks hold many sentences.
_SENTENCE_END = re.compile(r"(?<=[.!?…])[\"'”’)\]]*\s+(?=\S)")
_PARAGRAPH = re.compile(r"\n\s*\n")
# The start of a list item as the parsers write it: "3. ", "b) ", "iv. ", "1.2.3 ", "- ". It
# starts a line of its own in a chunk, and its number is no sentence of its own.
LIST_ITEM = re.compile(
    r"^(?:[-*•]|\(?(?:\d{1,3}(?:\.\d{1,3})*|[a-zA-Z]|[ivxlcdmIVXLCDM]{1,7})[.)]"
    r"|\d{1,3}(?:\.\d{1,3})+)[ \t]+(?=\S)"
)
_LIST_LINE = re.compile(r"\n(?=" + LIST_ITEM.pattern.removeprefix("^") + ")")


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
    process from the files the inference worker loads its own from
    (``kvservice.protocol.models.converted_llm_dir``), so chunks are the worker's tokens."""
    from django.conf import settings
    from transformers import AutoTokenizer

    from kvservice.protocol.models import converted_llm_dir

    path = converted_llm_dir(model_path if model_path is not None else settings.MODEL_PATH or None)
    return AutoTokenizer.from_pretrained(str(path))


def tokenize(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Each text tokenized on its own, without BOS/EOS or any other special token."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def split_sentences(text: str) -> list[str]:
    """Sentences in order; a paragraph break ends a sentence (and is kept as a marker), and
    so does a line break before a list item (kept as a marker too: the item stays on a line
    of its own)."""
    pieces: list[str] = []
    for paragraph in _PARAGRAPH.split(text):
        for l_index, line in enumerate(_LIST_LINE.split(paragraph.strip())):
            sentences = _line_sentences(line)
            if sentences and pieces:
                sentences[0] = ("\n" if l_index else "\n\n") + sentences[0]
            pieces.extend(sentences)
    return pieces


def _line_sentences(line: str) -> list[str]:
    """The sentences of a line, a list item's number ("3.") kept with its first sentence."""
    item = LIST_ITEM.match(line)
    label, rest = (item.group(0).strip(), line[item.end() :]) if item else ("", line)
    sentences = [s.strip() for s in _SENTENCE_END.split(rest.strip()) if s.strip()]
    if label:
        sentences[:1] = [f"{label} {sentences[0]}" if sentences else label]
    return sentences


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
        elif sentence.startswith("\n"):
            text += sentence
        else:
            text += " " + sentence
    return text.strip()


def keep_together(sentences: list[str]) -> list[list[str]]:
    """The sentences in runs that a chunk boundary should not cut where a chunk can hold
    them: a list with the line before it (its heading, or "To return a parcel:") and a
    heading above that line; every other sentence a run of its own. A question asks for
    "the third step of returning a parcel": the passage must hold both."""
    runs: list[list[str]] = []
    loose = 0  # how many of the last runs are single sentences, which a list may take along
    in_list = False
    for at, sentence in enumerate(sentences):
        starts_line = at == 0 or sentence.startswith("\n")
        if starts_line and LIST_ITEM.match(sentence.lstrip("\n")):
            if not in_list:
                taken = _introduction_length(sentences, at, loose)
                introduction = [s for run in runs[len(runs) - taken :] for s in run]
                del runs[len(runs) - taken :]
                runs.append(introduction)
                in_list = True
            runs[-1].append(sentence)
            loose = 0
        elif in_list and not starts_line:
            runs[-1].append(sentence)  # an item's second sentence
        else:
            in_list = False
            runs.append([sentence])
            loose += 1
    return runs


def _introduction_length(sentences: list[str], first_item: int, available: int) -> int:
    """How many sentences before a list go with it: the one before it, and the heading
    above that one (a paragraph of one line with no full stop)."""
    if available == 0:
        return 0
    before = first_item - 1
    if available >= 2 and not _is_heading(sentences, before) and _is_heading(sentences, before - 1):
        return 2
    return 1


_SENTENCE_MARKS = (".", "!", "?", "…", ":", ";")


def _is_heading(sentences: list[str], at: int) -> bool:
    if at < 0:
        return False
    whole_paragraph = (at == 0 or sentences[at].startswith("\n\n")) and (
        at + 1 == len(sentences) or sentences[at + 1].startswith("\n\n")
    )
    return whole_paragraph and not sentences[at].rstrip().endswith(_SENTENCE_MARKS)


Units = list[tuple[str, int]]  # sentences with their token counts


def _measured(runs: list[list[str]], tokenizer: Any, max_tokens: int) -> list[Units]:
    """Each run's sentences with their token counts, a sentence longer than a chunk cut."""
    counts = [len(ids) for ids in tokenize(tokenizer, [s for run in runs for s in run])]
    measured: list[Units] = []
    at = 0
    for run in runs:
        units: Units = []
        for sentence, count in zip(run, counts[at : at + len(run)], strict=True):
            if count <= max_tokens:
                units.append((sentence, count))
                continue
            for piece in _split_long(sentence, tokenizer, max_tokens):
                units.append((piece, len(tokenize(tokenizer, [piece])[0])))
        measured.append(units)
        at += len(run)
    return measured


def _pack(runs: list[Units], max_tokens: int) -> list[list[str]]:
    """Sentences packed greedily into groups of at most ``max_tokens`` tokens; a run of
    several that fits in a chunk but not in what is left of this one starts the next."""
    groups: list[list[str]] = []
    current: list[str] = []
    current_tokens = 0
    for run in runs:
        # +1: the space joining two sentences may merge into a token of its own.
        run_tokens = sum(count + 1 for _, count in run)
        if len(run) > 1 and current and current_tokens + run_tokens > max_tokens >= run_tokens:
            groups.append(current)
            current, current_tokens = [], 0
        for sentence, count in run:
            if current and current_tokens + count + 1 > max_tokens:
                groups.append(current)
                current, current_tokens = [], 0
            current.append(sentence)
            current_tokens += count + 1
    if current:
        groups.append(current)
    return groups


def chunk_text(text: str, *, tokenizer: Any, max_tokens: int = 512) -> list[TextChunk]:
    """Pack whole sentences into chunks of at most ``max_tokens`` tokens, a list kept with
    its heading (``keep_together``)."""
    if max_tokens < 8:
        raise ValueError("max_tokens must be at least 8")
    sentences = split_sentences(text)
    if not sentences:
        return []
    runs = _measured(keep_together(sentences), tokenizer, max_tokens)
    groups = [
        part for group in _pack(runs, max_tokens) for part in _fit(group, tokenizer, max_tokens)
    ]
    texts = [t for t in (_join(group) for group in groups) if t]
    # The stored ids come from the one function the inference side uses for a chunk's ids.
    return [
        TextChunk(index=i, text=t, token_ids=chunk_token_ids(tokenizer, t))
        for i, t in enumerate(texts)
    ]
