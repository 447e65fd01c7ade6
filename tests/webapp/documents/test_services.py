from __future__ import annotations

import hashlib
import io

import pytest
from django.conf import settings

from tests.webapp.documents import files
from tests.webapp.documents.conftest import upload
from webapp.documents import services
from webapp.documents.models import Chunk, Document
from webapp.storage import object_store
from worker.kv import kv_producer, kv_store

pytestmark = pytest.mark.django_db


def _stored_kv(n: int) -> str:
    """A tiny chunk KV put into the real store; returns its key."""
    import torch

    from kvservice.chunk import ChunkKV

    k = torch.randn(2, 1, 3, 4)
    chunk = ChunkKV(
        [7, 8, n], k, torch.randn_like(k), model_fingerprint="test-model", head_hash="test-head"
    )
    return kv_store().put(chunk)


def _chunk(document: Document, index: int, kv_key: str) -> Chunk:
    return Chunk.objects.create(
        document=document,
        index=index,
        text=f"chunk {index}",
        token_ids=[1, 2, index],
        token_count=3,
        token_ids_sha256=f"{index:064x}",
        kv_key=kv_key,
        kv_status="ready",
    )


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _original_exists(key: str) -> bool:
    try:
        object_store().stat_object(settings.S3_DOCUMENTS_BUCKET, key)
        return True
    except Exception:  # noqa: BLE001
        return False


def test_delete_removes_chunks_original_and_only_unreferenced_kv(user) -> None:
    a = services.document_upload(owner=user, uploaded_file=upload("a.txt", files.text_bytes("a")))
    b = services.document_upload(owner=user, uploaded_file=upload("b.txt", files.text_bytes("b")))
    shared, only_a, only_b = _stored_kv(1), _stored_kv(2), _stored_kv(3)
    store = kv_store()
    assert all(store.contains(key) for key in (shared, only_a, only_b))
    _chunk(a, 0, shared)
    _chunk(a, 1, only_a)
    _chunk(b, 0, shared)  # identical chunk content in another document: one shared object
    _chunk(b, 1, only_b)

    services.document_delete(document=a)

    assert not Document.objects.filter(pk=a.pk).exists()
    assert not Chunk.objects.filter(document_id=a.pk).exists()
    assert not _original_exists(a.object_key)
    assert not store.contains(only_a)
    assert store.contains(shared)  # still used by b
    assert store.contains(only_b)
    assert _original_exists(b.object_key)

    services.document_delete(document=b)
    assert not store.contains(shared) and not store.contains(only_b)
    assert Chunk.objects.count() == 0


def test_upload_of_existing_content_returns_the_same_document(user) -> None:
    data = files.docx_bytes()
    first = services.document_upload(owner=user, uploaded_file=upload("x.docx", data))
    second = services.document_upload(owner=user, uploaded_file=upload("y.docx", data))
    assert first.pk == second.pk and second.title == "x.docx"


def _left_by_an_old_refusal(user, data: bytes) -> Document:
    """A row as upload refusals left them before they stored nothing: failed, no original."""
    return Document.objects.create(
        owner=user,
        title="t.txt",
        content_sha256=_sha(data),
        status="failed",
        error_message="The file is too large.",
        object_key="",
    )


def test_a_refused_upload_raises_and_stores_nothing(user, settings) -> None:
    settings.MAX_UPLOAD_BYTES = 10
    data = files.text_bytes("limits")
    with pytest.raises(services.UploadRefused, match="too large"):
        services.document_upload(owner=user, uploaded_file=upload("t.txt", data))
    assert not Document.objects.exists()
    key = services.original_object_key(owner_id=user.pk, content_sha256=_sha(data))
    assert not _original_exists(key)


def test_an_old_refusals_row_is_taken_over_by_an_accepted_upload(user) -> None:
    data = files.text_bytes("limits")
    refused = _left_by_an_old_refusal(user, data)
    accepted = services.document_upload(owner=user, uploaded_file=upload("t.txt", data))
    assert accepted.pk == refused.pk
    assert (accepted.status, accepted.error_message) == ("queued", "")
    assert _original_exists(accepted.object_key)


def test_retry_of_an_old_refusals_row_is_not_possible(user) -> None:
    refused = _left_by_an_old_refusal(user, b"e")
    with pytest.raises(services.RetryNotPossible):
        services.document_retry(document=refused)


def test_upload_reads_from_a_file_object_position_independent(user) -> None:
    uploaded = upload("p.txt", files.text_bytes("position"))
    uploaded.read(10)  # someone read part of it before
    document = services.document_upload(owner=user, uploaded_file=uploaded)
    stored = object_store().get_object(settings.S3_DOCUMENTS_BUCKET, document.object_key)
    assert io.BytesIO(stored.read()).getvalue() == files.text_bytes("position")


def test_a_document_that_keeps_killing_the_worker_is_given_up_on(user) -> None:
    document = services.document_upload(
        owner=user, uploaded_file=upload("loop.txt", files.text_bytes("loop"))
    )
    # Each redelivery after a worker death claims it again; past the limit it fails.
    for _ in range(services.MAX_INGEST_ATTEMPTS):
        assert services._claim(document.pk) is not None
    assert services._claim(document.pk) is None
    document.refresh_from_db()
    assert document.status == "failed" and "stopped the worker" in document.error_message
    services.document_retry(document=document)
    document.refresh_from_db()
    assert (document.status, document.ingest_attempts) == ("queued", 0)


