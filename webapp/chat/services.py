"""Chat writes: ask a question (retrieve, record, send to the inference worker), record the
answer when it is complete, stop, regenerate, feedback."""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Iterable, Sequence

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from kvservice.protocol import (
    AnswerMetrics,
    AnswerOutcome,
    Done,
    PassageUse,
    Token,
    Turn,
    end_of,
    inflight_has,
    publish_event,
    request_stop,
    routing,
    stream_ended,
    token_ids_sha256,
)
from webapp import dispatch, outages
from webapp.answer_stream import total_seen_s, ttft_seen_s
from webapp.chat.follow_ups import follow_up_chunks
from webapp.chat.models import Citation, Conversation, Message
from webapp.chat.requests import (
    REGENERATE_TEMPERATURE,
    conversation_history,
    generate_request,
    mode_allowed,
)
from webapp.chat.retrieval import has_ready_chunks, retrieve_question
from webapp.chat.selectors import answers_of
from webapp.dashboard.selectors import request_ratios
from webapp.dashboard.services import fidelity_maybe_audit, fidelity_record
from webapp.documents.kv import kv_scope_for
from webapp.documents.models import Chunk, Document
from webapp.documents.parsing import CONTROL_CHARS
from webapp.documents.selectors import (
    EVERYTHING,
    Scope,
    collections_readable,
    documents_readable,
    scope_is_gone,
)
from webapp.redis import redis_client

log = logging.getLogger(__name__)

# Opening the chat warms the passages of the user's latest answers into the CPU tier of the
# worker that will serve them, at most once per user in this window.
WARM_RECENT_ANSWERS = 10
WARM_EVERY_S = 300


def clean_text(text: str) -> str:
    """User text without control characters (NUL above all, which PostgreSQL text refuses):
    they carry no meaning in a question, so they are dropped rather than failed on."""
    return CONTROL_CHARS.sub("", text).strip()


class ChatError(ValueError):
    """A request the user can fix (shown to them as is)."""


class AnswerServiceUnavailable(ChatError):
    """The question was recorded but could not be sent to the model (the broker is down);
    its answer is marked failed with this message, and asking again later works."""


NOTHING_FOUND = (
    "I found nothing to answer from: you have no ready documents yet. Upload some on the "
    "Documents page (or wait until they are Ready), then ask again."
)
NOTHING_OF_YOUR_OWN = (
    "I found nothing to answer from: you have no ready documents of your own, and a "
    "conversation searches only those until you choose a collection shared with you under "
    "“Search in”. Choose one there (or upload your own), then ask again."
)
NOTHING_IN_SCOPE = (
    "I found nothing to answer from: the collections and documents this conversation searches "
    "have no ready documents. Choose others under “Search in”, or wait until they are Ready."
)
SCOPE_GONE = (
    "I searched nothing: the collections and documents this conversation searches no longer "
    "exist, or are no longer shared with you. Choose others under “Search in” (or none, to "
    "search all your own documents), then ask again."
)
# The same for a program (the API's conversations): the request's parameters, not the page's
# "Search in" (GET /api/v1/collections lists the collections, shared ones too).
API_NOTHING_OF_YOUR_OWN = (
    "I found nothing to answer from: you have no ready documents of your own, and a "
    "conversation searches only those unless the request names collections shared with you "
    "in collection_ids (GET /api/v1/collections lists them). Name one there (or upload your "
    "own), then ask again."
)
API_NOTHING_IN_SCOPE = (
    "I found nothing to answer from: the collections and documents this conversation searches "
    "have no ready documents. Name others in collection_ids or document_ids, or wait until "
    "they are ready."
)
API_SCOPE_GONE = (
    "I searched nothing: the collections and documents this conversation searches no longer "
    "exist, or are no longer shared with you. Name others in collection_ids or document_ids "
    "(or empty lists, to search all your own documents), then ask again."
)
_API_WORDING = {
    NOTHING_OF_YOUR_OWN: API_NOTHING_OF_YOUR_OWN,
    NOTHING_IN_SCOPE: API_NOTHING_IN_SCOPE,
    SCOPE_GONE: API_SCOPE_GONE,
}
NOT_IN_DOCUMENTS = (
    "I could not find this in your documents: no passage is close enough to the question. "
    "Try other words, or upload a document that covers it."
)


class AnswerServiceBusy(AnswerServiceUnavailable):
    """More questions are waiting for the model than ``INFERENCE_MAX_BACKLOG``: this one is
    refused before anything is recorded (a queue that only grows helps nobody)."""


BUSY = "The model is busy with other questions right now; ask again in a few seconds."

