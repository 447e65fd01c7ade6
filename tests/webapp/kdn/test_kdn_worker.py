"""The inference worker reading KV through the knowledge delivery API (``KV_SOURCE=kdn``),
the request tokens it reads with, DELETE, and stored texts in the quota, against the running
stack: the real Celery worker ingests documents and computes KV into the S3 gateway, a live
server serves /kdn/v1, and the worker's store reads through it with no S3 tier at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from django.core import signing
from django.test import Client

from kvservice.kdn.client import KdnClient, KdnRead, KdnTier, KvSource, kdn_store
from kvservice.protocol import ChunkRef, GenerateRequest
from kvservice.protocol.keys import ChunkKey
from kvservice.store import KVLoader, StoreConfig
from kvservice.store.format import decode_chunk
from kvservice.store.s3 import S3Tier
from tests.conftest import ROOT
from tests.e2e.test_chat_e2e import upload_ready
from tests.webapp.api.conftest import bearer
from webapp.chat.models import Citation, Conversation, Message
from webapp.chat.requests import generate_request
from webapp.documents import quotas
from webapp.documents.models import Chunk, Collection, Document, OrphanObject
from webapp.documents.services import document_delete
from webapp.kdn.models import StoredText
from webapp.kdn.tokens import SALT, request_token, text_digest, token_claims
from worker.kv import kv_store

TEXT = (
    "The Varnholt observatory sits above the village of Ostrel. Its great telescope was "
    "ground by the optician Mira Dalen in 1902, and on clear nights it shows the rings of "
    "Saturn to visitors who climb the four hundred steps from the harbour."
)
PASSAGE = "The river Tamsel freezes every winter, and the ferry to Ostrel then runs on skis."


def _fetch(client: Client, token: str, texts: list[str]):
    body, auth = json.dumps({"texts": texts}), f"Bearer {token}"
    return client.post(
        "/kdn/v1/fetch", body, content_type="application/json", HTTP_AUTHORIZATION=auth
    )


def _delete(client: Client, auth: dict, text: str):
    return client.delete(
        "/kdn/v1/kv", json.dumps({"text": text}), content_type="application/json", **auth
    )


def _worker_store(url: str):
    """The store a worker builds with KV_SOURCE=kdn: its CPU tier, then the API."""
    source = KvSource.from_env({"KV_SOURCE": "kdn", "KDN_URL": url})
    config = StoreConfig(
        s3_endpoint="http://127.0.0.1:1",
        s3_access_key="unused",
        disk_capacity_bytes=0,
        cpu_capacity_bytes=1 << 30,
    )
    return kdn_store(config, source)


def _no_recompute(token_ids):
    raise AssertionError("the chunk was recomputed, not read through the API")


@pytest.mark.django_db(transaction=True)
def test_the_workers_store_reads_a_passage_through_the_api_with_the_request_token(
    celery_worker_process, live_server, alice, bob
) -> None:
    document = upload_ready(alice, TEXT, "varnholt.txt")
    chunk = document.chunks.get()
    key = ChunkKey.from_string(chunk.kv_key)
    expected = decode_chunk(kv_store().store.durable.get(key), key.unscoped())

    store = _worker_store(live_server.url)
    assert store.durable is None and not any(isinstance(t, S3Tier) for t in store.tiers)
    assert [t.name for t in store.tiers] == ["cpu", "kdn"]
    kdn = store.tier("kdn")
    token = request_token(user_id=alice.pk, request_id="r-1", texts=[chunk.text], timeout_s=60)
    kdn.expect({key: KdnRead(chunk.text, token, time.monotonic() + 60)})
    with KVLoader(store) as loader:
        batch = loader.open([key], token_ids=[chunk.token_ids], recompute_fn=_no_recompute)
        assert batch.tiers == ["kdn"]
        source = batch[0]
        for index in range(source.num_layers):
            k, v = source.layer(index)
            assert torch.equal(k, expected.k[index]) and torch.equal(v, expected.v[index])
        # Read whole and checked, it is the worker's own now: the next question reads memory.
        time.sleep(0.2)
        assert store.where(key) == "cpu"
        assert loader.open([key], token_ids=[chunk.token_ids]).tiers == ["cpu"]
    assert kdn.stats().hits >= 1 and kdn.stats().bytes_read > 0

    # Bob may not read alice's passage: the fetch is a 404, and the worker recomputes it.
    bobs = request_token(user_id=bob.pk, request_id="r-2", texts=[chunk.text], timeout_s=60)
    client = Client()
    response = _fetch(client, bobs, [chunk.text])
    assert response.status_code == 404 and response.json()["code"] == "not_stored"
    store = _worker_store(live_server.url)
    store.tier("kdn").expect({key: KdnRead(chunk.text, bobs, time.monotonic() + 60)})
    recomputed = []

    def recompute(token_ids):
        recomputed.append(token_ids)
        return expected

    with KVLoader(store) as loader:
        batch = loader.open([key], token_ids=[chunk.token_ids], recompute_fn=recompute)
        assert batch.tiers == ["recomputed"] and recomputed == [chunk.token_ids]
    assert kv_store().contains(chunk.kv_key)  # the worker wrote nothing upstream, deleted nothing

    # Shared with him, the passage is his to read (his questions cite it): found by its text.
    collection = Collection.objects.create(owner=alice, name="stars")
    collection.documents.add(document)
    collection.shared_with.add(bob)
    response = _fetch(client, bobs, [chunk.text])
    assert response.status_code == 200
    assert int(response["X-KV-Tokens"]) == len(chunk.token_ids)
    # Alice's API key finds her document's passage by text too, with no PUT first.
    api = KdnClient(live_server.url, bearer(alice)["HTTP_AUTHORIZATION"].removeprefix("Bearer "))
    (fetched,) = api.fetch_chunks([chunk.text])
    assert torch.equal(fetched.v, expected.v)
    # A PUT of the same text finds the document's object; deleting the record keeps it.
    assert api.put(chunk.text)["computed"] is False
    deleted = api.delete(chunk.text)
    assert deleted == {"key": chunk.kv_key, "tokens": len(chunk.token_ids), "kv_deleted": False}
    assert kv_store().contains(chunk.kv_key)
    # The other way round: deleting the document keeps the object a stored text names, and
    # deleting that text last deletes it.
    assert api.put(chunk.text)["computed"] is False
    document_delete(document=document)
    assert kv_store().contains(chunk.kv_key) and not OrphanObject.objects.exists()
    deleted = api.delete(chunk.text)
    assert deleted == {"key": chunk.kv_key, "tokens": len(chunk.token_ids), "kv_deleted": True}
    assert not kv_store().contains(chunk.kv_key)
    api.close()


@pytest.mark.django_db
def test_an_expired_or_forged_token_is_a_401(alice) -> None:
    client = Client()
    expired = request_token(user_id=alice.pk, request_id="r-1", texts=[PASSAGE], timeout_s=-1)
    assert _fetch(client, expired, [PASSAGE]).status_code == 401
    valid = request_token(user_id=alice.pk, request_id="r-1", texts=[PASSAGE], timeout_s=60)
    payload = signing.loads(valid, salt=SALT)
    forged = [
        valid[:-2] + ("AA" if not valid.endswith("AA") else "BB"),  # signature changed
        signing.dumps({**payload, "u": alice.pk + 1}, salt="another-salt"),  # signed otherwise
        signing.dumps(payload, key="not-the-secret-key-" * 3, salt=SALT),  # another secret
    ]
    for token in forged:
        response = _fetch(client, token, [PASSAGE])
        assert response.status_code == 401, token
    assert _fetch(client, valid, [PASSAGE]).status_code == 404  # valid: nothing stored
    # A token fetches; it does not store or delete.
    auth = {"HTTP_AUTHORIZATION": f"Bearer {valid}"}
    assert _delete(client, auth, PASSAGE).status_code == 401
    put = client.put(
        "/kdn/v1/kv", json.dumps({"text": PASSAGE}), content_type="application/json", **auth
    )
    assert put.status_code == 401


@pytest.mark.django_db
def test_an_inactive_users_token_is_a_401(alice) -> None:
    token = request_token(user_id=alice.pk, request_id="r-1", texts=[PASSAGE], timeout_s=60)
    alice.is_active = False
    alice.save()
    assert _fetch(Client(), token, [PASSAGE]).status_code == 401


@pytest.mark.django_db
def test_stored_texts_count_in_usage_and_the_quota(alice, alice_auth, mallory, settings) -> None:
    client = Client()
    before = client.get("/api/v1/documents/usage", **alice_auth).json()
    assert before["tokens"] == before["kdn_tokens"] == 0
    key = f"fp/{'1' * 64}/u{alice.pk}/{'2' * 64}"
    StoredText.objects.create(
        owner=alice,
        tokens_sha256="2" * 64,
        head_hash="1" * 64,
        kv_key=key,
        token_count=1200,
        kv_bytes=6000,
    )
    StoredText.objects.create(
        owner=mallory,
        tokens_sha256="3" * 64,
        head_hash="1" * 64,
        kv_key=key.replace("2", "3"),
        token_count=50,
        kv_bytes=9,
    )
    usage = client.get("/api/v1/documents/usage", **alice_auth).json()
    assert usage["tokens"] == usage["kdn_tokens"] == 1200
    assert usage["kv_bytes"] == 6000 and usage["kv_bytes_per_token"] == 5.0
    settings.QUOTA_TOKENS = 1000
    assert "1,200" in quotas.upload_refusal(alice)  # an upload is refused as over the quota
    page = Client()
    page.force_login(alice)
    assert "1,200" in page.get("/documents/").content.decode()


@pytest.mark.django_db(transaction=True)
def test_delete_removes_the_text_and_its_kv_only_for_its_owner(
    celery_worker_process, alice, alice_auth, mallory_auth
) -> None:
    client = Client()
    put = client.put(
        "/kdn/v1/kv", json.dumps({"text": PASSAGE}), content_type="application/json", **alice_auth
    )
    assert put.status_code == 200, put.content
    key = put.json()["key"]
    assert client.get("/api/v1/documents/usage", **alice_auth).json()["kdn_tokens"] > 0

    response = _delete(client, mallory_auth, PASSAGE)  # not hers: the same 404 as unknown
    assert response.status_code == 404 and response.json()["code"] == "not_stored"
    assert kv_store().contains(key)

    response = _delete(client, alice_auth, PASSAGE)
    assert response.status_code == 200, response.content
    assert response.json() == {"key": key, "tokens": put.json()["tokens"], "kv_deleted": True}
    assert not kv_store().contains(key) and not StoredText.objects.exists()
    assert client.get("/api/v1/documents/usage", **alice_auth).json()["kdn_tokens"] == 0
    fetch = client.post(
        "/kdn/v1/fetch",
        json.dumps({"texts": [PASSAGE]}),
        content_type="application/json",
        **alice_auth,
    )
    assert fetch.status_code == 404
    assert _delete(client, alice_auth, PASSAGE).status_code == 404


@pytest.mark.django_db
def test_delete_is_in_the_openapi_schema() -> None:
    schema = Client().get("/kdn/v1/openapi.json").json()
    delete = schema["paths"]["/kdn/v1/kv"]["delete"]
    assert "404" in delete["responses"] and "requestBody" in delete


def test_kv_source_is_checked_when_read() -> None:
    assert KvSource.from_env({}).kind == "s3"
    with pytest.raises(ValueError, match="KV_SOURCE=kdn needs KDN_URL"):
        KvSource.from_env({"KV_SOURCE": "kdn"})
    with pytest.raises(ValueError, match="KV_SOURCE must be 's3' or 'kdn', not 'gcs'"):
        KvSource.from_env({"KV_SOURCE": "gcs"})


def test_the_vllm_engine_refuses_kdn_as_its_kv_source(monkeypatch) -> None:
    from kvservice.config import WorkerConfig

    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("ENGINE", "vllm")
    monkeypatch.setenv("KV_SOURCE", "s3")
    assert WorkerConfig.from_env().engine == "vllm"
    monkeypatch.setenv("KV_SOURCE", "kdn")
    with pytest.raises(ValueError, match="KV_SOURCE=kdn works with ENGINE=native only"):
        WorkerConfig.from_env()


def test_the_worker_refuses_to_start_with_kdn_and_no_kdn_url(redis_service) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("S3_", "KDN_"))}
    env |= {"KV_SOURCE": "kdn", "INFERENCE_QUEUE": "inference-never"}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "kvservice.worker"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "KV_SOURCE=kdn needs KDN_URL" in result.stderr
    assert time.monotonic() - started < 60  # refused before loading the model


def test_the_tier_asks_only_for_keys_a_live_request_named() -> None:
    old = GenerateRequest.from_dict(
        {"request_id": "r", "question": "q", "chunks": [{"chunk_id": 1, "token_ids": [5, 6]}]}
    )
    assert old.chunks[0] == ChunkRef(1, [5, 6])  # a job queued before text: read as before
    tier = KdnTier(KdnClient("http://127.0.0.1:1"))  # port 1: any request would fail loudly
    named, expired = ChunkKey.for_tokens("fp", "h", [5, 6]), ChunkKey.for_tokens("fp", "h", [7])
    tier.expect({expired: KdnRead("seven", "t", time.monotonic() - 1)})
    assert not tier.contains(expired) and tier.read_range(expired, 0, 64) is None
    assert not tier.contains(named) and tier.read_range(named, 0, 64) is None
    assert tier.stats().misses == 2 and tier.stats().errors == 0
    tier.expect({named: KdnRead("five six", "t", time.monotonic() + 60)})
    assert tier.contains(named)
    from kvservice.protocol.errors import StoreUnavailable

    with pytest.raises(StoreUnavailable, match="knowledge delivery API"):
        tier.read_range(named, 0, 64)  # the API down: a store fault, the chunk is recomputed
    tier.close()


@pytest.mark.django_db
def test_a_question_sends_each_passage_with_its_text_and_the_askers_token(alice, settings) -> None:
    settings.KV_SOURCE = "kdn"  # with s3 no token is signed (test_kdn_hostile.py)
    document = Document.objects.create(owner=alice, title="t", content_sha256="0" * 64)
    chunk = Chunk.objects.create(
        document=document,
        index=0,
        text="Some words.",
        token_ids=[1, 2],
        token_count=2,
        token_ids_sha256="1" * 64,
    )
    conversation = Conversation.objects.create(owner=alice)
    answer = Message.objects.create(conversation=conversation, role=Message.Role.ASSISTANT)
    citation = Citation.objects.create(
        message=answer, rank=1, chunk=chunk, document=document, document_title="t", text=chunk.text
    )
    request = generate_request(
        question="q", history=[], citations=[citation], mode="blend", answer=answer
    )
    (ref,) = GenerateRequest.from_dict(json.loads(json.dumps(request.to_dict()))).chunks
    assert ref.text == "Some words." and ref.kv_scope == f"u{alice.pk}"
    claims = token_claims(ref.kdn_token)
    assert claims.user_id == alice.pk and claims.request_id == str(answer.request_id)
    assert claims.text_digests == {text_digest("Some words.")}  # this passage, no other
    assert 0 < claims.expires_at - time.time() <= min(request.timeout_s, settings.KDN_TOKEN_TTL_S)
    audit = generate_request(
        question="q", history=[], citations=[citation], mode="full", audit_of=answer.id
    )
    assert token_claims(audit.chunks[0].kdn_token).user_id == alice.pk
