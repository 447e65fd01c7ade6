"""The one access rule of chat: a user reads only their own conversations and answers. The
browser's pages, the answer stream and the API all start from these querysets."""

from __future__ import annotations

from django.db.models import QuerySet

from webapp.chat.models import Citation, Conversation, Message


def conversations_of(user) -> QuerySet[Conversation]:
    return Conversation.objects.filter(owner=user)


def answers_of(user) -> QuerySet[Message]:
    return Message.objects.filter(role=Message.Role.ASSISTANT, conversation__owner=user)


def citations_of(user) -> QuerySet[Citation]:
    """The passages of the user's own answers."""
    return Citation.objects.filter(message__in=answers_of(user))
