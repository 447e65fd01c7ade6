"""The quotas hold under concurrent writes: uploads sent at once (documents) and documents
ingested at once (tokens of text) never take a user past their quota.

Each race is made certain rather than likely: while the requests run, the test holds a
SHARE lock on the table they insert into, so every request reads what it reads (its quota
check) and then waits to write (or, since the fix, for the quota's lock), and the table's lock
is let go only once all of them are waiting.
Before the fix, all of them had checked an empty quota by then and all of them wrote
(30 concurrent uploads with a quota of 20 stored 27 to 30 documents, unforced)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection, connections, transaction
from django.test import Client

from tests.conftest import wait_for
from tests.webapp.api.conftest import bearer
from tests.webapp.documents import files
from tests.webapp.documents.conftest import upload
from webapp import dispatch
from webapp.documents import quotas, services
from webapp.documents.models import Chunk, Document
from webapp.storage import object_store

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def queued(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """The tasks these writes queue, kept here: the suite's Celery worker, when another test
    started it, would otherwise ingest the same documents beside the race."""
    sent: dict[str, list] = {"ingest": [], "precompute": []}
    monkeypatch.setattr(dispatch, "ingest_on_commit", sent["ingest"].append)
    monkeypatch.setattr(dispatch, "precompute_on_commit", sent["precompute"].append)
    return sent


def _waiting_on_locks(pids: list[int]) -> int:
    """How many of these backends wait for a lock."""
    with connection.cursor() as cursor:
        # The activity is read once a transaction unless its snapshot is dropped.
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE pid = ANY(%s) AND wait_event_type = 'Lock'",
            [pids],
        )
        return cursor.fetchone()[0]


def _in_thread(call: Callable[[], Any], pids: list[int]) -> Callable[[], Any]:
    """``call`` for a worker thread: it names its database backend in ``pids`` first, and
    closes the thread's own connection at the end."""

    def run() -> Any:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pids.append(cursor.fetchone()[0])
            return call()
        finally:
            connections.close_all()

    return run


def race(table: str, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` at once while ``table`` takes no writes, until every one of them waits
    for a lock; their results (or what they raised), in order."""
    pids: list[int] = []
    with ThreadPoolExecutor(len(calls)) as pool:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(f"LOCK TABLE {table} IN SHARE MODE")
            futures = [pool.submit(_in_thread(call, pids)) for call in calls]
            wait_for(
                lambda: _waiting_on_locks(pids) == len(calls) or any(f.done() for f in futures),
                timeout=240,
                what=f"{len(calls)} writers waiting on {table}",
            )
        return [f.exception() or f.result() for f in futures]


def _originals_of(owner) -> list[str]:
    prefix = services.original_object_key(owner_id=owner.pk, content_sha256="")
    found = object_store().list_objects(settings.S3_DOCUMENTS_BUCKET, prefix=prefix)
    return [item.object_name for item in found]


def test_concurrent_uploads_never_pass_the_document_quota(user, settings, queued) -> None:
    settings.QUOTA_DOCUMENTS = 20
    auth = bearer(user)

    def post(n: int) -> Callable[[], Any]:
        body = {"file": SimpleUploadedFile(f"n{n}.txt", files.text_bytes(f"race {n}"))}
        return lambda: Client().post("/api/v1/documents", body, **auth)

    responses = race("documents_document", [post(n) for n in range(30)])
    codes = sorted(r.status_code for r in responses)
    print(f"30 concurrent uploads, quota 20: {codes.count(201)} x 201, {codes.count(422)} x 422")
    assert codes == [201] * 20 + [422] * 10, codes
    refusals = [r.json() for r in responses if r.status_code == 422]
    assert all("quota of 20 documents" in r["message"] for r in refusals), refusals
    assert Document.objects.filter(owner=user).count() == 20
    assert quotas.usage_of(user).documents == 20
    stored = Document.objects.filter(owner=user).values_list("pk", flat=True)
    assert sorted(queued["ingest"]) == sorted(stored)  # each accepted upload, and only those
    # A refused upload keeps no original: one object per document.
    assert sorted(_originals_of(user)) == sorted(
        Document.objects.filter(owner=user).values_list("object_key", flat=True)
    )


def test_concurrent_ingests_never_pass_the_token_quota(user, settings, queued) -> None:
    """Each document alone fits the quota, two do not: of four ingested at once, one gets its
    chunks and three fail, saying why."""
    documents = [
        services.document_upload(
            owner=user, uploaded_file=upload(f"t{n}.txt", files.paragraph(f"tokens {n}").encode())
        )
        for n in range(4)
    ]
    services.document_ingest(document_id=documents[0].pk)  # measures one document's tokens
    one = quotas.usage_of(user).tokens
    Chunk.objects.all().delete()
    queued["precompute"].clear()
    Document.objects.filter(pk=documents[0].pk).update(status=Document.Status.QUEUED)
    settings.QUOTA_TOKENS = one + one // 2

    race(
        "documents_chunk",
        [lambda d=d: services.document_ingest(document_id=d.pk) for d in documents],
    )
    statuses = sorted(Document.objects.filter(owner=user).values_list("status", flat=True))
    print(f"4 concurrent ingests, quota for 1: {statuses}")
    usage = quotas.usage_of(user)
    assert usage.tokens <= settings.QUOTA_TOKENS, (usage.tokens, settings.QUOTA_TOKENS)
    assert statuses == ["failed"] * 3 + ["processing"]
    failed = Document.objects.filter(owner=user, status=Document.Status.FAILED)
    assert all("left in your quota" in d.error_message for d in failed)
    assert not Chunk.objects.filter(document__in=failed).exists()
    # Only the written document's chunks go on to their KV.
    written = Chunk.objects.filter(document__status=Document.Status.PROCESSING)
    assert sorted(sum(queued["precompute"], [])) == sorted(written.values_list("pk", flat=True))
