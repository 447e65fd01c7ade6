"""What an answer says about its sources, read from its text: which passages it cites inline
([n]), which passage supports it when it cites none, which sentence of a cited passage
supports it, and whether it says the documents do not hold the answer. Pure functions: the
inference worker completes an answer's citation, the chat records them, the APIs report them,
the answer benchmark measures them."""

from __future__ import annotations

import re
from collections.abc import Sequence

CITATION_MARK = re.compile(r"\[(\d{1,2})\]")
_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+|$)")
_WORD = re.compile(r"\w+", re.UNICODE)
# Words too common to tell one sentence from another.
_STOP_WORDS = frozenset(
    "a an and are as at be by can do does for from has have how in is it its of on or that the "
    "their there this to was what when where which who why will with within you your".split()
)


def cited_ranks(text: str, passages: int) -> list[int]:
    """The passage numbers the answer cites with a valid ``[n]`` (1..passages), in order of
    first appearance."""
    ranks: list[int] = []
    for match in CITATION_MARK.finditer(text or ""):
        rank = int(match.group(1))
        if 1 <= rank <= passages and rank not in ranks:
            ranks.append(rank)
    return ranks


def _words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in _STOP_WORDS}


def sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence of ``text``, surrounding spaces left out."""
    spans = []
    for match in _SENTENCE.finditer(text):
        start, end = match.span()
        while start < end and text[start].isspace():
            start += 1
        if start < end:
            spans.append((start, end))
    return spans


def claim_for(answer: str, rank: int) -> str:
    """The answer's text that cites passage ``rank``: the sentences carrying ``[rank]`` (the
    whole answer when the marker stands alone after the last sentence)."""
    claims = [
        answer[start:end]
        for start, end in sentences(answer)
        if f"[{rank}]" in answer[start:end] and _words(CITATION_MARK.sub("", answer[start:end]))
    ]
    return " ".join(claims) or answer


def supporting_sentence(passage: str, claim: str) -> tuple[int, int] | None:
    """The span of the passage's sentence sharing the most words with ``claim`` (None when
    none shares any): what the passage panel highlights."""
    wanted = _words(CITATION_MARK.sub("", claim))
    best, best_overlap = None, 0
    for start, end in sentences(passage):
        overlap = len(wanted & _words(passage[start:end]))
        if overlap > best_overlap:
            best, best_overlap = (start, end), overlap
    return best


def highlights(answer: str, passages: Sequence[str]) -> dict[int, tuple[int, int]]:
    """For each passage the answer cites (rank -> span), its supporting sentence."""
    spans = {}
    for rank in cited_ranks(answer, len(passages)):
        span = supporting_sentence(passages[rank - 1], claim_for(answer, rank))
        if span is not None:
            spans[rank] = span
    return spans


# How an answer says the documents do not hold the answer: the product's own words
# (webapp.chat.services.NOT_FOUND), and the model's when it follows the system prompt.
_NOT_FOUND = re.compile(
    r"could not find|couldn't find|cannot find|can't find|did not find|didn't find|"
    r"not (?:found|mentioned|stated|provided|specified)|"
    r"(?:do|does) not (?:contain|mention|say|provide|specify)|no information",
    re.IGNORECASE,
)


def says_not_found(text: str) -> bool:
    return bool(_NOT_FOUND.search(text or ""))


def attribute(answer: str, passages: Sequence[str], question: str = "") -> int | None:
    """The passage (1-based) that holds what the answer adds to the question: the most of
    the answer's words that are not the question's (numbers count double: they are the facts
    users check). None when no passage holds any: the answer is not supported by them."""
    new_words = _words(CITATION_MARK.sub("", answer)) - _words(question) - {"answer"}
    best, best_score = None, 0
    for rank, passage in enumerate(passages, start=1):
        shared = new_words & _words(passage)
        score = sum(2 if word.isdigit() else 1 for word in shared)
        if score > best_score:
            best, best_score = rank, score
    return best


# Added to an answer that cites no passage and none of whose words any passage holds.
UNSUPPORTED = "(I could not find this in your documents: no passage supports this answer.)"


def complete_citation(text: str, passages: Sequence[str], question: str) -> tuple[str, str]:
    """(text to add to the answer, how it cites). The model's own [n] markers stand
    ("model"), as does its "not found"; an answer without a marker cites the passage that
    holds what it adds to the question ("attributed": the bundled model writes few markers),
    and one that no passage supports says so ("unsupported")."""
    if cited_ranks(text, len(passages)):
        return "", "model"
    if says_not_found(text):
        return "", "not_found"
    rank = attribute(text, passages, question)
    if rank is not None:
        return f" [{rank}]", "attributed"
    return ("\n\n" if text.strip() else "") + UNSUPPORTED, "unsupported"
