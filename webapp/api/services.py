"""API-only writes: an OpenAI-style message list becomes a conversation and a question."""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from webapp.chat import services as chat
from webapp.chat.models import Conversation, Message
from webapp.chat.requests import HISTORY_TURNS
from webapp.documents.selectors import Scope


@transaction.atomic
def completion_ask(
    *, user, turns: list[tuple[str, str]], mode: str, scope: Scope | None = None
) -> Message:
    """Ask the last user turn of ``turns`` ((role, text), oldest first) in a new conversation
    whose earlier user/assistant turns are its history (the model reads the questions, not
    the answers: ``conversation_history``). System turns are not used: the
    deployment's prompt head is fixed (every chunk's KV was computed after it). Only the
    history the model reads is kept (the last ``HISTORY_TURNS`` exchanges, each cut to
    ``CHAT_MAX_QUESTION_CHARS``): a client resending a long conversation stores no more.
    With a ``scope``, only those collections and documents are searched."""
    dialogue = [
        (role, chat.clean_text(text)) for role, text in turns if role in ("user", "assistant")
    ]
    if not dialogue or dialogue[-1][0] != "user":
        raise chat.ChatError("The last message must be the user's question.")
    *earlier, (_, question) = dialogue
    earlier = [(role, text) for role, text in earlier if text][-2 * HISTORY_TURNS :]
    limit = settings.CHAT_MAX_QUESTION_CHARS
    conversation = chat.conversation_create(owner=user, source=Conversation.Source.API)
    if scope is not None:
        chat.conversation_set_scope(
            user=user,
            conversation=conversation,
            collection_ids=scope.collection_ids,
            document_ids=scope.document_ids,
        )
    Message.objects.bulk_create(
        Message(
            conversation=conversation, role=role, content=text[:limit], status=Message.Status.DONE
        )
        for role, text in earlier
    )
    return chat.chat_ask(user=user, conversation=conversation, question=question, mode=mode)
