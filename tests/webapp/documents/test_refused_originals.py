"""No original outlives the upload that stored it being refused: on a private S3 gateway,
frozen with SIGSTOP (tests/webapp/test_frozen_services.py), an upload answers 503 and stores
no row, but the gateway writes the file once it runs again; the purge then removes it.
Before, the purge left it (14 originals for 13 documents)."""

from __future__ import annotations

import hashlib
import io
from datetime import timedelta

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from tests.conftest import wait_for
from tests.webapp import test_frozen_services as frozen_services
from tests.webapp.test_frozen_services import S3_REQUEST_LIMIT_S, frozen, timed
from webapp.documents import services
from webapp.documents.models import Document
from webapp.storage import object_store
from worker import tasks

# The frozen-services module's fixtures, used here too: a private S3 gateway, the web app on
# it, and an API key.
private_s3 = frozen_services.private_s3
web_on_private_s3 = frozen_services.web_on_private_s3
api_auth = frozen_services.api_auth


def _stored_originals(owner_id: int) -> set[str]:
    prefix = services.original_object_key(owner_id=owner_id, content_sha256="")
    listed = object_store().list_objects(settings.S3_DOCUMENTS_BUCKET, prefix=prefix)
    return {item.object_name for item in listed}


def _named_originals(owner_id: int) -> set[str]:
    return set(Document.objects.filter(owner_id=owner_id).values_list("object_key", flat=True))


def _post(auth: dict[str, str], name: str, data: bytes):
    return Client().post("/api/v1/documents", {"file": SimpleUploadedFile(name, data)}, **auth)


def _key_of(owner_id: int, data: bytes) -> str:
    sha = hashlib.sha256(data).hexdigest()
    return services.original_object_key(owner_id=owner_id, content_sha256=sha)


@pytest.mark.slow
@pytest.mark.django_db
def test_an_upload_refused_while_s3_is_frozen_leaves_no_original_after_the_purge(
    web_on_private_s3, private_s3, api_auth
) -> None:
    kept = [_post(api_auth, f"kept{n}.txt", f"Kept notes, number {n}.".encode()) for n in range(3)]
    assert [r.status_code for r in kept] == [201] * 3
    owner_id = Document.objects.get(pk=kept[0].json()["id"]).owner_id
    refused = b"Notes sent while S3 was frozen."
    with frozen(private_s3):
        response, took_s = timed(lambda: _post(api_auth, "frozen.txt", refused))
    print(f"frozen S3 upload: {response.status_code} after {took_s:.1f} s")
    assert response.status_code == 503 and took_s < S3_REQUEST_LIMIT_S, response.content
    late = _key_of(owner_id, refused)
    # The gateway had the request: it writes the file now, though the upload gave up.
    wait_for(lambda: late in _stored_originals(owner_id), timeout=30, what="the late write")
    stored, named = _stored_originals(owner_id), _named_originals(owner_id)
    print(f"frozen S3 upload: {len(stored)} originals for {len(named)} documents after the thaw")
    assert late not in named and len(stored) == len(named) + 1

    tasks.purge_orphan_objects()  # what beat runs every few minutes
    stored = _stored_originals(owner_id)
    print(f"frozen S3 upload: {len(stored)} originals for {len(named)} documents after the purge")
    assert stored == named


@pytest.mark.django_db
def test_the_purge_removes_unreferenced_originals_once_past_the_grace_period(
    web_on_private_s3, private_s3, api_auth
) -> None:
    """An original no row names (left where nothing recorded it, e.g. written after the purge
    of its record ran) goes once older than the grace period; one that a row names stays,
    and a fresh one (an upload between storing its file and its row) is never removed."""
    named = _post(api_auth, "named.txt", b"A document that keeps its original.")
    assert named.status_code == 201
    document = Document.objects.get(pk=named.json()["id"])
    unnamed = _key_of(document.owner_id, b"an upload that never got its row")
    data = b"an upload that never got its row"
    object_store().put_object(settings.S3_DOCUMENTS_BUCKET, unnamed, io.BytesIO(data), len(data))

    assert services.purge_unreferenced_originals() == 0  # all within the grace period
    assert unnamed in _stored_originals(document.owner_id)

    assert services.purge_unreferenced_originals(grace=timedelta(0)) >= 1
    stored = _stored_originals(document.owner_id)
    assert unnamed not in stored and document.object_key in stored
