"""What a question sends to the inference worker, built in one place for a question asked (or
asked again) and for its fidelity audit: the conversation's history as the model reads it,
the ``GenerateRequest``, and who may choose a prefill mode other than blend."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import replace

from django.conf import settings

from kvservice.protocol import ChunkRef, GenerateRequest, Turn
from webapp.chat.follow_ups import topic_questions
from webapp.chat.models import Citation, Conversation, Message
from webapp.documents.kv import chunk_ref
from webapp.kdn.tokens import request_token

HISTORY_TURNS = 3  # at most this many earlier questions (and helpful answers) in a follow-up

# An answer asked again is sampled, so that it is another attempt: a first answer is greedy,
# and greedy decoding of the same prompt gave the identical text every time (#36). 0.7 with
# top-p 0.9 (common chat settings) keeps the likely words and varies the wording; each
# attempt draws a seed of its own, recorded with it (Message.temperature, Message.seed).
REGENERATE_TEMPERATURE = 0.7
REGENERATE_TOP_P = 0.9


def mode_allowed(user, mode: str) -> bool:
    """Blend for everyone; the other prefill modes (full, reuse, prefix) for staff only."""
    return mode == Message.Mode.BLEND or (mode in Message.Mode.values and user.is_staff)


def conversation_history(conversation: Conversation, before: Message) -> list[Turn]:
    """The earlier turns the question ``before`` refers to, oldest first: none when it is a
    question of its own (an earlier topic took over the answers to new ones), else the
    finished questions back to the one it follows up (``follow_ups.topic_questions``, at most
    ``HISTORY_TURNS``), each with its answer only when the user marked that answer helpful:
    earlier answers, wrong or looping, were copied into later ones ("The answer is: 2019"
    four times), and made the first token slower."""
    messages = conversation.messages.shown().filter(status=Message.Status.DONE, id__lt=before.id)
    recent = [m for m in list(messages.order_by("-id")[: HISTORY_TURNS * 2])[::-1] if m.content]
    questions = [m for m in recent if m.role == Message.Role.USER]
    topic = topic_questions([m.content for m in questions], before.content)
    if not topic:
        return []
    first = questions[len(questions) - len(topic)]
    return [
        Turn(role=m.role, content=m.content)
        for m in recent
        if m.id >= first.id and (m.role == Message.Role.USER or m.feedback > 0)
    ]


def generate_request(
    *,
    question: str,
    history: list[Turn],
    citations: Iterable[Citation],
    mode: str,
    answer: Message | None = None,
    recompute_ratio: float | None = None,
    target_ratio: float | None = None,
    refresh_ratio: float | None = None,
    audit_of: int | None = None,
) -> GenerateRequest:
    """The request for ``answer`` (its stream and record; sampled when it is an answer asked
    again), or for an audit of another answer (``audit_of``, a stream of its own). Each
    passage in its owner's KV scope, with its text and, when the worker reads KV through the
    knowledge delivery API (``KV_SOURCE=kdn``), a token that fetches that passage only, as
    the asker, for a short while (``webapp.kdn.tokens``)."""
    sampled = answer is not None and answer.temperature > 0
    citations = list(citations)
    request_id = str(answer.request_id) if answer is not None else str(uuid.uuid4())
    timeout_s = GenerateRequest.timeout_s  # the protocol's default, the token's longest life
    asker = _asker_id(answer, citations)

    def passage(citation: Citation) -> ChunkRef:
        token = _kdn_token(asker, request_id, citation.chunk.text, timeout_s)
        return replace(chunk_ref(citation.chunk), text=citation.chunk.text, kdn_token=token)

    return GenerateRequest(
        request_id=request_id,
        message_id=answer.id if answer is not None else None,
        question=question,
        history=history,
        chunks=[passage(c) for c in citations],
        timeout_s=timeout_s,
        mode=mode,
        recompute_ratio=recompute_ratio,  # None: the worker's controller decides
        target_ratio=target_ratio,  # the fidelity target's least ratio, if one is set
        refresh_ratio=refresh_ratio,  # progressive blend (None: the worker's own setting)
        max_new_tokens=settings.CHAT_MAX_NEW_TOKENS,
        temperature=answer.temperature if sampled else 0.0,
        top_p=REGENERATE_TOP_P if sampled else 1.0,
        seed=answer.seed if sampled else None,
        audit_of=audit_of,
    )


def _kdn_token(asker: int | None, request_id: str, text: str, timeout_s: float) -> str:
    """A token for one passage; none ("") when the worker reads S3 (``KV_SOURCE=s3``, it
    would go unused in the task message) or nobody asked."""
    if asker is None or settings.KV_SOURCE != "kdn":
        return ""
    return request_token(user_id=asker, request_id=request_id, texts=[text], timeout_s=timeout_s)


def _asker_id(answer: Message | None, citations: list[Citation]) -> int | None:
    """Whose question it is: the answer's conversation's owner (an audit's: the audited
    answer's, through its citations)."""
    message = answer if answer is not None else (citations[0].message if citations else None)
    return None if message is None else message.conversation.owner_id
