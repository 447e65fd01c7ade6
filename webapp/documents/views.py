"""The documents page: upload (several files, drag and drop), live status, retry, delete.

``GET documents/`` serves the full page, or only the list partial to htmx (which polls it
while anything is still processing)."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from webapp.documents import quotas, selectors, services
from webapp.documents.models import Document

POLL_SECONDS = 2


def _get_document_for_user(request: HttpRequest, document_id: int) -> Document:
    """The one ownership check: someone else's document is a 404, never a 403."""
    document = selectors.document_get(owner=request.user, document_id=document_id)
    if document is None:
        raise Http404("No such document.")
    return document


def _list_response(
    request: HttpRequest, *, status: int = 200, errors: list[str] | None = None
) -> HttpResponse:
    documents = list(selectors.document_list(owner=request.user))
    context = {
        "errors": errors or [],
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
    for uploaded_file in files:
        try:
            services.document_upload(owner=request.user, uploaded_file=uploaded_file)
        except services.TransientError as err:
            errors.append(f"{uploaded_file.name}: {err}")
    if request.htmx:
        return _list_response(request, errors=errors)
    for error in errors:
        messages.error(request, error)
    return redirect("documents:list")


@login_required
def document_detail(request: HttpRequest, document_id: int) -> HttpResponse:
    document = _get_document_for_user(request, document_id)
    chunks = selectors.document_chunks(document=document)
    return render(request, "documents/detail.html", {"document": document, "chunks": chunks})


@login_required
@require_POST
def document_retry(request: HttpRequest, document_id: int) -> HttpResponse:
    document = _get_document_for_user(request, document_id)
    try:
        services.document_retry(document=document)
    except services.RetryNotPossible as err:
        messages.error(request, str(err))
    if request.htmx:
        return _list_response(request)
    return redirect("documents:list")


@login_required
@require_POST
def document_delete(request: HttpRequest, document_id: int) -> HttpResponse:
    document = _get_document_for_user(request, document_id)
    services.document_delete(document=document)
    if request.htmx:
        return _list_response(request)
    messages.success(request, f"Deleted “{document.title}”.")
    return redirect("documents:list")
