"""The knowledge delivery API (/kdn/v1) against the running stack: the real Celery worker
computes a PUT's KV with the bundled model into the S3 gateway, and the client
(kvservice.kdn.client) reads it back through a live server."""

from __future__ import annotations

import json
import time

import pytest
import torch
from django.test import Client

from kvservice.kdn.client import KdnClient, KdnNotFound
from kvservice.protocol.kdn_stream import MAGIC, PREAMBLE
from kvservice.protocol.keys import ChunkKey
from kvservice.store.format import decode_chunk, decode_header
from tests.webapp.api.conftest import bearer

PASSAGE = (
    "The Rhine rises in the Swiss Alps and flows north through Germany and the Netherlands "
    "to the North Sea, carrying barges past Basel, Cologne and Rotterdam."
)
OTHER = "Mount Kilimanjaro is a dormant volcano in Tanzania, the highest mountain in Africa."


def _put(client: Client, auth: dict, text: str, **extra) -> dict:
    """PUT as the API asks: a 202 (the KV worker still computing, e.g. loading its model on a
    busy machine) is PUT again after its Retry-After, for up to five minutes."""
    deadline = time.monotonic() + 300
    while True:
        response = client.put(
            "/kdn/v1/kv",
            json.dumps({"text": text, **extra}),
            content_type="application/json",
            **auth,
        )
        if response.status_code != 202 or time.monotonic() > deadline:
            break
        time.sleep(float(response.headers.get("Retry-After", 1)))
    assert response.status_code == 200, response.content
    return response.json()


def _fetch(client: Client, auth: dict, body) -> object:
    data = body if isinstance(body, str) else json.dumps(body)
    return client.post("/kdn/v1/fetch", data, content_type="application/json", **auth)


def _stored_object(key: str):
    from worker.kv import kv_store

    chunk_key = ChunkKey.from_string(key)
    return chunk_key, kv_store().store.durable.get(chunk_key)


@pytest.mark.django_db(transaction=True)
def test_put_stores_once_and_fetch_streams_the_stored_bytes(
    celery_worker_process, alice, alice_auth
) -> None:
    client = Client()
    first = _put(client, alice_auth, PASSAGE)
    again = _put(client, alice_auth, PASSAGE)
    assert first["computed"] and not again["computed"]  # idempotent: computed once
    assert again["key"] == first["key"]
    key, data = _stored_object(first["key"])
    assert key.scope == f"u{alice.pk}"
    assert first["stored_bytes"] == len(data) and first["tokens"] == decode_header(data).num_tokens

    response = _fetch(client, alice_auth, {"texts": [PASSAGE]})
    assert response.status_code == 200
    assert response["Content-Type"] == "application/octet-stream"
    assert int(response["X-KV-Tokens"]) == first["tokens"]
    body = b"".join(response)
    assert len(body) == int(response["Content-Length"])
    magic, version, _, count, layers = PREAMBLE.unpack_from(body)
    header = decode_header(data)
    assert (magic, version, count, layers) == (MAGIC, 1, 1, header.num_layers)
    # one chunk: the stream is the preamble, then the object itself from its first byte
    assert body[PREAMBLE.size :] == bytes(data)


@pytest.mark.django_db(transaction=True)
def test_the_client_decodes_to_the_tensors_the_store_holds(
    celery_worker_process, live_server, alice
) -> None:
    api_key = bearer(alice)["HTTP_AUTHORIZATION"].removeprefix("Bearer ")
    client = KdnClient(live_server.url, api_key)
    head = "You answer from the passages below.\n"
    stored = [client.put(text, head=head) for text in (PASSAGE, OTHER)]
    fetch = client.fetch([OTHER, PASSAGE], head=head)
    assert fetch.total_tokens == sum(s["tokens"] for s in stored)
    chunks = fetch.chunks()
    for chunk, info in zip(chunks, reversed(stored), strict=True):
        key, data = _stored_object(info["key"])
        expected = decode_chunk(data, key.unscoped())
        assert chunk.token_ids == expected.token_ids
        assert torch.equal(chunk.k, expected.k) and torch.equal(chunk.v, expected.v)
        assert chunk.head_hash == expected.head_hash != ""
    # layer by layer, as the blender reads them
    sources = client.fetch([PASSAGE], head=head).sources
    assert torch.equal(sources[0].layer(3)[1], chunks[1].v[3])
    with pytest.raises(KdnNotFound, match=r"texts\[0\]"):
        client.fetch([PASSAGE])  # stored after another head only
    client.close()


