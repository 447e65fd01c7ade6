"""What an answer says about its sources, read from its text: which passages it cites inline
([n]), which passage supports it when it cites none, which sentence of a cited passage
supports it, and whether it says the documents do not hold the answer. Pure functions: the
inference worker gives each complete answer one verdict (``verdict``: supported, or "not
found"), the chat records them, the APIs report them, the answer benchmark measures them."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvservice.protocol import PassageUse

CITATION_MARK = re.compile(r"\[(\d{1,2})\]")
_WORD = re.compile(r"\w+", re.UNICODE)
# Where a sentence may end: a line break, or . ! ? … (closing quotes and brackets after
# them included) before a space or the end. A mark inside a token ("48.2",
# "helpdesk@brightwater.coop", "https://example.org/a?b=1") is never followed by a space,
# so it is never a candidate.
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s|$)|\n")
# The token before a period: words joined by dots, @ or hyphens ("e.g", "U.S", "48.2",
# "helpdesk@brightwater.coop"), at most this long.
_TOKEN_BEFORE = re.compile(r"[\w@.-]*\w$")
_TOKEN_MAX = 200
# Abbreviations a period does not end a sentence after, even before a capital ("Dr. Lee",
# "e.g. The", "U.S. Coast Guard"); some only before a number ("No. 4", "approx. 40"), as
# "The answer is no. The" ends one. Those that often end a sentence ("etc.", "Inc.",
# "a.m.") are left out: a capital after them starts a new sentence.
_TITLES = frozenset("mr mrs ms dr prof sr jr st mt gen col capt lt sgt rev hon".split())
_BEFORE_WORDS = frozenset("vs cf e.g i.e incl excl resp viz".split())
_BEFORE_NUMBERS = frozenset(
    "no nr nos fig figs p pp vol vols ch sec art para tel ext min max approx ca".split()
)
_ENDING_ABBREVIATIONS = frozenset("a.m p.m".split())
# A list item's number or letter ("2.", "b.", "iv.", "1.3.", "(2)", "3)"): no sentence of
# its own, and no word of the item (the "3" of "3. Ask at the desk" says nothing of an
# answer's "3 months").
_LIST_LABEL = r"\(?(?:\d{1,3}(?:\.\d{1,3})*|[A-Za-z]|[ivxlcdmIVXLCDM]{1,4})[.)]"
_LIST_MARKER = re.compile(_LIST_LABEL)
_LEADING_LIST_MARKER = re.compile(r"^\s*(?:[-*•]|" + _LIST_LABEL + r")(?:\s+|$)")
# Words that tell no sentence of a passage from another, beside the stop words: pronouns,
# which stand for what the sentence names ("After two months they go to charity").
_PRONOUNS = frozenset("he she him his her hers they them theirs we us our i me my".split())
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


def _abbreviates(token: str, following: str) -> bool:
    """Whether a period after ``token``, with ``following`` after it, marks an abbreviation:
    a title or a word of ``_BEFORE_WORDS``, one of ``_BEFORE_NUMBERS`` before a digit, or
    single letters joined by dots ("U.S", "e.g")."""
    word = token.lower()
    if word in _TITLES or word in _BEFORE_WORDS:
        return True
    if word in _BEFORE_NUMBERS:
        return following[:1].isdigit()
    parts = word.split(".")
    letters = len(parts) > 1 and all(len(part) == 1 and part.isalpha() for part in parts)
    return letters and word not in _ENDING_ABBREVIATIONS


def _ends_sentence(text: str, mark: re.Match[str]) -> bool:
    """Whether the candidate ``mark`` (a ``_SENTENCE_END`` match) ends a sentence: always
    ! ? and …; a line break unless the next line goes on in lowercase (a PDF's wrapped line);
    a period unless it marks an abbreviation, or a lowercase word follows it (not a list
    item's letter: "b. Keep the receipt")."""
    following = text[mark.end() :].lstrip(" \t")
    if mark.group() == "\n":  # a line wrapped inside a sentence goes on in lowercase
        return not following[:1].islower()
    if mark.group()[0] in "!?…":
        return True
    before = _TOKEN_BEFORE.search(text, max(0, mark.start() - _TOKEN_MAX), mark.start())
    token = before.group() if before else ""
    if token and _abbreviates(token, following):
        return False
    return not following[:1].islower() or bool(_LEADING_LIST_MARKER.match(following))


def sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence of ``text``, surrounding spaces left out; a list item
    is one with its number ("2. Lock the door."). Periods of decimals, e-mail addresses,
    URLs and abbreviations end none (``_ends_sentence``), nor does a list number: the chunker
    joins a PDF's lines with spaces, so "desk. 2. Lost items are kept" has its "2." in the
    middle of a line, where it was read as a sentence of its own and highlighted alone."""
    spans, start = [], 0
    for mark in _SENTENCE_END.finditer(text):
        if _LIST_MARKER.fullmatch(text[start : mark.end()].strip()):
            continue  # a list item's number: the item goes on after it
        if _ends_sentence(text, mark):
            spans.append((start, mark.end()))
            start = mark.end()
    spans.append((start, len(text)))
    return [trimmed for span in spans if (trimmed := _trimmed(text, *span))]


def _trimmed(text: str, start: int, end: int) -> tuple[int, int] | None:
    """The span without the spaces at its ends (None when nothing else is left)."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if start < end else None


def claim_for(answer: str, rank: int) -> str:
    """The answer's text that cites passage ``rank``: the sentences carrying ``[rank]`` (the
    whole answer when the marker stands alone after the last sentence, or on a numbered line
    of its own: "1. The officer is Olga Brandt.\n2. [1]")."""
    claims = [
        answer[start:end]
        for start, end in sentences(answer)
        if f"[{rank}]" in answer[start:end] and _terms(CITATION_MARK.sub("", answer[start:end]))
    ]
    return " ".join(claims) or answer


def _terms(sentence: str) -> set[str]:
    """The words of a sentence that tell it apart, as ``supporting_sentence`` compares them:
    without its list number, stop words, pronouns or a number's leading zeros ("07:15" is
    "7:15"), and without a plural's "s" ("leaves" and "leave", "days" and "day" are one)."""
    terms = set()
    for word in _words(_LEADING_LIST_MARKER.sub("", sentence)) - _PRONOUNS:
        if word.isdigit():
            word = word.lstrip("0") or "0"
        elif len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        terms.add(word)
    return terms


def supporting_sentence(passage: str, claim: str, question: str = "") -> tuple[int, int] | None:
    """The span of the passage's sentence (a list item with its number) that holds the fact
    ``claim`` states: what the passage panel highlights. None when no sentence shares a word
    with the claim.

    The claim's facts are its words the question does not hold (the "60 days" of "Lost
    items are kept for 60 days", asked "How long are lost items kept?"): each counts three
    times a question's word (which tells what the question is about: the "morning" of a
    question about the morning sailing, beside a sentence on the evening one). A word counts
    less the more sentences of the passage hold it ("sailing" in each of them tells none
    apart), a number twice. Counting the claim's words alone picked a title line that
    repeated the question's words, the evening sailing's sentence for a question about the
    morning one (a tie, the first won), and a list number sharing a digit with the answer."""
    spans = sentences(passage)
    held = [_terms(passage[start:end]) for start, end in spans]
    claim = CITATION_MARK.sub("", claim)
    said = set().union(*(_terms(claim[start:end]) for start, end in sentences(claim)))
    asked = _terms(question)
    facts = said - asked
    sentences_holding = Counter(term for terms in held for term in terms)

    def weight(terms: set[str]) -> float:
        return sum((2.0 if t.isdigit() else 1.0) / sentences_holding[t] for t in terms)

    best, best_score = None, 0.0
    for span, terms in zip(spans, held, strict=True):
        if not said & terms:
            continue
        score = 3 * weight(facts & terms) + weight(asked & terms)
        if score > best_score:
            best, best_score = span, score
    return best


def highlights(
    answer: str, passages: Sequence[str], question: str = ""
) -> dict[int, tuple[int, int]]:
    """For each passage the answer cites (rank -> span), its supporting sentence."""
    spans = {}
    for rank in cited_ranks(answer, len(passages)):
        span = supporting_sentence(passages[rank - 1], claim_for(answer, rank), question)
        if span is not None:
            spans[rank] = span
    return spans


def passage_uses(
    text: str,
    passages: Sequence[str],
    chunk_ids: Sequence[int],
    chunk_tiers: dict[str, str],
    question: str = "",
) -> list[PassageUse]:
    """Per passage of the prompt, in rank order: whether the answer ``text`` (to
    ``question``) cites it, the sentence of it that supports the answer, and the tier its KV
    came from."""
    cited = set(cited_ranks(text, len(passages)))
    spans = highlights(text, passages, question)
    return [
        PassageUse(
            rank=rank,
            chunk_id=chunk_id,
            tier=chunk_tiers.get(str(chunk_id), ""),
            cited=rank in cited,
            highlight=spans.get(rank),
        )
        for rank, chunk_id in enumerate(chunk_ids, start=1)
    ]


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


# The one verdict on an answer that cites no passage and none of whose words any passage
# holds: it is recorded and shown in place of the model's words ("The answer is: 4"
# followed by a note that nothing supports it left readers two answers to choose from).
UNSUPPORTED = "I could not find this in your documents: no passage supports an answer."
# What the stream adds after those words, which its readers have already received: they are
# withdrawn. The stream's ``done`` carries ``UNSUPPORTED`` alone (the page shows that).
WITHDRAWN = (
    "\n\n(Withdrawn: no passage of your documents supports the words above, so they are not "
    "an answer. " + UNSUPPORTED + ")"
)


@dataclass(frozen=True)
class Verdict:
    """A complete answer judged against its passages: how it cites (``citation``:
    "model", "attributed", "not_found" or "unsupported"), its text as recorded and shown,
    what the stream adds after the words already streamed, and the model's words when they
    are withheld (an unsupported answer's)."""

    citation: str
    text: str
    streamed: str = ""
    withheld: str = ""


def verdict(text: str, passages: Sequence[str], question: str) -> Verdict:
    """One verdict per answer. The model's own [n] markers stand ("model"), as does its "not
    found"; an answer without a marker cites the passage that holds what it adds to the
    question ("attributed": the bundled model writes few markers); one that no passage
    supports becomes "not found" (``UNSUPPORTED``), its words withheld."""
    if cited_ranks(text, len(passages)):
        return Verdict("model", text)
    if says_not_found(text):
        return Verdict("not_found", text)
    rank = attribute(text, passages, question)
    if rank is not None:
        return Verdict("attributed", f"{text} [{rank}]", f" [{rank}]")
    if not text.strip():
        return Verdict("unsupported", UNSUPPORTED, UNSUPPORTED)
    return Verdict("unsupported", UNSUPPORTED, WITHDRAWN, withheld=text)
