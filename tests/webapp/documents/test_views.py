from __future__ import annotations

import hashlib

import pytest
from django.conf import settings
from django.urls import reverse

from tests.webapp.documents import files
from tests.webapp.documents.conftest import upload
from webapp.documents.models import Document
from webapp.storage import object_store

pytestmark = pytest.mark.django_db


def _stored(key: str) -> bytes:
    response = object_store().get_object(settings.S3_DOCUMENTS_BUCKET, key)
    try:
        return response.read()
    finally:
        response.close()
        response.release_conn()


def test_documents_page_requires_login(client) -> None:
    response = client.get(reverse("documents:list"))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("login"))


def test_upload_of_several_files_stores_originals_and_queues_them(alice_client, user) -> None:
    pdf, md = files.pdf_bytes(), files.markdown_bytes()
    response = alice_client.post(
        reverse("documents:list"),
        {"files": [upload("paper.pdf", pdf), upload("notes.md", md)]},
    )
    assert response.status_code == 302
    documents = {d.title: d for d in Document.objects.filter(owner=user)}
    assert set(documents) == {"paper.pdf", "notes.md"}
    assert documents["paper.pdf"].detected_type == "pdf"
    assert documents["notes.md"].detected_type == "markdown"
    for document, data in ((documents["paper.pdf"], pdf), (documents["notes.md"], md)):
        assert document.status == Document.Status.QUEUED
        assert document.content_sha256 == hashlib.sha256(data).hexdigest()
        assert document.size_bytes == len(data)
        assert _stored(document.object_key) == data


def test_same_content_twice_is_one_document(alice_client, user) -> None:
    data = files.text_bytes("dedupe")
    for name in ("a.txt", "b.txt"):
        alice_client.post(reverse("documents:list"), {"files": [upload(name, data)]})
    assert Document.objects.filter(owner=user).count() == 1


def test_same_content_from_two_users_is_two_documents(client, user, other_user) -> None:
    data = files.text_bytes("shared")
    for who in (user, other_user):
        client.force_login(who)
        client.post(reverse("documents:list"), {"files": [upload("same.txt", data)]})
    assert Document.objects.count() == 2


def _stored_originals(user) -> list[str]:
    prefix = f"originals/{user.pk}/"
    found = object_store().list_objects(settings.S3_DOCUMENTS_BUCKET, prefix=prefix)
    return [item.object_name for item in found]


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("empty.txt", b"", "The file is empty."),
        ("photo.pdf", files.png_bytes(), "Unsupported file type (image/png)"),
        ("archive.docx", b"PK\x03\x04" + b"\x00" * 100, "damaged"),
        ("setup.exe", b"MZ\x90\x00\x03" + bytes(range(256)) * 4, "Unsupported file type"),
        ("blob.txt", bytes(range(256)) * 8, "Unsupported file type (binary data)"),
    ],
)
def test_refused_uploads_are_a_message_and_store_nothing(
    alice_client, user, name, data, message
) -> None:
    response = alice_client.post(
        reverse("documents:list"), {"files": [upload(name, data)]}, follow=True
    )
    shown = [m.message for m in response.context["messages"]]
    assert len(shown) == 1 and shown[0].startswith(f"{name}: ") and message in shown[0]
    assert not Document.objects.filter(owner=user).exists()
    assert _stored_originals(user) == []


def test_a_refusal_is_shown_in_the_htmx_answer_next_to_the_accepted(alice_client, user) -> None:
    accepted = files.text_bytes("kept")
    response = alice_client.post(
        reverse("documents:list"),
        {"files": [upload("kept.txt", accepted), upload("empty.txt", b"")]},
        HTTP_HX_REQUEST="true",
    )
    assert "empty.txt: The file is empty." in response.content.decode()
    kept = Document.objects.get(owner=user)  # the only one
    assert kept.title == "kept.txt" and kept.content_sha256 == hashlib.sha256(accepted).hexdigest()
    assert _stored_originals(user) == [kept.object_key]


