"""Re-uploading a file says it is already there; the list shows when each was uploaded; the
owner can download the original (streamed from the object store), nobody else can."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.urls import reverse

from tests.webapp.documents import files
from tests.webapp.documents.conftest import upload
from webapp.documents import services
from webapp.documents.models import Document
from webapp.storage import object_store

pytestmark = pytest.mark.django_db


def test_reupload_says_the_file_is_already_there_and_links_it(alice_client, user) -> None:
    data = files.text_bytes("twice")
    alice_client.post(reverse("documents:list"), {"files": [upload("notes.txt", data)]})
    document = Document.objects.get(owner=user)
    response = alice_client.post(
        reverse("documents:list"), {"files": [upload("notes-copy.txt", data)]}, follow=True
    )
    html = response.content.decode()
    assert "“notes-copy.txt” is already here" in html
    assert f'<a href="{reverse("documents:detail", args=[document.pk])}">notes.txt</a>' in html
    assert Document.objects.filter(owner=user).count() == 1


def test_reupload_through_htmx_shows_the_notice_in_the_list(alice_client, user) -> None:
    data = files.text_bytes("twice-htmx")
    alice_client.post(reverse("documents:list"), {"files": [upload("a.txt", data)]})
    response = alice_client.post(
        reverse("documents:list"),
        {"files": [upload("b.txt", data), upload("c.txt", files.text_bytes("new"))]},
        headers={"HX-Request": "true"},
    )
    html = response.content.decode()
    assert html.count("is already here") == 1 and "“b.txt” is already here" in html
    assert Document.objects.filter(owner=user).count() == 2


def test_first_upload_has_no_duplicate_notice(alice_client) -> None:
    response = alice_client.post(
        reverse("documents:list"),
        {"files": [upload("fresh.txt", files.text_bytes("fresh"))]},
        follow=True,
    )
    assert "already here" not in response.content.decode()


def test_upload_result_marks_duplicates(user) -> None:
    data = files.text_bytes("service")
    first = services.document_upload_result(owner=user, uploaded_file=upload("x.txt", data))
    second = services.document_upload_result(owner=user, uploaded_file=upload("y.txt", data))
    assert not first.duplicate and second.duplicate
    assert second.document.pk == first.document.pk


def test_list_shows_the_upload_date(alice_client, user) -> None:
    alice_client.post(
        reverse("documents:list"), {"files": [upload("d.txt", files.text_bytes("d"))]}
    )
    document = Document.objects.get(owner=user)
    html = alice_client.get(reverse("documents:list")).content.decode()
    assert "<th>Uploaded</th>" in html
    assert f'datetime="{document.created_at.isoformat()}"' in html
    assert document.created_at.strftime("%Y-%m-%d %H:%M") in html


def test_owner_downloads_the_original_byte_for_byte(alice_client, user) -> None:
    data = files.pdf_bytes()
    alice_client.post(reverse("documents:list"), {"files": [upload("paper.pdf", data)]})
    document = Document.objects.get(owner=user)
    url = reverse("documents:download", args=[document.pk])
    assert f'href="{url}"' in alice_client.get(reverse("documents:list")).content.decode()
    response = alice_client.get(url)
    assert response.status_code == 200
    assert response.streaming
    assert b"".join(response.streaming_content) == data
    assert response["Content-Disposition"] == 'attachment; filename="paper.pdf"'
    assert response["Content-Type"] == "application/pdf"
    assert response["Content-Length"] == str(len(data))


def test_other_users_and_anonymous_cannot_download(client, user, other_user) -> None:
    client.force_login(user)
    client.post(reverse("documents:list"), {"files": [upload("secret.txt", b"alice's secret")]})
    url = reverse("documents:download", args=[Document.objects.get(owner=user).pk])
    client.force_login(other_user)
    response = client.get(url)
    assert response.status_code == 404
    assert b"alice's secret" not in response.content
    client.logout()
    assert client.get(url).status_code == 302  # to the login page


def test_refused_or_vanished_originals_are_404(alice_client, user) -> None:
    # A row as upload refusals left them before they stored nothing: failed, no original.
    refused = Document.objects.create(
        owner=user, title="empty.txt", content_sha256="e" * 64, status="failed", object_key=""
    )
    list_html = alice_client.get(reverse("documents:list")).content.decode()
    assert reverse("documents:download", args=[refused.pk]) not in list_html
    assert alice_client.get(reverse("documents:download", args=[refused.pk])).status_code == 404

    alice_client.post(reverse("documents:list"), {"files": [upload("gone.txt", b"soon gone")]})
    gone = Document.objects.get(owner=user, original_name="gone.txt")
    object_store().remove_object(settings.S3_DOCUMENTS_BUCKET, gone.object_key)
    assert alice_client.get(reverse("documents:download", args=[gone.pk])).status_code == 404