SEND_FAILED = (
    "The answer service is not reachable right now, so this question was not sent. "
    "Try again in a moment."
)


def conversation_create(
    *, owner, title: str = "", source: str = Conversation.Source.BROWSER
) -> Conversation:
    return Conversation.objects.create(
        owner=owner, title=title[:200] or "New conversation", source=source
    )


TITLE_CHARS = 80  # a title taken from the first question: cut at a word, then "…"


def title_from(question: str) -> str:
    """A conversation's title from its first question: its first line, cut at a word."""
    text = " ".join(question.split())
    if len(text) <= TITLE_CHARS:
        return text
    cut = text[: TITLE_CHARS - 1].rsplit(" ", 1)[0] or text[: TITLE_CHARS - 1]
    return cut.rstrip(" ,.;:") + "…"


def conversation_new(*, owner) -> Conversation:
    """A browser conversation to type in: the user's newest one without a message if there is
    one (clicking "New conversation" twice piles nothing up), else a new one."""
    empty = Conversation.objects.filter(
        owner=owner, source=Conversation.Source.BROWSER, messages__isnull=True
    ).first()
    return empty or conversation_create(owner=owner)


def conversation_rename(*, conversation: Conversation, title: str) -> Conversation:
    """Give it a title of the user's (it keeps its place in the list)."""
    title = " ".join(clean_text(title).split())[:200]
    if not title:
        raise ChatError("Give the conversation a title.")
    Conversation.objects.filter(pk=conversation.pk).update(title=title)
    conversation.title = title
    return conversation


def conversation_delete(*, conversation: Conversation) -> None:
    """Delete it with its messages; an answer still being written is stopped first."""
    for answer in conversation.messages.filter(
        role=Message.Role.ASSISTANT, status__in=[Message.Status.PENDING, Message.Status.STREAMING]
    ):
        try:
            chat_stop(answer=answer)
        except outages.SERVICE_ERRORS as err:  # the worker then writes to a deleted answer
            log.warning("could not stop answer %s of a deleted conversation: %s", answer.pk, err)
    conversation.delete()


class ScopeNotFound(ChatError):
    """A collection or document in a scope that does not exist or that the user may not read
    (the same answer for both: it never tells whether someone else's exists)."""


def conversation_set_scope(
    *, user, conversation: Conversation, collection_ids: Iterable[int], document_ids: Iterable[int]
) -> Scope:
    """Search these collections and documents in the conversation from now on (none: all of
    the user's own documents). Each must be the user's own or shared with them. The choice is
    remembered as such (``scope_chosen``): once they are all deleted, it searches nothing."""
    scope = Scope.of(collection_ids, document_ids)
    readable = collections_readable(user=user).filter(pk__in=scope.collection_ids)
    if readable.count() != len(scope.collection_ids):
        raise ScopeNotFound("No such collection.")
    documents = documents_readable(user=user).filter(pk__in=scope.document_ids)
    if documents.count() != len(scope.document_ids):
        raise ScopeNotFound("No such document.")
    conversation.scope_collections.set(scope.collection_ids)
    conversation.scope_documents.set(scope.document_ids)
    Conversation.objects.filter(pk=conversation.pk).update(scope_chosen=scope.chosen)
    conversation.scope_chosen = scope.chosen
    return scope


def _send(answer: Message, question: str, history: list[Turn], citations: list[Citation]) -> None:
    request = generate_request(
        answer=answer,
        question=question,
        history=history,
        citations=citations,
        mode=answer.mode,
        **request_ratios(),
    )
    try:
        # To the worker that holds most of the chunks hot, or to whichever is free first.
        route = routing.choose_queue(redis_client(), request.chunks, settings.INFERENCE_QUEUE)
        dispatch.ask(request, route.queue)
    except outages.SERVICE_ERRORS as err:  # the broker is down: say so, leave nothing pending
        Message.objects.filter(pk=answer.pk, status=Message.Status.PENDING).update(
            status=Message.Status.FAILED, error_message=SEND_FAILED
        )
        raise AnswerServiceUnavailable(SEND_FAILED) from err


@transaction.atomic
def chat_ask(
    *, user, conversation: Conversation, question: str, mode: str = Message.Mode.BLEND
) -> Message:
    """Record the question and a pending answer, retrieve its context, and queue generation.
    Returns the pending assistant message; its tokens stream under ``request_id``."""
    question = clean_text(question)
    if not question:
        raise ChatError("Type a question first.")
    if len(question) > settings.CHAT_MAX_QUESTION_CHARS:
        raise ChatError(f"Questions are limited to {settings.CHAT_MAX_QUESTION_CHARS} characters.")
    _check_can_ask(user, mode)
    asked = Message.objects.create(
        conversation=conversation, role=Message.Role.USER, content=question
    )
    history = conversation_history(conversation, before=asked)
    answer = _pending_answer(conversation, mode)
    if conversation.title == "New conversation":
        conversation.title = title_from(question)
    conversation.save(update_fields=["title", "updated_at"])
    return _answer(user=user, answer=answer, asked=asked, history=history)


