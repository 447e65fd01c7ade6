"""Text the database cannot store is refused where it comes in: a 400 that names the field,
never a 500 from the query that would have carried it.

PostgreSQL's text holds no NUL character (psycopg raises ``DataError``), and UTF-8, the
database's encoding, has no lone surrogate (``UnicodeEncodeError``). Where each arrives:

- a NUL: ``%00`` in any query string or form field;
- a lone surrogate: only in a JSON string (``"\\ud800"``). In a query string or a form, its
  bytes (``%ED%A0%80``) are not UTF-8, which Django would silently read as U+FFFD; those are
  refused too, so what is stored is what was sent. (A multipart form's text fields are
  decoded by Django's parser before anyone sees their bytes: there they stay U+FFFD.)

``unstorable_reason`` is the one rule. ``RefuseUnstorableText`` applies it to the query
string and form of every page; the APIs apply it to their JSON through the ``Text`` schema
type (webapp/api/schemas.py) and answer in their own error shapes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import parse_qsl

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
NOT_UTF8 = "The text sent is not valid UTF-8: send it again from the page's form."


def unstorable_reason(text: str) -> str | None:
    """Why the database cannot store ``text`` (words to follow a field's name), or None."""
    if "\x00" in text:
        return "holds a NUL character, which cannot be stored"
    if LONE_SURROGATE.search(text):
        return "holds a lone surrogate, which is not text"
    return None


def _raw_forms(request: HttpRequest) -> list[str]:
    """The query string, and the body when it is a urlencoded form, still percent-encoded."""
    raw = [request.META.get("QUERY_STRING", "")]
    if request.content_type == "application/x-www-form-urlencoded":
        raw.append(request.body.decode("latin-1"))  # byte for byte: only the escapes matter
    return raw


def _is_utf8(raw_form: str) -> bool:
    try:
        parse_qsl(raw_form, keep_blank_values=True, errors="strict")
    except UnicodeDecodeError:
        return False
    return True


def request_problem(request: HttpRequest) -> str | None:
    """What in this request's query string or form cannot be stored, in words; or None."""
    if not all(_is_utf8(raw) for raw in _raw_forms(request)):
        return NOT_UTF8
    for field, values in [*request.GET.lists(), *request.POST.lists()]:
        if reason := unstorable_reason(field):
            return f"A field's name {reason}."
        for value in values:
            if reason := unstorable_reason(value):
                return f"The field “{field}” {reason}: remove it and try again."
    return None


def refused_response(request: HttpRequest, problem: str) -> HttpResponse:
    if getattr(request, "htmx", False):
        return render(request, "chat/_error.html", {"error": problem}, status=400)
    return render(request, "400.html", {"message": problem}, status=400)


class RefuseUnstorableText:
    """A page whose query string or form holds text the database cannot store answers 400
    before its view runs (the API views check their own input, see the module's doc)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_view(self, request: HttpRequest, view_func, view_args, view_kwargs):
        if "ninja" in request.resolver_match.app_names:
            return None
        problem = request_problem(request)
        return None if problem is None else refused_response(request, problem)
