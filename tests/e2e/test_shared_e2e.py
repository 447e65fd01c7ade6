"""A collection shared read-only, end to end with the real workers: the reader's question is
answered from the owner's passages, and the worker blends the KV the owner's upload stored
(under the owner's KV scope) instead of recomputing the chunks."""

from __future__ import annotations

import pytest
from django.test import TestCase

from tests.e2e.test_chat_e2e import TEXT, collect_stream, upload_ready, wait_recorded
from webapp.chat import services as chat
from webapp.documents import services as documents

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_shared_collections_answer_blends_the_owners_cached_kv(
    celery_worker_process, inference_worker_process, django_user_model
) -> None:
    owner = django_user_model.objects.create_user(username="keeper", password="keeper-pass")
    reader = django_user_model.objects.create_user(username="reader2", password="reader-pass")
    document = upload_ready(owner, TEXT.replace("Zorbian", "Ostrel"), "ostrel.txt")
    collection = documents.collection_create(owner=owner, name="Lighthouses")
    collection.documents.add(document)
    documents.collection_share(collection=collection, usernames=[reader.username])

    conversation = chat.conversation_create(owner=reader)
    chat.conversation_set_scope(
        user=reader, conversation=conversation, collection_ids=[collection.pk], document_ids=[]
    )
    with TestCase.captureOnCommitCallbacks(execute=True):
        answer = chat.chat_ask(
            user=reader, conversation=conversation, question="Who built the Ostrel lighthouse?"
        )
    assert {c.document_id for c in answer.citations.all()} == {document.id}
    _tokens, kind, payload = collect_stream(str(answer.request_id))
    assert kind == "done", payload
    tiers = payload["metrics"]["chunk_tiers"]
    assert set(tiers) == {str(c.chunk_id) for c in answer.citations.all()}
    assert "recomputed" not in tiers.values(), tiers  # found under the owner's key
    wait_recorded(answer)