@pytest.mark.django_db(transaction=True)
def test_another_users_text_and_an_unknown_one_are_404s_naming_them(
    celery_worker_process, alice_auth, mallory_auth
) -> None:
    client = Client()
    _put(client, alice_auth, PASSAGE)
    response = _fetch(client, mallory_auth, {"texts": [PASSAGE]})
    assert response.status_code == 404
    assert response.json()["code"] == "not_stored"
    assert "texts[0]" in response.json()["message"]
    response = _fetch(client, alice_auth, {"texts": [PASSAGE, "Never stored by anyone."]})
    assert response.status_code == 404
    assert "texts[1]" in response.json()["message"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("{not json", ""),
        ({"text": PASSAGE}, "texts"),
        ({"texts": "one text"}, "texts"),
        ({"texts": []}, "texts"),
        ({"texts": [3]}, "texts"),
    ],
)
def test_a_malformed_fetch_is_a_400(alice_auth, body, says) -> None:
    response = _fetch(Client(), alice_auth, body)
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "bad_request"
    assert says in response.json()["message"]


@pytest.mark.django_db
def test_limits_on_count_and_size_are_clear_400s(alice_auth, settings) -> None:
    settings.KDN_MAX_TEXTS = 2
    settings.KDN_MAX_TEXT_TOKENS = 10
    client = Client()
    response = _fetch(client, alice_auth, {"texts": ["a", "b", "c"]})
    assert response.status_code == 400
    assert response.json()["code"] == "too_many_texts"
    assert "at most 2" in response.json()["message"]
    response = client.put(
        "/kdn/v1/kv", json.dumps({"text": PASSAGE}), content_type="application/json", **alice_auth
    )
    assert response.status_code == 400
    assert response.json()["code"] == "text_too_long"
    assert "the limit is 10" in response.json()["message"]
    response = client.put(
        "/kdn/v1/kv", json.dumps({"text": ""}), content_type="application/json", **alice_auth
    )
    assert response.status_code == 400


@pytest.mark.django_db
def test_keys_rate_limits_and_quotas_apply(alice_auth, settings) -> None:
    client = Client()
    assert _fetch(client, {}, {"texts": [PASSAGE]}).status_code == 401
    settings.QUOTA_TOKENS = 5
    response = client.put(
        "/kdn/v1/kv", json.dumps({"text": PASSAGE}), content_type="application/json", **alice_auth
    )
    assert response.status_code == 413
    assert response.json()["code"] == "quota_exceeded"
    settings.API_RATE_LIMIT_REQUESTS = 1
    statuses = [_fetch(client, alice_auth, {"texts": [PASSAGE]}).status_code for _ in range(3)]
    assert statuses[-1] == 429


@pytest.mark.django_db
def test_the_two_calls_are_in_the_openapi_schema(alice_auth) -> None:
    schema = Client().get("/kdn/v1/openapi.json").json()
    assert "put" in schema["paths"]["/kdn/v1/kv"]
    fetch = schema["paths"]["/kdn/v1/fetch"]["post"]
    assert "application/octet-stream" in fetch["responses"]["200"]["content"]
    assert "404" in fetch["responses"]


@pytest.mark.django_db(transaction=True)
def test_concurrent_puts_never_pass_the_token_quota(
    celery_worker_process, alice, alice_auth, settings
) -> None:
    """Two texts PUT at once with room for one: one is stored, the other refused. The race is
    made certain as for uploads (tests/webapp/documents/test_quota_races.py): both had checked
    the quota before either wrote, and both wrote."""
    from tests.webapp.documents.test_quota_races import race
    from webapp.documents import quotas
    from webapp.kdn import services
    from webapp.kdn.models import StoredText

    _put(Client(), alice_auth, OTHER)  # the KV worker is up, its model loaded
    texts = [PASSAGE, PASSAGE.replace("Rhine", "Rhône")]
    one = max(len(services.tokenize([text], None)[0].token_ids) for text in texts)
    settings.QUOTA_TOKENS = quotas.usage_of(alice).tokens + one + one // 2
    results = race(
        "kdn_storedtext",
        [lambda text=text: services.kdn_put(owner=alice, text=text) for text in texts],
    )
    refused = [r for r in results if isinstance(r, services.KdnRefused)]
    assert len(refused) == 1 and refused[0].code == "quota_exceeded", results
    assert StoredText.objects.filter(owner=alice).count() == 2  # OTHER and one of the two
    assert quotas.usage_of(alice).tokens <= settings.QUOTA_TOKENS
