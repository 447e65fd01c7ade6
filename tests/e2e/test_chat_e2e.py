"""The product's main job, end to end, through the real Celery worker, the real inference
worker and the bundled SmolLM2: upload, ingest to `ready`, ask, stream, cite, record."""

from __future__ import annotations

import json

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import TestCase

from kvservice.protocol import answer_stream, decode_events
from tests.conftest import wait_for
from webapp.chat import services as chat
from webapp.chat.models import Message
from webapp.documents.models import Document
from webapp.documents.services import document_upload
from webapp.redis import redis_client

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TEXT = (
    "The Zorbian lighthouse stands on the island of Kelmora. It was built in 1887 by the "
    "engineer Ada Fenwick. Its lamp can be seen from forty kilometres away. "
    "The island of Kelmora is famous for its purple sheep, which graze near the lighthouse."
)


def upload_ready(user, text: str = TEXT, name: str = "kelmora.txt") -> Document:
    with TestCase.captureOnCommitCallbacks(execute=True):
        document = document_upload(
            owner=user, uploaded_file=SimpleUploadedFile(name, text.encode())
        )

    def ready():
        document.refresh_from_db()
        assert document.status != "failed", document.error_message
        return document.status == "ready"

    wait_for(ready, timeout=240, interval=0.5, what="the document to be ready")
    return document


def collect_stream(request_id: str, timeout_s: float = 240) -> tuple[list[str], str, dict]:
    tokens: list[str] = []
    last_id = "0"
    client = redis_client()
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = client.xread({answer_stream(request_id): last_id}, block=2000, count=256)
        for entry_id, event in decode_events(reply):
            last_id = entry_id
            if event.kind == "token":
                tokens.append(event.text)
            elif event.kind != "queue":
                return tokens, event.kind, event.data()
    raise AssertionError("no done/error event on the answer stream")


def wait_recorded(answer: Message) -> None:
    """Until the Celery worker has written the worker's report: a test that ends before it
    has its teardown truncate the tables under that write (DeadlockDetected)."""

    def recorded() -> bool:
        answer.refresh_from_db()
        return answer.status == Message.Status.DONE

    wait_for(recorded, timeout=60, what="the answer to be recorded")


def test_upload_ask_and_stream_a_cited_answer(
    celery_worker_process, inference_worker_process, django_user_model
) -> None:
    user = django_user_model.objects.create_user(username="reader", password="reader-pass")
    document = upload_ready(user)
    assert document.chunks.filter(kv_status="ready").count() == document.chunks.count() > 0

    conversation = chat.conversation_create(owner=user)
    with TestCase.captureOnCommitCallbacks(execute=True):
        answer = chat.chat_ask(
            user=user, conversation=conversation, question="Who built the Zorbian lighthouse?"
        )
    tokens, kind, payload = collect_stream(str(answer.request_id))
    assert kind == "done", payload
    assert len(tokens) > 1  # streamed piece by piece, not in one block
    assert "".join(tokens) == payload["text"] and payload["text"].strip()
    metrics = payload["metrics"]
    assert metrics["mode"] == "blend" and metrics["ttft_s"] > 0
    cut = metrics["completion_tokens"] >= settings.CHAT_MAX_NEW_TOKENS
    assert metrics["finish_reason"] == ("length" if cut else "stop"), metrics
    assert set(metrics["chunk_tiers"]) == {str(c.chunk_id) for c in answer.citations.all()}
    # The worker found the KV the ingest worker stored, under the same (user-scoped) key.
    assert "recomputed" not in metrics["chunk_tiers"].values(), metrics["chunk_tiers"]

    # The answer cites the uploaded document, and the worker's report is stored.
    assert {c.document_id for c in answer.citations.all()} == {document.id}

    wait_recorded(answer)
    assert answer.content == payload["text"]
    assert answer.ttft_s == pytest.approx(metrics["ttft_s"])
    assert sum(answer.tiers.values()) == answer.citations.count()


