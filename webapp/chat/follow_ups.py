"""Whether a question of a conversation is a follow-up, which earlier questions it refers to,
and how it is searched with them: only a follow-up is searched and asked with earlier turns,
so that a new question is answered (or found unanswerable) on its own.

A follow-up is told from the question itself: short, and referring back ("And what about
the Osprey?", "Who built it?", "Why?"). Measured over 27 questions in 3 conversations of
tests/data/station (tests/webapp/chat/test_follow_ups.py): with the previous question joined
to every question, 16 of the 22 that are not follow-ups were given other passages than in a
fresh conversation, 15 of 17 new topics carried earlier questions into the prompt, and 0 of
5 unanswerable questions were "not found" (1 of 5 in fresh conversations); deciding on the
question first, 22 of 22 get a fresh conversation's passages, 0 of 17 carry history, 1 of 5
is "not found" as in a fresh one, and each of the 5 follow-ups still gets the passage that
answers it (first passage from its document: 5 of 5, against 4 of 5)"""

from __future__ import annotations

import re
from collections.abc import Sequence

from webapp.chat.retrieval import retrieve_chunks
from webapp.documents.embeddings import embed_texts
from webapp.documents.models import Chunk
from webapp.documents.selectors import EVERYTHING, Scope

FOLLOW_UP_MAX_WORDS = 10  # a longer question names its own subject
# Openings that continue the previous question ("And the Skua?", "What about in winter?").
_OPENINGS = re.compile(
    r"^(and|but|also|so|then|or|what about|how about|what of|what else|same for)\b", re.I
)
# Words that point back to something named earlier.
_REFERRING = frozenset(
    "it its itself they them their theirs he him his she her hers this that these those "
    "there former latter same else another other others one ones mine yours".split()
)
# "Is there a pool?": an existential "there" points nowhere.
_EXISTENTIAL_THERE = re.compile(
    r"\b(is|are|was|were|be)\s+there\b|\bthere\s+(is|are|was|were|be)\b", re.I
)
_WORD = re.compile(r"[\w'’-]+", re.UNICODE)
# Question words and the like: what a question without a subject of its own is made of.
_FUNCTION_WORDS = frozenset(
    "a an the and or but so then also what which who whom whose when where why how is are was "
    "were be been do does did can could may might must shall should will would about of for in "
    "on at to from with by more tell me please else".split()
)


def is_follow_up(question: str) -> bool:
    """A short question that continues the previous one (an opening like "and" or "what
    about"), points back ("it", "her", "those"), or has no subject of its own ("Why?")."""
    words = [w.lower().strip("'’") for w in _WORD.findall(question)]
    if not words or len(words) > FOLLOW_UP_MAX_WORDS:
        return False
    if _OPENINGS.match(" ".join(words)):
        return True
    text = _EXISTENTIAL_THERE.sub(" ", question.lower())
    pointing = {w.strip("'’") for w in _WORD.findall(text)} & _REFERRING
    return bool(pointing) or all(w in _FUNCTION_WORDS for w in words)


def topic_questions(earlier: Sequence[str], question: str) -> list[str]:
    """The earlier questions ``question`` refers to, oldest first: none for a question of its
    own; for a follow-up, back to the last question that was not one ("How many does the
    Gannet seat?", "And the Osprey?" for "Who must be on board it?")."""
    if not is_follow_up(question):
        return []
    topic: list[str] = []
    for earlier_question in reversed(earlier):
        topic.insert(0, earlier_question)
        if not is_follow_up(earlier_question):
            break
    return topic


# --- how a follow-up is searched ------------------------------------------------------------


def follow_up_chunks(
    *,
    user,
    question: str,
    topic: Sequence[str],
    top_k: int,
    min_score: float,
    scope: Scope = EVERYTHING,
) -> list[Chunk]:
    """A follow-up's passages, best first: it is searched alone and with ``topic`` (the
    earlier questions it refers to) joined on ("And what is her e-mail?" means little on its
    own), and the passages of both searches are ranked by their relevance scores: the joined
    search adds the passages the question alone scores too low; each search's full text reads
    its own words. Over the 36 follow-ups of tests/data/follow_ups (bench/follow_ups.py),
    the answering passage is first for 33 (searched alone: 7), among the 6 for 36 (24).
    Adding to the score a share of the relevance to the question alone, one of that to the
    topic and a bonus for the passage the previous answer cited, weights chosen on half of
    them, ranked 16 of the other 18 first, against 17 for this rule: not kept."""
    queries = [question, "\n".join([*topic, question])]
    best: dict[str, Chunk] = {}  # by content: the better score of the two searches
    for query, vector in zip(queries, embed_texts(queries), strict=True):
        for chunk in retrieve_chunks(
            user=user,
            question=query,
            query_embedding=vector,
            top_k=top_k,
            min_score=min_score,
            scope=scope,
        ):
            known = best.get(chunk.token_ids_sha256)
            if known is None or chunk.score > known.score:
                best[chunk.token_ids_sha256] = chunk
    return sorted(best.values(), key=lambda chunk: -chunk.score)[:top_k]
