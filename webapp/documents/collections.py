"""Collections pages: create, rename, delete, choose their documents (or a document's
collections), share read-only.

Who may do what is decided in one place, ``_get_collection_for_user``: a collection the user
neither owns nor was given is a 404 (it never says whether it exists); one shared with them
reads, and any change by them is a 403."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.template.defaultfilters import pluralize
from django.views.decorators.http import require_http_methods, require_POST

from webapp.documents import selectors, services
from webapp.documents.models import Collection
from webapp.documents.views import get_document_for_user
from webapp.forms import posted_ids


def _get_collection_for_user(
    request: HttpRequest, collection_id: int, *, change: bool = False
) -> Collection:
    collection = selectors.collection_get_readable(user=request.user, collection_id=collection_id)
    if collection is None:
        raise Http404("No such collection.")
    if change and collection.owner_id != request.user.pk:
        raise PermissionDenied("This collection is shared with you read-only.")
    return collection


@login_required
@require_http_methods(["GET", "POST"])
def collection_list(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        try:
            collection = services.collection_create(
                owner=request.user, name=request.POST.get("name", "")
            )
        except services.CollectionError as err:
            messages.error(request, str(err))
            return redirect("documents:collections")
        return redirect("documents:collection", collection_id=collection.pk)
    collections = selectors.collections_readable(user=request.user).prefetch_related("documents")
    context = {
        "own": [c for c in collections if c.owner_id == request.user.pk],
        "shared": [c for c in collections if c.owner_id != request.user.pk],
    }
    return render(request, "documents/collections.html", context)


@login_required
def collection_detail(request: HttpRequest, collection_id: int) -> HttpResponse:
    collection = _get_collection_for_user(request, collection_id)
    is_owner = collection.owner_id == request.user.pk
    members = set(collection.documents.values_list("pk", flat=True))
    context = {
        "collection": collection,
        "is_owner": is_owner,
        "members": members,
        "documents": (
            selectors.document_list(owner=request.user)
            if is_owner
            else collection.documents.order_by("title", "id")
        ),
        "shared_with": collection.shared_with.order_by("username"),
    }
    return render(request, "documents/collection.html", context)


def _changed(request: HttpRequest, collection: Collection, change, done) -> HttpResponse:
    """Apply ``change`` (a service call), flash its error, or ``done(its result)`` to say
    what changed, back to the collection."""
    try:
        result = change()
    except services.CollectionError as err:
        messages.error(request, str(err))
    else:
        messages.success(request, done(result))
    return redirect("documents:collection", collection_id=collection.pk)


def _documents_saved(collection: Collection) -> str:
    held = collection.documents.count()
    return f"Saved: “{collection.name}” holds {held} document{pluralize(held)}."


def _shared(usernames: list[str]) -> str:
    if not usernames:
        return "Saved: shared with nobody, only you can see this collection."
    return f"Saved: shared read-only with {', '.join(usernames)}."


@login_required
@require_POST
def collection_rename(request: HttpRequest, collection_id: int) -> HttpResponse:
    collection = _get_collection_for_user(request, collection_id, change=True)
    name = request.POST.get("name", "")
    return _changed(
        request,
        collection,
        lambda: services.collection_rename(collection=collection, name=name),
        lambda renamed: f"Renamed to “{renamed.name}”.",
    )


@login_required
@require_POST
def collection_documents(request: HttpRequest, collection_id: int) -> HttpResponse:
    collection = _get_collection_for_user(request, collection_id, change=True)
    ids = posted_ids(request, "documents")
    return _changed(
        request,
        collection,
        lambda: services.collection_set_documents(collection=collection, document_ids=ids),
        lambda _: _documents_saved(collection),
    )


@login_required
@require_POST
def collection_share(request: HttpRequest, collection_id: int) -> HttpResponse:
    collection = _get_collection_for_user(request, collection_id, change=True)
    usernames = request.POST.get("usernames", "").replace(",", " ").split()
    return _changed(
        request,
        collection,
        lambda: services.collection_share(collection=collection, usernames=usernames),
        _shared,
    )


@login_required
@require_POST
def collection_delete(request: HttpRequest, collection_id: int) -> HttpResponse:
    collection = _get_collection_for_user(request, collection_id, change=True)
    services.collection_delete(collection=collection)
    messages.success(request, f"Deleted the collection “{collection.name}”; its documents stay.")
    return redirect("documents:collections")


@login_required
@require_POST
def document_collections(request: HttpRequest, document_id: int) -> HttpResponse:
    """From a document's page: put it in exactly the ticked collections of its owner."""
    document = get_document_for_user(request, document_id, change=True)
    ids = posted_ids(request, "collections")
    services.document_set_collections(document=document, collection_ids=ids)
    messages.success(request, "Saved its collections.")
    return redirect("documents:detail", document_id=document.pk)