def test_another_user_cannot_see_the_conversation_or_retrieve_the_chunks(
    celery_worker_process, inference_worker_process, django_user_model, client
) -> None:
    owner = django_user_model.objects.create_user(username="owner", password="owner-pass")
    other = django_user_model.objects.create_user(username="other", password="other-pass")
    upload_ready(owner, TEXT.replace("Zorbian", "Quillan"), "quillan.txt")
    conversation = chat.conversation_create(owner=owner)
    with TestCase.captureOnCommitCallbacks(execute=True):
        answer = chat.chat_ask(user=owner, conversation=conversation, question="Who built it?")
    collect_stream(str(answer.request_id))
    wait_recorded(answer)

    client.force_login(other)
    assert client.get(f"/chat/{conversation.id}/").status_code == 404
    assert client.get(f"/chat/messages/{answer.id}/stream").status_code == 404
    other_conversation = chat.conversation_create(owner=other)
    with TestCase.captureOnCommitCallbacks(execute=True):
        theirs = chat.chat_ask(
            user=other, conversation=other_conversation, question="Quillan lighthouse?"
        )
    assert theirs.citations.count() == 0  # nothing of the owner's is retrievable
    _tokens, kind, payload = collect_stream(str(theirs.request_id))
    assert kind == "done", payload
    wait_recorded(theirs)


def test_staff_modes_all_answer_and_full_reads_no_cache(
    celery_worker_process, inference_worker_process, django_user_model
) -> None:
    staff = django_user_model.objects.create_user(
        username="ops", password="ops-pass", is_staff=True
    )
    upload_ready(staff, TEXT.replace("Zorbian", "Merrow"), "merrow.txt")
    conversation = chat.conversation_create(owner=staff)
    seen = {}
    for mode in ("full", "reuse", "prefix", "blend"):
        with TestCase.captureOnCommitCallbacks(execute=True):
            answer = chat.chat_ask(
                user=staff,
                conversation=conversation,
                question="Where is the Merrow lighthouse?",
                mode=mode,
            )
        _tokens, kind, payload = collect_stream(str(answer.request_id))
        assert kind == "done", (mode, payload)
        wait_recorded(answer)
        seen[mode] = payload["metrics"]
    assert seen["full"]["chunk_tiers"] == {} and seen["full"]["recompute_ratio"] == 1.0
    # Reuse asks what full has just answered: served whole from the prefix cache, it records
    # that, and no ratio (none ran); else reuse's own, 0.
    reuse = seen["reuse"]
    assert reuse["recompute_ratio"] == (None if reuse["prefix_cache"] else 0.0), reuse
    assert all(seen[m]["chunk_tiers"] for m in ("reuse", "prefix", "blend")), json.dumps(seen)


def test_a_follow_up_over_the_same_passages_reads_the_previous_turns_kv(
    celery_worker_process, inference_worker_process, django_user_model
) -> None:
    """The second question of a conversation retrieves the passage of the first: the worker
    reads the first turn's context KV as it stands (kvservice.serve.prefix) instead of loading and
    blending the chunk again."""
    user = django_user_model.objects.create_user(username="follower", password="follow-pass")
    upload_ready(user, TEXT.replace("Zorbian", "Tessel"), "tessel.txt")
    conversation = chat.conversation_create(owner=user)
    seen = []
    for question in (
        "Who built the Tessel lighthouse?",
        "From how far away can the lamp of the Tessel lighthouse be seen?",
    ):
        with TestCase.captureOnCommitCallbacks(execute=True):
            answer = chat.chat_ask(user=user, conversation=conversation, question=question)
        _tokens, kind, payload = collect_stream(str(answer.request_id))
        assert kind == "done", payload
        wait_recorded(answer)
        seen.append(payload["metrics"])
    first, second = seen
    # Every prompt starts with the head and "[1]": the first turn reads at most those.
    assert "prefix" not in first["chunk_tiers"].values(), first["chunk_tiers"]
    assert second["prefix_tokens"] > first["prefix_tokens"] + 10, (first, second)
    assert set(second["chunk_tiers"].values()) == {"prefix"}, second["chunk_tiers"]
    assert second["recompute_ratio_effective"] == 0.0  # the passage was blended last turn
    # Served whole from the prefix cache: recorded as such, with no ratio (none ran).
    assert second["prefix_cache"] and second["recompute_ratio"] is None, second
    assert not first["prefix_cache"] and first["recompute_ratio"] is not None, first
