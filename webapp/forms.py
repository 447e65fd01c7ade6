"""Small readers of posted form data shared by the apps' views."""

from __future__ import annotations

from django.http import HttpRequest

MAX_ID_DIGITS = 18  # below PostgreSQL's bigint: a longer "id" would fail the query, not match


def posted_ids(request: HttpRequest, field: str) -> list[int]:
    """The ids ticked in the form's checkboxes named ``field``; anything but a plain id is
    dropped (it can only be a forged or broken form)."""
    return [
        int(value)
        for value in request.POST.getlist(field)
        if value.isascii() and value.isdigit() and len(value) <= MAX_ID_DIGITS
    ]
