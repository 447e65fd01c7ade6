"""A document in a collection shared with a user (#18): its page opens for them read-only (the
title, status, passages and the original to download, nothing to change), any change by them
is a 403 that changes nothing, and everyone else still gets a 404."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.webapp.documents.conftest import upload
from webapp.documents import services
from webapp.documents.models import Chunk, Collection, Document

pytestmark = pytest.mark.django_db

ORIGINAL = b"The harbour of Velmont was dug in 1764 by the guild of rope makers.\n"
PASSAGE = "The harbour of Velmont was dug in 1764 by the guild of rope makers."


@pytest.fixture
def harbour(alice) -> Document:
    """Alice's uploaded file (its original in the real object store), with one passage."""
    result = services.document_upload_result(
        owner=alice, uploaded_file=upload("harbour.txt", ORIGINAL)
    )
    document = result.document
    Document.objects.filter(pk=document.pk).update(status=Document.Status.READY)
    Chunk.objects.create(
        document=document,
        index=0,
        text=PASSAGE,
        token_ids=[1, 2, 3],
        token_count=3,
        token_ids_sha256="a" * 64,
        kv_status=Chunk.KVStatus.READY,
    )
    document.refresh_from_db()
    return document


@pytest.fixture
def handbook(alice, bob, harbour) -> Collection:
    """Alice's collection holding the harbour document, shared with bob."""
    collection = services.collection_create(owner=alice, name="Handbook")
    collection.documents.add(harbour)
    services.collection_share(collection=collection, usernames=["bob"])
    return collection


def _write_urls(document: Document) -> dict[str, str]:
    return {
        "delete": reverse("documents:delete", args=[document.pk]),
        "retry": reverse("documents:retry", args=[document.pk]),
        "collections": reverse("documents:document_collections", args=[document.pk]),
    }


def test_a_shared_reader_opens_the_document_read_only(client, bob, harbour, handbook) -> None:
    client.force_login(bob)
    response = client.get(reverse("documents:detail", args=[harbour.pk]))
    assert response.status_code == 200
    html = response.content.decode()
    assert "<h1>harbour.txt</h1>" in html and "Ready" in html and PASSAGE in html
    notice = html.split('id="shared-notice">', 1)[1].split("</p>", 1)[0]
    assert "Shared with you by alice" in notice and "Handbook" in notice
    download = reverse("documents:download", args=[harbour.pk])
    assert f'href="{download}"' in html
    for url in _write_urls(harbour).values():  # no control that changes it
        assert url not in html
    assert 'id="document-collections"' not in html

    original = client.get(download)
    assert original.status_code == 200
    assert b"".join(original.streaming_content) == ORIGINAL


def test_the_owner_still_gets_the_controls(client, alice, harbour, handbook) -> None:
    client.force_login(alice)
    html = client.get(reverse("documents:detail", args=[harbour.pk])).content.decode()
    assert 'id="document-collections"' in html and 'id="shared-notice"' not in html


def test_a_shared_readers_writes_are_403_and_change_nothing(client, bob, harbour, handbook) -> None:
    other = services.collection_create(owner=bob, name="Bob's")
    Document.objects.filter(pk=harbour.pk).update(status=Document.Status.FAILED)
    client.force_login(bob)
    for action, url in _write_urls(harbour).items():
        response = client.post(url, {"collections": [other.pk]})
        assert response.status_code == 403, action
        assert 'id="error-403"' in response.content.decode()
    harbour.refresh_from_db()
    assert harbour.status == Document.Status.FAILED  # not queued again
    assert list(harbour.collections.all()) == [handbook]
    assert Document.objects.filter(pk=harbour.pk).exists()


def test_without_access_it_is_a_404_everywhere(client, bob, mallory, harbour, handbook) -> None:
    detail = reverse("documents:detail", args=[harbour.pk])
    download = reverse("documents:download", args=[harbour.pk])
    client.force_login(mallory)
    for url in (detail, download):
        assert client.get(url).status_code == 404, url
    for action, url in _write_urls(harbour).items():
        assert client.post(url).status_code == 404, action

    services.collection_share(collection=handbook, usernames=[])  # bob no longer reads it
    client.force_login(bob)
    assert client.get(detail).status_code == 404
    assert client.get(download).status_code == 404
    assert Document.objects.filter(pk=harbour.pk).exists()


def test_the_shared_collection_links_its_documents(client, bob, harbour, handbook) -> None:
    client.force_login(bob)
    page = client.get(reverse("documents:collection", args=[handbook.pk])).content.decode()
    assert f'<a href="{reverse("documents:detail", args=[harbour.pk])}">harbour.txt</a>' in page
