"""Conversation pages besides asking: the sidebar's list, ownership, and what a
conversation searches (its scope of collections and documents)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from webapp.chat import services
from webapp.chat.models import Conversation
from webapp.documents import selectors as documents


def browser_conversations(request: HttpRequest) -> QuerySet[Conversation]:
    """The sidebar: the user's conversations started here (not the API's)."""
    mine = Conversation.objects.filter(owner=request.user, source=Conversation.Source.BROWSER)
    return mine[:100]


def get_conversation_for_user(request: HttpRequest, conversation_id: int) -> Conversation:
    """The one ownership check: someone else's conversation is a 404."""
    return get_object_or_404(Conversation, id=conversation_id, owner=request.user)


def scope_context(request: HttpRequest, conversation: Conversation) -> dict:
    """What the "Search in" panel shows: every collection and document the user may choose,
    and the names of those chosen that they may still read."""
    scope = conversation.scope
    collections = list(documents.collections_readable(user=request.user))
    chosen_documents = documents.documents_readable(user=request.user).filter(
        pk__in=scope.document_ids
    )
    names = [c.name for c in collections if c.pk in scope.collection_ids]
    return {
        "conversation": conversation,
        "scope": scope,
        "scope_names": names + [d.title for d in chosen_documents],
        "scope_collections": collections,
        "scope_documents": documents.document_list(owner=request.user),
    }


def _ids(request: HttpRequest, field: str) -> list[int]:
    return [int(value) for value in request.POST.getlist(field) if value.isdigit()]


@login_required
@require_POST
def conversation_scope(request: HttpRequest, conversation_id: int) -> HttpResponse:
    """Choose what the conversation searches (nothing chosen: all of the user's documents)."""
    conversation = get_conversation_for_user(request, conversation_id)
    try:
        services.conversation_set_scope(
            user=request.user,
            conversation=conversation,
            collection_ids=_ids(request, "collections"),
            document_ids=_ids(request, "documents"),
        )
    except services.ScopeNotFound as err:
        raise Http404(str(err)) from err
    if request.htmx:
        return render(request, "chat/_scope.html", scope_context(request, conversation))
    return redirect("chat:conversation", conversation_id=conversation.id)