def test_oversize_upload_is_refused_with_the_limit_in_the_message(
    alice_client, user, settings
) -> None:
    settings.MAX_UPLOAD_BYTES = 1024
    response = alice_client.post(
        reverse("documents:list"), {"files": [upload("big.txt", b"a. " * 2000)]}, follow=True
    )
    assert "big.txt: The file is too large" in response.content.decode()
    assert "the limit is" in response.content.decode()
    assert not Document.objects.filter(owner=user).exists()


def test_page_lists_only_my_documents_with_status_and_progress(client, user, other_user) -> None:
    Document.objects.create(
        owner=user,
        title="mine.pdf",
        content_sha256="a" * 64,
        status="processing",
        stage="embedding",
        progress=40,
    )
    Document.objects.create(owner=other_user, title="theirs.pdf", content_sha256="b" * 64)
    client.force_login(user)
    html = client.get(reverse("documents:list")).content.decode()
    assert "mine.pdf" in html and "theirs.pdf" not in html
    assert 'value="40"' in html and "Indexing it for search" in html
    assert 'hx-trigger="every' in html  # polls while something is processing
    assert "<html" in html.lower()


def test_htmx_gets_the_partial_and_polling_stops_when_all_done(alice_client, user) -> None:
    Document.objects.create(
        owner=user,
        title="done.txt",
        content_sha256="c" * 64,
        status="ready",
        stage="done",
        progress=100,
    )
    response = alice_client.get(reverse("documents:list"), HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert "<html" not in html.lower() and 'id="document-list"' in html
    assert "hx-trigger" not in html


def test_failed_document_shows_message_and_retry(alice_client, user) -> None:
    Document.objects.create(
        owner=user,
        title="bad.pdf",
        content_sha256="d" * 64,
        object_key="originals/x/d",
        status="failed",
        error_message="This PDF is password-protected.",
    )
    html = alice_client.get(reverse("documents:list")).content.decode()
    assert "This PDF is password-protected." in html
    assert "Retry" in html


def test_retry_requeues_a_failed_document(alice_client, user) -> None:
    document = Document.objects.create(
        owner=user,
        title="bad.pdf",
        content_sha256="e" * 64,
        object_key="originals/x/e",
        status="failed",
        stage="parsing",
        error_message="boom",
    )
    response = alice_client.post(reverse("documents:retry", args=[document.pk]))
    assert response.status_code == 302
    document.refresh_from_db()
    assert (document.status, document.error_message) == ("queued", "")


@pytest.mark.parametrize("action", ["detail", "retry", "delete"])
def test_another_users_document_is_404(client, user, other_user, action) -> None:
    document = Document.objects.create(
        owner=other_user, title="theirs.pdf", content_sha256="f" * 64, status="failed"
    )
    client.force_login(user)
    url = reverse(f"documents:{action}", args=[document.pk])
    response = client.get(url) if action == "detail" else client.post(url)
    assert response.status_code == 404
    assert Document.objects.filter(pk=document.pk, status="failed").exists()


def test_retry_and_delete_need_post(alice_client, user) -> None:
    document = Document.objects.create(owner=user, title="x", content_sha256="9" * 64)
    assert alice_client.get(reverse("documents:delete", args=[document.pk])).status_code == 405
    assert Document.objects.filter(pk=document.pk).exists()


def test_upload_without_files_says_so(alice_client) -> None:
    response = alice_client.post(reverse("documents:list"), {}, HTTP_HX_REQUEST="true")
    assert "Choose one or more files" in response.content.decode()


def test_htmx_upload_returns_the_list_with_the_new_document(alice_client) -> None:
    response = alice_client.post(
        reverse("documents:list"),
        {"files": [upload("fresh.txt", files.text_bytes("fresh"))]},
        HTTP_HX_REQUEST="true",
    )
    html = response.content.decode()
    assert response.status_code == 200 and "fresh.txt" in html
    assert 'hx-trigger="every' in html  # it is queued, so the list polls
    assert "Uploaded fresh.txt: it is being prepared below" in html  # says what happened


def test_an_upload_without_htmx_says_what_was_uploaded(alice_client) -> None:
    response = alice_client.post(
        reverse("documents:list"),
        {"files": [upload("plain.txt", files.text_bytes("plain"))]},
        follow=True,
    )
    assert "Uploaded plain.txt." in response.content.decode()