def _check_can_ask(user, mode: str) -> None:
    """What a question, asked or asked again, must pass before anything is recorded."""
    if mode not in Message.Mode.values:
        raise ChatError(f"Unknown mode {mode!r}.")
    if not mode_allowed(user, mode):
        raise ChatError("Only staff can choose another mode than blend.")
    if inference_backlog() >= settings.INFERENCE_MAX_BACKLOG > 0:
        raise AnswerServiceBusy(BUSY)


def _pending_answer(conversation: Conversation, mode: str, *, sampled: bool = False) -> Message:
    """A pending answer: greedy, or ``sampled`` at ``REGENERATE_TEMPERATURE`` with a seed of
    its own (recorded, so that the attempt can be told apart and repeated)."""
    return Message.objects.create(
        conversation=conversation,
        role=Message.Role.ASSISTANT,
        status=Message.Status.PENDING,
        mode=mode,
        temperature=REGENERATE_TEMPERATURE if sampled else 0.0,
        seed=secrets.randbelow(2**31) if sampled else None,
        asked_at=timezone.now(),
    )


def _answer(*, user, answer: Message, asked: Message, history: list[Turn]) -> Message:
    """Retrieve the passages for the pending ``answer`` to the question ``asked`` and, once
    committed, queue its generation (or say that nothing was found)."""
    conversation = answer.conversation
    topic = [turn.content for turn in history if turn.role == Message.Role.USER]
    citations, parts_not_found = _retrieve(
        user=user, answer=answer, question=asked.content, topic=topic, scope=conversation.scope
    )
    if not citations:  # nothing to answer from: say so, rather than let the model invent
        text = _nothing_found_text(user, conversation)
        transaction.on_commit(lambda: _answer_nothing_found(answer, text))
        return answer
    if parts_not_found:  # said with the answer, by the product rather than the model
        answer.parts_not_found = [part.rstrip("?. ") for part in parts_not_found]
        answer.save(update_fields=["parts_not_found"])
    question = asked.content
    transaction.on_commit(lambda: _send(answer, question, history, citations))
    return answer


def _nothing_found_text(user, conversation: Conversation) -> str:
    """Why nothing was found, and what to do: in a program's conversation (the API), with the
    request's parameters for what the page calls "Search in"."""
    text = _nothing_found_reason(user, conversation)
    if conversation.source == Conversation.Source.API:
        return _API_WORDING.get(text, text)
    return text


def _nothing_found_reason(user, conversation: Conversation) -> str:
    scope = conversation.scope
    if has_ready_chunks(user, scope):
        return NOT_IN_DOCUMENTS
    if scope.is_everything:  # the user's own documents: are others' shared with them?
        shared = documents_readable(user=user).filter(status=Document.Status.READY).exists()
        return NOTHING_OF_YOUR_OWN if shared else NOTHING_FOUND
    return SCOPE_GONE if scope_is_gone(user=user, scope=scope) else NOTHING_IN_SCOPE


def _answer_nothing_found(answer: Message, text: str = NOTHING_FOUND) -> None:
    """The answer when nothing relevant was retrieved (no ready document, or none close
    enough to the question): recorded, and put on its stream like a model's answer, so the
    browser and the API read it the same way. No generation over zero sources."""
    outcome = AnswerOutcome.nothing_retrieved(text, answer.mode)
    record_outcome(message_id=answer.pk, outcome=outcome)
    request_id = str(answer.request_id)
    try:
        publish_event(redis_client(), request_id, Token(text=text))
        publish_event(redis_client(), request_id, Done(outcome))
    except outages.SERVICE_ERRORS as err:  # recorded already: a reload shows it
        raise AnswerServiceUnavailable(SEND_FAILED) from err


def inference_backlog() -> int:
    """Questions waiting for an inference worker (the shared queue and each worker's own);
    0 when the broker does not answer (sending will then fail, and say so on the answer)."""
    try:
        return routing.backlog(redis_client(), settings.INFERENCE_QUEUE)
    except outages.SERVICE_ERRORS:
        return 0