def _processing_document(user, name: str, texts: list[str]) -> Document:
    from kvservice.chunk import token_ids_sha256
    from webapp.documents.chunking import llm_tokenizer

    tokenizer = llm_tokenizer()
    document = Document.objects.create(
        owner=user,
        title=name,
        content_sha256=name.ljust(64, "0"),
        status="processing",
        stage="kv",
        progress=70,
    )
    for index, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        sha = token_ids_sha256(ids)
        Chunk.objects.create(
            document=document,
            index=index,
            text=text,
            token_ids=ids,
            token_count=len(ids),
            token_ids_sha256=sha,
        )
    return document


def _precompute(**ids) -> None:
    """The KV task's service, with the KV worker's producer and store."""
    services.document_precompute_kv(**ids, producer=kv_producer(), store=kv_store())


def test_precompute_by_document_stores_shared_kv_once_and_finishes_documents(user) -> None:
    first = _processing_document(user, "first", ["The keeper lit the lamp.", "Storms came."])
    second = _processing_document(user, "second", ["Storms came."])  # the same chunk again

    _precompute(document_id=first.pk)
    first.refresh_from_db()
    assert (first.status, first.stage, first.progress) == ("ready", "done", 100)
    keys = dict(first.chunks.values_list("text", "kv_key"))
    assert all(kv_store().contains(key) for key in keys.values())

    _precompute(chunk_ids=list(second.chunks.values_list("pk", flat=True)))
    second.refresh_from_db()
    assert second.status == "ready"
    assert second.chunks.get().kv_key == keys["Storms came."]  # one content-addressed object

    with pytest.raises(ValueError):
        _precompute()


def test_each_users_kv_is_their_own_unless_the_cache_is_shared(user, other_user, settings) -> None:
    """The same text uploaded by two users: with ``KV_CACHE_SCOPE=user`` (the default) each
    gets an object of their own, so the second upload is not faster than a new text would be
    and answers never show another user's object served from a warm tier."""
    assert settings.KV_CACHE_SCOPE == "user"
    mine = _processing_document(user, "mine", ["The lighthouse keeper kept a log."])
    theirs = _processing_document(other_user, "theirs", ["The lighthouse keeper kept a log."])
    _precompute(document_id=mine.pk)
    _precompute(document_id=theirs.pk)
    my_key, their_key = mine.chunks.get().kv_key, theirs.chunks.get().kv_key
    assert my_key != their_key
    assert (
        my_key.split("/")[-2] == f"u{user.pk}" and their_key.split("/")[-2] == f"u{other_user.pk}"
    )
    assert kv_store().contains(my_key) and kv_store().contains(their_key)

    settings.KV_CACHE_SCOPE = "shared"
    one = _processing_document(user, "one", ["Shared by the whole team."])
    two = _processing_document(other_user, "two", ["Shared by the whole team."])
    _precompute(document_id=one.pk)
    _precompute(document_id=two.pk)
    assert one.chunks.get().kv_key == two.chunks.get().kv_key


def test_a_delete_while_s3_is_down_leaves_nothing_behind_once_s3_is_back(
    user, settings, monkeypatch
) -> None:
    """The document goes at once; its objects are recorded, and the purge that runs after S3
    comes back (beat runs it periodically) deletes them."""
    from webapp.documents.models import OrphanObject

    document = services.document_upload(
        owner=user, uploaded_file=upload("gone.txt", files.text_bytes("gone"))
    )
    kv_key = _stored_kv(41)
    _chunk(document, 0, kv_key)

    live_endpoint = settings.S3_ENDPOINT
    dead_endpoint = f"127.0.0.1:{services_free_port()}"  # S3 "stopped": connection refused
    settings.S3_ENDPOINT = dead_endpoint
    monkeypatch.setenv("S3_ENDPOINT", dead_endpoint)
    object_store.cache_clear()
    kv_store.cache_clear()
    try:
        services.document_delete(document=document)
        assert not Document.objects.filter(pk=document.pk).exists()
        left = OrphanObject.objects.filter(key__in=[document.object_key, kv_key])
        # One tried and failed; the run stopped there instead of waiting on S3 for each.
        assert sorted(o.attempts for o in left) == [0, 1]
        assert services.purge_orphan_objects() == 0  # still down: kept
    finally:
        settings.S3_ENDPOINT = live_endpoint
        monkeypatch.setenv("S3_ENDPOINT", live_endpoint)
        object_store.cache_clear()
        kv_store.cache_clear()

    assert _original_exists(document.object_key) and kv_store().contains(kv_key)
    assert services.purge_orphan_objects() == 2
    assert not _original_exists(document.object_key) and not kv_store().contains(kv_key)
    assert not OrphanObject.objects.exists()


def test_a_purge_keeps_an_object_referenced_again(user) -> None:
    """A KV object recorded as orphan but used again (the same text uploaded since) stays."""
    from webapp.documents.models import OrphanObject

    document = services.document_upload(owner=user, uploaded_file=upload("a.txt", b"again"))
    kv_key = _stored_kv(42)
    OrphanObject.objects.create(kind=OrphanObject.Kind.KV, key=kv_key)
    _chunk(document, 0, kv_key)
    assert services.purge_orphan_objects() == 1
    assert kv_store().contains(kv_key) and not OrphanObject.objects.exists()


def services_free_port() -> int:
    from deploy.services import free_port

    return free_port()
