"""Renaming a document: on its page (htmx, or the plain form) and with
``PATCH /api/v1/documents/{id}``; its owner only (a reader it is shared with gets a 403,
anyone else a 404, as for every change); an empty or too long name is refused saying why,
and the name is shown as text, never as markup."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.webapp.api.conftest import bearer
from tests.webapp.documents.conftest import upload
from webapp.documents import services
from webapp.documents.models import Document

pytestmark = pytest.mark.django_db

HOSTILE = '<script>alert("x")</script> & notes'
JSON = {"content_type": "application/json"}


@pytest.fixture
def notes(alice) -> Document:
    return services.document_upload(owner=alice, uploaded_file=upload("notes.txt", b"Notes."))


@pytest.fixture
def shared_with_bob(alice, bob, notes) -> None:
    collection = services.collection_create(owner=alice, name="Shared")
    collection.documents.add(notes)
    services.collection_share(collection=collection, usernames=["bob"])


def _title(document: Document) -> str:
    document.refresh_from_db()
    return document.title


def test_the_owner_renames_a_document_with_the_plain_form(client, alice, notes) -> None:
    client.force_login(alice)
    page = client.get(reverse("documents:detail", args=[notes.pk])).content.decode()
    assert 'id="document-rename"' in page and 'name="title" value="notes.txt"' in page

    response = client.post(reverse("documents:rename", args=[notes.pk]), {"title": HOSTILE})
    assert response.status_code == 302 and response["Location"] == f"/documents/{notes.pk}/"
    assert _title(notes) == HOSTILE
    page = client.get(response["Location"]).content.decode()
    assert "<script>alert" not in page  # shown as text, in the heading, the list and the message
    assert "<h1>&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; notes</h1>" in page
    listing = client.get(reverse("documents:list")).content.decode()
    assert "<script>alert" not in listing and "&lt;script&gt;alert" in listing


def test_htmx_swaps_in_the_new_name(client, alice, notes) -> None:
    client.force_login(alice)
    response = client.post(
        reverse("documents:rename", args=[notes.pk]),
        {"title": "  Harbour   notes "},
        HTTP_HX_REQUEST="true",
    )
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html  # the heading, not the page
    assert '<div id="document-title">' in html and "<h1>Harbour notes</h1>" in html
    assert "<title>Harbour notes · Ragblend</title>" in html and "Renamed." in html
    assert _title(notes) == "Harbour notes"


@pytest.mark.parametrize(
    ("typed", "error"),
    [
        ("   ", "Give the document a name."),
        ("n" * 256, "A document&#x27;s name can be at most 255 characters; this one has 256."),
    ],
)
def test_an_empty_or_too_long_name_is_refused_saying_why(
    client, alice, notes, typed, error
) -> None:
    client.force_login(alice)
    url = reverse("documents:rename", args=[notes.pk])
    partial = client.post(url, {"title": typed}, HTTP_HX_REQUEST="true")
    assert partial.status_code == 200  # htmx swaps no 4xx: the error shows in the heading
    assert error in partial.content.decode() and 'role="alert"' in partial.content.decode()

    page = client.post(url, {"title": typed})  # without JavaScript: the page, with the error
    html = page.content.decode()
    assert page.status_code == 400 and error in html and "<h1>notes.txt</h1>" in html
    assert f'value="{typed}"' in html  # what was typed is kept
    assert _title(notes) == "notes.txt"


def test_only_the_owner_renames_a_document_on_its_page(
    client, bob, mallory, notes, shared_with_bob
) -> None:
    url = reverse("documents:rename", args=[notes.pk])
    client.force_login(mallory)
    assert client.post(url, {"title": "Mine now"}).status_code == 404
    client.force_login(bob)
    assert client.post(url, {"title": "Mine now"}).status_code == 403
    page = client.get(reverse("documents:detail", args=[notes.pk])).content.decode()
    assert "<h1>notes.txt</h1>" in page and 'id="document-rename"' not in page
    assert _title(notes) == "notes.txt"


def test_the_api_renames_a_document_for_its_owner_only(
    client, alice, bob, mallory, notes, shared_with_bob
) -> None:
    url = f"/api/v1/documents/{notes.pk}"
    renamed = client.patch(url, {"title": " Harbour  notes"}, **JSON, **bearer(alice))
    assert renamed.status_code == 200, renamed.content
    assert renamed.json()["title"] == "Harbour notes" and renamed.json()["id"] == notes.pk
    assert client.get(url, **bearer(alice)).json()["title"] == "Harbour notes"

    assert client.patch(url, {"title": "x"}, **JSON, **bearer(mallory)).status_code == 404
    assert client.patch(url, {"title": "x"}, **JSON, **bearer(bob)).status_code == 403
    assert _title(notes) == "Harbour notes"


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"title": " "}, 400, "Give the document a name."),
        ({"title": "n" * 256}, 400, "at most 255 characters; this one has 256"),
        ({"title": "nul\u0000"}, 422, "title: Value error, holds a NUL character"),
        ({"name": "the collections' field"}, 422, "title: Field required"),
    ],
)
def test_the_api_refuses_a_bad_name_saying_why(client, alice, notes, body, status, says) -> None:
    response = client.patch(f"/api/v1/documents/{notes.pk}", body, **JSON, **bearer(alice))
    assert response.status_code == status, response.content
    assert response.json()["code"] == "invalid_request" and says in response.json()["message"]
    assert _title(notes) == "notes.txt"