def _retrieve(
    *, user, answer: Message, question: str, topic: Sequence[str] = (), scope: Scope = EVERYTHING
) -> tuple[list[Citation], list[str]]:
    """The passages for the question, best first, and the parts of a question in several
    that none answers. A question of its own is searched alone (each part of one in several:
    ``retrieve_question``), so the relevance check ("not found") and its passages are those
    of a fresh conversation. A follow-up (``topic``: the earlier questions it refers to,
    ``conversation_history``) is also searched with them joined on ("And what about the
    Osprey?" means little on its own), and the passages of both searches are ranked by their
    scores (``follow_ups.follow_up_chunks``). Joining the previous question to every
    question gave new topics the last topic's passages (16 of 22 questions given other
    passages than in a fresh conversation), and 0 of 5 unanswerable questions
    mid-conversation were "not found" (1 of 5 in a fresh one:
    tests/webapp/chat/test_follow_ups.py)."""
    top_k, min_score = settings.RETRIEVAL_TOP_K, settings.RETRIEVAL_MIN_SCORE
    parts_not_found: list[str] = []
    if topic:
        chunks = follow_up_chunks(
            user=user, question=question, topic=topic, top_k=top_k, min_score=min_score, scope=scope
        )
    else:
        retrieved = retrieve_question(
            user=user, question=question, top_k=top_k, min_score=min_score, scope=scope
        )
        chunks, parts_not_found = retrieved.chunks, retrieved.parts_not_found
    citations = Citation.objects.bulk_create(
        [
            Citation(
                message=answer,
                rank=rank,
                chunk=chunk,
                document=chunk.document,
                document_title=chunk.document.title,
                text=chunk.text,
                score=round(chunk.score, 4),
                similarity=round(chunk.similarity, 4),
                text_rank=round(chunk.text_rank, 4),
            )
            for rank, chunk in enumerate(chunks[:top_k], start=1)
        ]
    )
    return citations, parts_not_found


@transaction.atomic
def chat_regenerate(*, user, answer: Message, mode: str | None = None) -> Message:
    """Answer the question before ``answer`` again, in its place, as another attempt
    (sampled: ``REGENERATE_TEMPERATURE``): the new answer takes its time, so its place in
    the conversation, and ``answer`` is kept, unseen (``Message.replaced_by``), for the
    dashboard's measures. Returns the new pending answer."""
    answer = Message.objects.select_for_update().get(pk=answer.pk)  # one regeneration at a time
    if answer.replaced_by_id is not None:
        raise ChatError("This answer has been asked again already.")
    if answer.is_open:
        raise ChatError("Wait for this answer to finish (or stop it) first.")
    conversation = answer.conversation
    question = (
        conversation.messages.filter(role=Message.Role.USER, id__lt=answer.id)
        .order_by("-id")
        .first()
    )
    if question is None:
        raise ChatError("There is no question to answer again.")
    mode = mode or answer.mode or Message.Mode.BLEND
    _check_can_ask(user, mode)
    new_answer = _pending_answer(conversation, mode, sampled=True)
    Message.objects.filter(pk=new_answer.pk).update(created_at=answer.created_at)
    answer.replaced_by = new_answer
    answer.save(update_fields=["replaced_by"])
    history = conversation_history(conversation, before=question)
    return _answer(user=user, answer=new_answer, asked=question, history=history)


def chat_stop(*, answer: Message) -> None:
    """Ask the worker to stop; an answer no worker has started is stopped here and now."""
    if not answer.is_open:
        return
    client, request_id = redis_client(), str(answer.request_id)
    request_stop(client, request_id)  # a worker that takes it later drops it
    if not inflight_has(client, request_id):
        outcome = AnswerOutcome.stopped_unstarted()
        if record_outcome(message_id=answer.pk, outcome=outcome):
            publish_event(client, request_id, Done(outcome))


def chat_feedback(*, answer: Message, value: int) -> Message:
    if value not in (-1, 0, 1):
        raise ChatError("Feedback is -1, 0 or 1.")
    answer.feedback = value
    answer.save(update_fields=["feedback"])
    return answer


def record_outcome(*, message_id: int | None, outcome: AnswerOutcome) -> bool:
    """Store how an answer ended: the worker's report, the reaper's end of an answer no
    worker will finish, an answer with nothing to read, or one stopped before it started.
    The one place an outcome is recorded. Idempotent: once the answer is closed, a repeated
    outcome changes nothing (returns False)."""
    if outcome.audit_of:  # a fidelity re-run in full prefill, not an answer of its own
        fidelity_record(audit_of=outcome.audit_of, outcome=outcome)
        return False
    if not outcome.metrics.temperature:  # a sampled attempt differs by chance
        fidelity_maybe_audit(message_id=message_id, outcome=outcome)  # a share of blend answers
    with transaction.atomic():
        answer = Message.objects.select_for_update().filter(id=message_id).first()
        if answer is None or not answer.is_open:
            return False
        answer.status = {
            "done": Message.Status.DONE,
            "stopped": Message.Status.STOPPED,
        }.get(outcome.status, Message.Status.FAILED)
        answer.content = outcome.text
        answer.withheld_text = outcome.withheld
        answer.error_message = outcome.error
        _record_metrics(answer, outcome.metrics)
        answer.completed_at = timezone.now()
        answer.save()
        _record_passages(answer, outcome.passages)
    return True


