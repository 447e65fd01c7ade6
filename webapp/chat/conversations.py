"""Conversation pages besides asking: the sidebar's list and its search, ownership, rename,
delete, export, and what a conversation searches (its scope of collections and documents)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from webapp.chat import services
from webapp.chat.export import conversation_json, conversation_markdown
from webapp.chat.models import Conversation, Message
from webapp.chat.selectors import conversations_of
from webapp.documents import selectors as documents
from webapp.forms import posted_ids


def browser_conversations(request: HttpRequest) -> QuerySet[Conversation]:
    """The sidebar: the user's conversations started here (not the API's), newest first;
    with ``?q=``, those whose title or any message contains it."""
    mine = conversations_of(request.user).filter(source=Conversation.Source.BROWSER)
    query = request.GET.get("q", "").strip()[:200]
    if query:
        said = Message.objects.shown().filter(content__icontains=query).values("conversation_id")
        mine = mine.filter(Q(title__icontains=query) | Q(id__in=said))
    return mine[:100]


def get_conversation_for_user(request: HttpRequest, conversation_id: int) -> Conversation:
    """The one ownership check: someone else's conversation is a 404."""
    return get_object_or_404(conversations_of(request.user), id=conversation_id)


def scope_context(request: HttpRequest, conversation: Conversation) -> dict:
    """What the "Search in" panel shows: every collection and document the user may choose,
    the names of those chosen that they may still read, and whether all of those are gone."""
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
        "scope_gone": documents.scope_is_gone(user=request.user, scope=scope),
        "scope_collections": collections,
        "scope_documents": documents.document_list(owner=request.user),
    }


@login_required
@require_POST
def conversation_scope(request: HttpRequest, conversation_id: int) -> HttpResponse:
    """Choose what the conversation searches (nothing chosen: all of the user's documents)."""
    conversation = get_conversation_for_user(request, conversation_id)
    try:
        services.conversation_set_scope(
            user=request.user,
            conversation=conversation,
            collection_ids=posted_ids(request, "collections"),
            document_ids=posted_ids(request, "documents"),
        )
    except services.ScopeNotFound as err:
        raise Http404(str(err)) from err
    if request.htmx:
        return render(request, "chat/_scope.html", scope_context(request, conversation))
    return redirect("chat:conversation", conversation_id=conversation.id)


@login_required
@require_POST
def conversation_rename(request: HttpRequest, conversation_id: int) -> HttpResponse:
    conversation = get_conversation_for_user(request, conversation_id)
    try:
        services.conversation_rename(conversation=conversation, title=request.POST.get("title", ""))
    except services.ChatError as err:
        messages.error(request, str(err))
    return redirect("chat:conversation", conversation_id=conversation.id)


@login_required
@require_POST
def conversation_delete(request: HttpRequest, conversation_id: int) -> HttpResponse:
    conversation = get_conversation_for_user(request, conversation_id)
    services.conversation_delete(conversation=conversation)
    messages.success(request, f"Deleted “{conversation.title}”.")
    return redirect("chat:index")


EXPORTS = {  # format -> (writer, content type)
    "md": (conversation_markdown, "text/markdown; charset=utf-8"),
    "json": (conversation_json, "application/json"),
}


@login_required
@require_GET
def conversation_export(request: HttpRequest, conversation_id: int, fmt: str) -> HttpResponse:
    """The conversation as a Markdown or JSON file to download."""
    conversation = get_conversation_for_user(request, conversation_id)
    write, content_type = EXPORTS[fmt]
    response = HttpResponse(write(conversation), content_type=content_type)
    filename = f"conversation-{conversation.pk}.{fmt}"
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["Cache-Control"] = "private, no-store"
    return response
