"""Chat pages: conversations, asking, the streamed answer (SSE), and answer actions."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    StreamingHttpResponse,
)
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.html import escape
from django.views.decorators.http import require_GET, require_POST
from redis.exceptions import RedisError

from kvservice.protocol import Queue, Token
from webapp import outages
from webapp.accounts.ratelimits import user_seconds_until_allowed
from webapp.answer_stream import sse, stream_events
from webapp.chat import services
from webapp.chat.conversations import (
    browser_conversations,
    get_conversation_for_user,
    scope_context,
)
from webapp.chat.models import Message
from webapp.chat.selectors import answers_of, citations_of
from webapp.documents.selectors import document_get_readable
from webapp.redis import STREAM_BLOCK_MS

logger = logging.getLogger(__name__)

STREAM_IDLE_LIMIT_S = 330  # a bit over the worker's request timeout: never hang forever
STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")  # a Redis stream entry id, as SSE ``id:`` sends it


def _get_answer_for_user(request: HttpRequest, message_id: int) -> Message:
    return get_object_or_404(answers_of(request.user).select_related("conversation"), id=message_id)


@login_required
@require_GET
def conversation_list(request: HttpRequest) -> HttpResponse:
    services.chat_warm_recent(user=request.user)
    conversations = browser_conversations(request)
    # the bundled demo model (no MODEL_PATH): everyone is told its answers are weak; staff
    # get the line that sets another, users are told their operator can
    demo_model = not settings.MODEL_PATH
    return render(
        request, "chat/index.html", {"conversations": conversations, "demo_model": demo_model}
    )


@login_required
@require_POST
def conversation_new(request: HttpRequest) -> HttpResponse:
    conversation = services.conversation_new(owner=request.user)
    return redirect("chat:conversation", conversation_id=conversation.id)


@login_required
@require_GET
def conversation_detail(request: HttpRequest, conversation_id: int) -> HttpResponse:
    conversation = get_conversation_for_user(request, conversation_id)
    services.chat_warm_recent(user=request.user)
    context = {
        "conversation": conversation,
        "conversations": browser_conversations(request),
        "messages_list": conversation.messages.shown().prefetch_related("citations"),
        "modes": Message.Mode.choices,
        **scope_context(request, conversation),
    }
    return render(request, "chat/conversation.html", context)


@login_required
@require_POST
def conversation_ask(request: HttpRequest, conversation_id: int) -> HttpResponse:
    conversation = get_conversation_for_user(request, conversation_id)
    retry_after = user_seconds_until_allowed(request, request.user)  # as the user's API calls
    if retry_after is not None:
        error = f"You are asking faster than your limit allows; try again in {retry_after} s."
        response = render(request, "chat/_error.html", {"error": error}, status=429)
        response["Retry-After"] = str(retry_after)
        return response
    try:
        answer = services.chat_ask(
            user=request.user,
            conversation=conversation,
            question=request.POST.get("question", ""),
            mode=request.POST.get("mode") or Message.Mode.BLEND,
        )
    except services.ChatError as err:
        if request.htmx:
            unavailable = isinstance(err, services.AnswerServiceUnavailable)
            response = render(
                request, "chat/_error.html", {"error": str(err)}, status=503 if unavailable else 422
            )
            if unavailable:
                response["Retry-After"] = str(outages.RETRY_AFTER_S)
            return response
        flash.error(request, str(err))
        return redirect("chat:conversation", conversation_id=conversation.id)
    if request.htmx:
        question = conversation.messages.filter(role=Message.Role.USER).order_by("-id").first()
        return render(request, "chat/_exchange.html", {"question": question, "message": answer})
    return redirect("chat:conversation", conversation_id=conversation.id)


@login_required
@require_GET
def message_detail(request: HttpRequest, message_id: int) -> HttpResponse:
    return render(
        request, "chat/_message.html", {"message": _get_answer_for_user(request, message_id)}
    )


@login_required
@require_POST
def message_stop(request: HttpRequest, message_id: int) -> HttpResponse:
    answer = _get_answer_for_user(request, message_id)
    services.chat_stop(answer=answer)
    return HttpResponse(status=204)


@login_required
@require_POST
def message_regenerate(request: HttpRequest, message_id: int) -> HttpResponse:
    answer = _get_answer_for_user(request, message_id)
    try:
        new_answer = services.chat_regenerate(
            user=request.user, answer=answer, mode=request.POST.get("mode") or None
        )
    except services.AnswerServiceUnavailable as err:
        return HttpResponse(str(err), status=503)
    except services.ChatError as err:
        return HttpResponseBadRequest(str(err))
    if request.htmx:
        return render(request, "chat/_message.html", {"message": new_answer})
    return redirect("chat:conversation", conversation_id=answer.conversation_id)


@login_required
@require_POST
def message_feedback(request: HttpRequest, message_id: int) -> HttpResponse:
    answer = _get_answer_for_user(request, message_id)
    try:
        value = int(request.POST.get("value", "0"))
        services.chat_feedback(answer=answer, value=value)
    except (ValueError, services.ChatError):
        return HttpResponseBadRequest("Feedback is -1, 0 or 1.")
    return render(request, "chat/_feedback.html", {"message": answer})


@login_required
@require_GET
def citation_detail(request: HttpRequest, citation_id: int) -> HttpResponse:
    """The passage as it was given to the model, and a link to its document while the user
    may still read it (their own, or shared with them)."""
    citation = get_object_or_404(
        citations_of(request.user).select_related("message__conversation"), id=citation_id
    )
    document = None
    if citation.document_id is not None:
        document = document_get_readable(user=request.user, document_id=citation.document_id)
    return render(request, "chat/_citation.html", {"citation": citation, "document": document})


def place_in_line(ahead: int | None) -> str:
    """What the page says of a question waiting for the model (``queue`` events)."""
    if ahead is None:
        return ""  # it is being answered: the words follow
    if ahead == 0:
        return "Yours is the next question the model takes."
    return f"{ahead} question{'s' if ahead != 1 else ''} ahead of yours."


async def _event_stream(answer: Message, last_id: str = "0") -> AsyncIterator[str]:
    """Relay the answer's Redis stream as server-sent events until done/error, from the entry
    after ``last_id``. Each event carries its entry id, so a browser that reconnects (sending
    it back as ``Last-Event-ID``) resumes where it was instead of receiving the answer twice.
    The end comes once the answer is recorded (``kvservice.protocol.events``): the page
    fetches the message again on it, with no wait here for the record."""
    idle = 0.0
    try:
        yield ": connected\n\n"
        async for event in stream_events(str(answer.request_id), last_id):
            if event is None:
                idle += STREAM_BLOCK_MS / 1000
                if idle >= STREAM_IDLE_LIMIT_S:
                    yield sse("failed", "The model did not answer in time.")
                    return
                yield ": keep-alive\n\n"
                continue
            idle = 0.0
            entry_id, streamed = event
            if isinstance(streamed, Token):
                yield sse("token", escape(streamed.text), entry_id)
            elif isinstance(streamed, Queue):
                yield sse("queue", escape(place_in_line(streamed.ahead)), entry_id)
            else:  # the end: Done or Error
                yield sse(streamed.kind, json.dumps(streamed.data()), entry_id)
    except asyncio.CancelledError:  # the browser went away; the answer is still recorded
        raise
    except RedisError as exc:  # the answer goes on and is recorded; only this view is lost
        logger.warning("answer stream %s lost: %r", answer.request_id, exc)
        yield sse("failed", "Lost the connection to the answer stream. Reload to see the answer.")


async def message_stream(request: HttpRequest, message_id: int) -> StreamingHttpResponse:
    user = await request.auser()
    if not user.is_authenticated:
        raise Http404
    answer = await sync_to_async(lambda: answers_of(user).filter(id=message_id).first())()
    if answer is None:
        raise Http404
    last_id = request.headers.get("Last-Event-ID", "")
    last_id = last_id if STREAM_ID.fullmatch(last_id) else "0"
    response = StreamingHttpResponse(
        _event_stream(answer, last_id), content_type="text/event-stream"
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response
