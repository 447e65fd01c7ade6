"""Per-user quotas of documents and tokens (hence KV bytes): refused with a message that says
what is used and what is allowed; shown on the documents page and in the API."""

from __future__ import annotations

import re

import pytest

from tests.webapp.api.conftest import bearer
from tests.webapp.documents import files
from tests.webapp.documents.conftest import upload
from webapp.documents import quotas, services
from webapp.documents.models import Chunk, Document

pytestmark = pytest.mark.django_db


def test_an_upload_past_the_document_quota_is_refused_with_the_reason(user, settings) -> None:
    settings.QUOTA_DOCUMENTS = 2
    for name in ("a", "b"):
        kept = services.document_upload(
            owner=user, uploaded_file=upload(f"{name}.txt", files.text_bytes(name))
        )
        assert kept.status == Document.Status.QUEUED
    with pytest.raises(services.UploadRefused, match="quota of 2 documents"):
        services.document_upload(owner=user, uploaded_file=upload("c.txt", files.text_bytes("c")))
    assert Document.objects.filter(owner=user).count() == 2  # nothing stored for the third


def test_a_document_over_the_token_quota_fails_once_its_tokens_are_known(user, settings) -> None:
    settings.QUOTA_TOKENS = 40
    document = services.document_upload(
        owner=user, uploaded_file=upload("long.txt", files.paragraph("quota", n=6).encode())
    )
    services.document_ingest(document_id=document.pk)
    document.refresh_from_db()
    assert document.status == Document.Status.FAILED
    assert "left in your quota" in document.error_message and "40 tokens" in document.error_message
    assert not Chunk.objects.filter(document=document).exists()


def test_usage_is_shown_on_the_documents_page_and_in_the_api(
    user, other_user, client, settings
) -> None:
    settings.QUOTA_DOCUMENTS, settings.QUOTA_TOKENS = 10, 1000
    document = Document.objects.create(
        owner=user, title="t", content_sha256="1" * 64, status=Document.Status.READY
    )
    Chunk.objects.create(
        document=document,
        index=0,
        text="x",
        token_ids=[1] * 300,
        token_count=300,
        token_ids_sha256="2" * 64,
    )
    usage = quotas.usage_of(user)
    assert (usage.documents, usage.tokens) == (1, 300)
    assert usage.kv_bytes == 0 and usage.kv_bytes_per_token is None  # no KV stored yet
    assert usage.max_kv_bytes == 1000 * settings.KV_BYTES_PER_TOKEN  # priced at fp16's

    client.force_login(user)
    page = client.get("/documents/").content.decode()
    line = page.split('id="usage"')[1].split("</p>")[0]
    assert "1 of 10 documents" in line and "300 of 1,000 tokens" in line
    assert "{#" not in page and "The quota is in tokens" not in page  # a comment, not text

    mine = client.get("/api/v1/documents/usage", **bearer(user)).json()
    assert mine["tokens"] == 300 and mine["max_kv_bytes"] == 1000 * settings.KV_BYTES_PER_TOKEN
    theirs = client.get("/api/v1/documents/usage", **bearer(other_user)).json()
    assert theirs["documents"] == 0 and theirs["tokens"] == 0

    # The quota is in tokens: no limit in bytes, which changed with the KV stored (21.5 GB
    # with nothing stored, 5.3 GB after an upload).
    Chunk.objects.filter(document=document).update(kv_key="k/a", kv_bytes=300 * 5_000)
    line = client.get("/documents/").content.decode().split('id="usage"')[1].split("</p>")[0]
    assert "1.43 MiB of answer cache" in line  # the dashboard's unit: 1,500,000 bytes
    assert not re.search(r"of [\d.,]+\s?(?:bytes|KB|MB|GB)", line), line


def test_usage_counts_the_kv_bytes_actually_stored_each_object_once(user, client) -> None:
    from django.conf import settings

    document = Document.objects.create(
        owner=user, title="t", content_sha256="1" * 64, status=Document.Status.READY
    )
    for index, (key, nbytes) in enumerate([("k/a", 500_000), ("k/a", 500_000), ("k/b", 0)]):
        # two chunks of identical text share one object; k/b is not stored yet
        Chunk.objects.create(
            document=document,
            index=index,
            text="x",
            token_ids=[1] * 100,
            token_count=100,
            token_ids_sha256=f"{index:064x}",
            kv_key=key,
            kv_bytes=nbytes,
        )
    usage = quotas.usage_of(user)
    assert usage.tokens == 300 and usage.kv_bytes == 500_000 and usage.kv_tokens == 100
    assert usage.kv_bytes_per_token == 5_000
    assert usage.compression_ratio == pytest.approx(settings.KV_BYTES_PER_TOKEN / 5_000)
    assert usage.max_kv_bytes == settings.QUOTA_TOKENS * 5_000  # priced at what is measured
    mine = client.get("/api/v1/documents/usage", **bearer(user)).json()
    assert mine["kv_bytes"] == 500_000 and mine["kv_bytes_per_token"] == 5_000
    assert mine["compression_ratio"] == round(settings.KV_BYTES_PER_TOKEN / 5_000, 2)


def test_a_retry_past_the_document_quota_is_refused_with_the_reason(user, settings) -> None:
    """A failed document does not count against the quota; retried, it would again."""
    settings.QUOTA_DOCUMENTS = 1
    failed = services.document_upload(
        owner=user, uploaded_file=upload("a.txt", files.text_bytes("a"))
    )
    services.document_fail(document_id=failed.pk, message="Storage was unavailable.")
    failed.refresh_from_db()
    services.document_upload(owner=user, uploaded_file=upload("b.txt", files.text_bytes("b")))
    with pytest.raises(services.RetryNotPossible, match="quota of 1 documents"):
        services.document_retry(document=failed)
    failed.refresh_from_db()
    assert failed.status == Document.Status.FAILED and quotas.usage_of(user).documents == 1


def test_a_refused_retry_says_why_in_the_list_htmx_swaps_in(user, alice_client, settings) -> None:
    settings.QUOTA_DOCUMENTS = 1
    failed = services.document_upload(
        owner=user, uploaded_file=upload("a.txt", files.text_bytes("a"))
    )
    services.document_fail(document_id=failed.pk, message="Storage was unavailable.")
    services.document_upload(owner=user, uploaded_file=upload("b.txt", files.text_bytes("b")))
    response = alice_client.post(f"/documents/{failed.pk}/retry", HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert response.status_code == 200 and 'id="document-list"' in html
    assert '<p class="error" role="alert">You have reached your quota of 1 documents' in html
