"""The documents page: upload (several files, drag and drop), live status, retry, delete,
download of the original; a document's own page (where its owner renames it), read-only for
a user it is shared with.

``GET documents/`` serves the full page, or only the list partial to htmx (which polls it
while anything is still processing)."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from webapp.documents import quotas, selectors, services
from webapp.documents.models import Document

POLL_SECONDS = 2


def get_document_for_user(
    request: HttpRequest, document_id: int, *, change: bool = False
) -> Document:
    """The one access check of the document pages: a document the user may not read is a 404
    (it never says whether it exists); one shared with them reads, and a ``change`` by them
    is a 403."""
    document = selectors.document_get_readable(user=request.user, document_id=document_id)
    if document is None:
        raise Http404("No such document.")
    if change and document.owner_id != request.user.pk:
        raise PermissionDenied("This document is shared with you read-only.")
    return document


def _list_response(
    request: HttpRequest,
    *,
    status: int = 200,
    errors: list[str] | None = None,
    duplicates: list[tuple[str, Document]] | None = None,
    uploaded: list[str] | None = None,
) -> HttpResponse:
    documents = list(selectors.document_list(owner=request.user).prefetch_related("collections"))
    context = {
        "errors": errors or [],
        "upload_answer": duplicates is not None,  # an upload's answer (not a poll)
        "duplicates": duplicates or [],
        "uploaded": uploaded or [],
        "documents": documents,
        "polling": selectors.documents_active(documents),
        "poll_seconds": POLL_SECONDS,
        "max_upload_mb": settings.MAX_UPLOAD_BYTES // (1024 * 1024),
        "usage": quotas.usage_of(request.user),
    }
    template = "documents/_list.html" if request.htmx else "documents/list.html"
    return render(request, template, context, status=status)


@login_required
@require_http_methods(["GET", "POST"])
def document_list(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return _list_response(request)
    files = request.FILES.getlist("files")
    errors = [] if files else ["Choose one or more files to upload."]
    duplicates: list[tuple[str, Document]] = []  # (the name uploaded, the document it already is)
    uploaded: list[str] = []  # the names of the documents added
    for uploaded_file in files:
        try:
            result = services.document_upload_result(
                owner=request.user, uploaded_file=uploaded_file
            )
        except (services.UploadRefused, services.TransientError) as err:
            errors.append(f"{uploaded_file.name}: {err}")
            continue
        if result.duplicate:
            duplicates.append((uploaded_file.name, result.document))
        else:
            uploaded.append(uploaded_file.name)
    if request.htmx:
        return _list_response(request, errors=errors, duplicates=duplicates, uploaded=uploaded)
    for error in errors:
        messages.error(request, error)
    if uploaded:
        messages.success(request, f"Uploaded {', '.join(uploaded)}.")
    for name, document in duplicates:
        notice = render_to_string("documents/_duplicate.html", {"name": name, "document": document})
        messages.info(request, notice)  # safe HTML: the message storage keeps it so
    return redirect("documents:list")


def _detail_context(request: HttpRequest, document: Document) -> dict[str, object]:
    is_owner = document.owner_id == request.user.pk
    context: dict[str, object] = {
        "document": document,
        "is_owner": is_owner,
        "chunks": selectors.document_chunks(document=document),
    }
    if is_owner:
        context |= {
            "collections": request.user.collections.all(),
            "in_collections": set(document.collections.values_list("pk", flat=True)),
        }
    else:
        context["shared_through"] = selectors.collections_sharing(
            document=document, user=request.user
        )
    return context


@login_required
@require_GET
def document_detail(request: HttpRequest, document_id: int) -> HttpResponse:
    """Its owner sees the collections it is in and can change them, and can rename it; a user
    it is shared with sees whose it is and through which collections, and nothing to change."""
    document = get_document_for_user(request, document_id)
    return render(request, "documents/detail.html", _detail_context(request, document))


@login_required
@require_POST
def document_rename(request: HttpRequest, document_id: int) -> HttpResponse:
    """From the document's page, its owner only. htmx gets the heading back (renamed, or the
    error with the name as typed: a 200, since htmx swaps no 4xx); without JavaScript, the
    page again, or the page with the error (400) and the name as typed."""
    document = get_document_for_user(request, document_id, change=True)
    typed = request.POST.get("title", "")
    try:
        services.document_rename(document=document, title=typed)
    except services.RenameRefused as err:
        context = {"document": document, "is_owner": True, "typed": typed, "rename_error": err}
        if request.htmx:
            return render(request, "documents/_title.html", context)
        page = _detail_context(request, document) | context
        return render(request, "documents/detail.html", page, status=400)
    if request.htmx:
        context = {"document": document, "is_owner": True, "renamed": True}
        return render(request, "documents/_title.html", context)
    messages.success(request, f"Renamed to “{document.title}”.")
    return redirect("documents:detail", document_id=document.pk)


@login_required
@require_GET
def document_download(request: HttpRequest, document_id: int) -> HttpResponse:
    """The original file, streamed from the object store to whoever may read the document
    (always as a download: an uploaded HTML file is never rendered as one of our pages)."""
    document = get_document_for_user(request, document_id)
    original = selectors.document_original(document=document)
    if original is None:
        raise Http404("The original of this document is not stored.")
    response = FileResponse(
        original, as_attachment=True, filename=document.original_name or document.title
    )
    response["Content-Length"] = str(document.size_bytes)
    response["Cache-Control"] = "private, no-store"
    return response


@login_required
@require_POST
def document_retry(request: HttpRequest, document_id: int) -> HttpResponse:
    document = get_document_for_user(request, document_id, change=True)
    try:
        services.document_retry(document=document)
    except services.RetryNotPossible as err:
        if request.htmx:  # in the list it swaps in (a flashed message would wait for a reload)
            return _list_response(request, errors=[str(err)])
        messages.error(request, str(err))
    if request.htmx:
        return _list_response(request)
    return redirect("documents:list")


@login_required
@require_POST
def document_delete(request: HttpRequest, document_id: int) -> HttpResponse:
    document = get_document_for_user(request, document_id, change=True)
    services.document_delete(document=document)
    if request.htmx:
        return _list_response(request)
    messages.success(request, f"Deleted “{document.title}”.")
    return redirect("documents:list")