def _record_metrics(answer: Message, metrics: AnswerMetrics) -> None:
    """What the worker measured, and the time to first token as the user saw it."""
    answer.mode = metrics.mode or answer.mode
    answer.recompute_ratio = metrics.recompute_ratio
    answer.refresh_ratio = metrics.refresh_ratio
    answer.ttft_s = metrics.ttft_s
    answer.ttft_seen_s = ttft_seen_s(
        asked_at=answer.asked_at, request_id=str(answer.request_id), worker_ttft_s=answer.ttft_s
    )
    answer.total_seen_s = total_seen_s(
        asked_at=answer.asked_at, request_id=str(answer.request_id), ttft_seen=answer.ttft_seen_s
    )
    answer.second_token_s = metrics.second_token_s
    answer.total_s = metrics.total_s
    answer.prompt_tokens = metrics.prompt_tokens
    answer.completion_tokens = metrics.completion_tokens
    answer.finish_reason = metrics.finish_reason
    answer.tiers = dict(Counter(metrics.chunk_tiers.values()))


def record_report(
    *, message_id: int | None, request_id: str | None, outcome: AnswerOutcome
) -> None:
    """The inference worker's report of an answer (the record task): stored, then the
    answer's stream ended with it (``Done``, or ``Error``), so a reader that sees the end finds
    the answer recorded. The outcome crosses from the worker once, in the report: the stream
    carried it too, and its readers had to wait for the record to land. Idempotent: a repeated
    report (the task retried) ends a stream only if nothing has ended it yet; an answer the
    reaper ended first keeps the reaper's end."""
    recorded = record_outcome(message_id=message_id, outcome=outcome)
    if request_id is None:  # an older worker ended its stream itself
        return
    client = redis_client()
    if recorded or not stream_ended(client, request_id):
        publish_event(client, request_id, end_of(outcome))


def _record_passages(answer: Message, passages: list[PassageUse]) -> None:
    """What the worker made of each passage: cited or not, the sentence that supports the
    answer, the tier its KV came from (a passage the prompt had no room for keeps none)."""
    by_rank = {use.rank: use for use in passages}
    for citation in answer.citations.all():
        use = by_rank.get(citation.rank)
        if use is None:
            continue
        citation.tier = use.tier or citation.tier
        citation.cited = use.cited
        citation.highlight_start, citation.highlight_end = use.highlight or (None, None)
        citation.save(update_fields=["tier", "cited", "highlight_start", "highlight_end"])


def chat_warm_recent(*, user) -> list[str]:
    """Ahead of the next question: ask the worker that serves this user's chunks (their home,
    ``routing.home_queue``, where a question over them will go) to load the passages of the
    user's latest answers from S3 into its CPU tier, so that a follow-up does not wait for
    S3. At most once per user per ``WARM_EVERY_S``; returns the keys sent (none when
    throttled or nothing is cached). Best effort: it only saves time, so a broker or Redis
    fault is logged, never raised."""
    answers = answers_of(user)
    recent = answers.order_by("-id")[:WARM_RECENT_ANSWERS]
    chunks = list(
        Chunk.objects.filter(
            document__in=documents_readable(user=user),  # own, or of a collection shared
            id__in=Citation.objects.filter(message__in=recent).values("chunk_id"),
        )
        .exclude(kv_key="")
        .values_list("kv_key", "token_ids", "document__owner_id")
    )
    if not chunks:
        return []
    try:
        client = redis_client()
        if not client.set(f"ragblend:warm-recent:{user.pk}", 1, nx=True, ex=WARM_EVERY_S):
            return []
        digests = [
            routing.chunk_digest(kv_scope_for(owner_id), token_ids_sha256(ids))
            for _, ids, owner_id in chunks
        ]
        queue = routing.home_queue(client, digests, settings.INFERENCE_QUEUE)
        keys = sorted({key for key, _, _ in chunks})
        dispatch.warm(keys, "cpu", queue)
    except outages.SERVICE_ERRORS as err:
        log.warning("could not warm user %s's recent passages: %s", user.pk, err)
        return []
    return keys
