"""The knowledge delivery API against a hostile caller (issue #48): a request token fetches
the passage it was signed for and nothing else, for a short while, under a rate limit, and is
signed only when the worker reads through the API; bodies that are too big, not Unicode or
blank are refused with 413 or 400, never a 500, and store nothing."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time

import pytest
from django.core import signing
from django.test import Client

from kvservice.kdn.client import KdnClient, KdnRead, KdnTier
from kvservice.protocol.keys import ChunkKey
from tests.conftest import ROOT
from tests.webapp.kdn.test_kdn_api import OTHER, PASSAGE, _put
from tests.webapp.test_bodylimit import _call, _scope
from webapp.asgi import application
from webapp.chat.models import Citation, Conversation, Message
from webapp.chat.requests import generate_request
from webapp.documents.models import Chunk, Document
from webapp.kdn.models import StoredText
from webapp.kdn.tokens import SALT, request_token, text_digest, token_claims

# --- helpers ---------------------------------------------------------------------------------


def _with_token(token: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def _fetch(client: Client, auth: dict, body) -> object:
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return client.post("/kdn/v1/fetch", data, content_type="application/json", **auth)


def _put_raw(client: Client, auth: dict, body) -> object:
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return client.put("/kdn/v1/kv", data, content_type="application/json", **auth)


def _token(user, *texts: str, timeout_s: float = 60) -> str:
    return request_token(user_id=user.pk, request_id="r-1", texts=texts, timeout_s=timeout_s)


def _widened(token: str, text: str) -> str:
    """The token with another text's digest added to its payload, its timestamp and
    signature kept (``signing.dumps``: payload:timestamp:signature)."""
    _, timestamp, signature = token.split(":")
    payload = signing.loads(token, salt=SALT)
    payload["t"] = sorted({*payload["t"], text_digest(text)})
    raw = json.dumps(payload, separators=(",", ":")).encode()
    return f"{base64.urlsafe_b64encode(raw).rstrip(b'=').decode()}:{timestamp}:{signature}"


# --- the token's scope -------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_token_fetches_its_passage_and_no_other_text_of_its_user(
    celery_worker_process, alice, alice_auth
) -> None:
    client = Client()
    for text in (PASSAGE, OTHER):
        _put(client, alice_auth, text)
    assert _fetch(client, alice_auth, {"texts": [OTHER]}).status_code == 200  # hers, by key
    token = _with_token(_token(alice, PASSAGE))

    response = _fetch(client, token, {"texts": [PASSAGE]})
    assert response.status_code == 200, response.content
    assert int(response["X-KV-Tokens"]) > 0 and len(b"".join(response)) > 0

    # Her other text, alone or after the passage: refused, by the token alone.
    for texts, index in (([OTHER], 0), ([PASSAGE, OTHER], 1)):
        response = _fetch(client, token, {"texts": texts})
        assert response.status_code == 403, response.content
        assert response.json()["code"] == "out_of_scope"
        assert f"texts[{index}] is not a text this request token" in response.json()["message"]
    # A text nobody stored gets the very same answer: the 403 says nothing of what exists.
    unknown = _fetch(client, token, {"texts": ["Nobody stored this sentence."]})
    assert (
        unknown.status_code == 403
        and unknown.json() == _fetch(client, token, {"texts": [OTHER]}).json()
    )
    # Another head (other KV of the same text) is out of scope too.
    response = _fetch(client, token, {"texts": [PASSAGE], "head": "Another head.\n"})
    assert response.status_code == 403 and "send no head" in response.json()["message"]


@pytest.mark.django_db
def test_a_token_cannot_be_widened(alice) -> None:
    token = _token(alice, PASSAGE)
    assert token_claims(token).text_digests == {text_digest(PASSAGE)}
    widened = _widened(token, OTHER)
    assert widened != token and token_claims(widened) is None
    response = _fetch(Client(), _with_token(widened), {"texts": [OTHER]})
    assert response.status_code == 401
    # Signed by us with no text at all, it fetches nothing either.
    assert token_claims(_token(alice)) is None


@pytest.mark.django_db
def test_a_token_is_refused_once_its_short_lifetime_is_over(alice, settings) -> None:
    settings.KDN_TOKEN_TTL_S = 1.0
    token = _token(alice, PASSAGE, timeout_s=300)  # the request's timeout: the TTL is shorter
    assert token_claims(token).expires_at - time.time() <= 1.0
    client = Client()
    response = _fetch(client, _with_token(token), {"texts": [PASSAGE]})
    assert response.status_code == 404  # accepted: its passage is just not stored
    time.sleep(1.2)
    response = _fetch(client, _with_token(token), {"texts": [PASSAGE]})
    assert response.status_code == 401
    assert response.json()["code"] == "unauthorized"


# --- the rate limit --------------------------------------------------------------------------


@pytest.mark.django_db
def test_token_fetches_get_a_429_with_retry_after_past_the_limit(
    alice, alice_auth, settings
) -> None:
    settings.API_RATE_LIMIT_REQUESTS = 3
    settings.API_RATE_LIMIT_WINDOW_S = 60
    client, token = Client(), _with_token(_token(alice, PASSAGE))
    statuses = [_fetch(client, token, {"texts": [PASSAGE]}).status_code for _ in range(3)]
    assert statuses == [404, 404, 404]  # under the limit: found nothing, not refused
    response = _fetch(client, token, {"texts": [PASSAGE]})
    assert response.status_code == 429, response.content
    assert response.json()["code"] == "rate_limited"
    assert 1 <= int(response["Retry-After"]) <= 60
    # Another token of the same user shares the user's limit: minting more does not help.
    other = _with_token(_token(alice, PASSAGE))
    assert _fetch(client, other, {"texts": [PASSAGE]}).status_code == 429
    # The worker's fetches have a bucket of their own: her API key is not spent by them.
    assert _fetch(client, alice_auth, {"texts": [PASSAGE]}).status_code == 404


@pytest.mark.django_db(transaction=True)
def test_the_workers_tier_takes_a_429_as_a_miss_without_waiting(
    live_server, alice, settings
) -> None:
    settings.API_RATE_LIMIT_REQUESTS = 1
    settings.API_RATE_LIMIT_WINDOW_S = 60
    token = _token(alice, PASSAGE)
    tier = KdnTier(KdnClient(live_server.url))
    key = ChunkKey.for_tokens("fp", "h", [5, 6])
    tier.expect({key: KdnRead(PASSAGE, token, time.monotonic() + 60)})
    assert tier.read_range(key, 0, 64) is None  # the one fetch allowed: not stored (404)
    started = time.monotonic()
    assert tier.read_range(key, 0, 64) is None  # 429: recomputed, not waited for
    assert time.monotonic() - started < 10  # a key's client would sleep Retry-After (~60 s)
    assert tier.stats().misses == 2 and tier.stats().errors == 0
    tier.close()


# --- minted only for KV_SOURCE=kdn ---------------------------------------------------------


def _question_citing(alice, *texts: str) -> Message:
    document = Document.objects.create(owner=alice, title="t", content_sha256="0" * 64)
    answer = Message.objects.create(
        conversation=Conversation.objects.create(owner=alice), role=Message.Role.ASSISTANT
    )
    for index, text in enumerate(texts):
        chunk = Chunk.objects.create(
            document=document,
            index=index,
            text=text,
            token_ids=[index + 1],
            token_count=1,
            token_ids_sha256=f"{index}" * 64,
        )
        Citation.objects.create(
            message=answer,
            rank=index + 1,
            chunk=chunk,
            document=document,
            document_title="t",
            text=text,
        )
    return answer


def _request_for(answer: Message):
    citations = answer.citations.order_by("rank")
    return generate_request(
        question="q", history=[], citations=citations, mode="blend", answer=answer
    )


@pytest.mark.django_db
def test_no_token_is_signed_when_the_worker_reads_s3(alice, settings) -> None:
    answer = _question_citing(alice, "First passage.", "Second passage.")
    settings.KV_SOURCE = "s3"
    refs = _request_for(answer).chunks
    assert [r.text for r in refs] == ["First passage.", "Second passage."]
    assert [r.kdn_token for r in refs] == ["", ""]
    sent = _request_for(answer).to_dict()["chunks"]  # what the task message carries
    assert [chunk.get("kdn_token", "") for chunk in sent] == ["", ""]

    settings.KV_SOURCE = "kdn"  # each passage its own token, naming that passage only
    refs = _request_for(answer).chunks
    digests = [token_claims(r.kdn_token).text_digests for r in refs]
    assert digests == [{text_digest("First passage.")}, {text_digest("Second passage.")}]


def test_an_unknown_kv_source_stops_the_web_app_at_start() -> None:
    env = {**os.environ, "KV_SOURCE": "gcs"}
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "KV_SOURCE must be 's3' or 'kdn', not 'gcs'" in result.stderr


# --- bodies ----------------------------------------------------------------------------------


def test_a_10_mb_body_is_a_413_before_it_is_read() -> None:
    declared = str(10 * 1024 * 1024).encode()
    scope = _scope(
        "/kdn/v1/fetch", [(b"content-length", declared), (b"content-type", b"application/json")]
    )
    status, body, read = asyncio.run(_call(application, scope, [b"x" * 1024]))
    assert status == 413 and read == 0
    assert json.loads(body)["code"] == "too_large"
    assert "fewer or shorter texts" in json.loads(body)["message"]


@pytest.mark.django_db
def test_64_texts_of_64k_characters_sent_without_a_length_are_a_413() -> None:
    body = json.dumps({"texts": ["a" * 64_000] * 64}).encode()  # about 4 MB
    pieces = [body[i : i + 256 * 1024] for i in range(0, len(body), 256 * 1024)]
    scope = _scope("/kdn/v1/fetch", [(b"content-type", b"application/json")])
    status, answer, read = asyncio.run(_call(application, scope, pieces))
    assert status == 413 and json.loads(answer)["code"] == "too_large"
    assert read < len(pieces)  # cut off once past KDN_MAX_BODY_BYTES, the rest never read


@pytest.mark.django_db
def test_bodies_past_what_django_reads_are_a_413_not_a_500(alice_auth) -> None:
    client = Client()  # no ASGI wrapper here: Django's own limit, then the API's answer
    for texts in (["x" * 1000] * 10_000, ["a" * 64_000] * 64):
        response = _fetch(client, alice_auth, {"texts": texts})
        assert response.status_code == 413, response.content[:200]
        assert response.json()["code"] == "too_large"


@pytest.mark.django_db
def test_a_lone_surrogate_or_bad_utf8_is_a_400(alice_auth) -> None:
    client = Client()
    response = _fetch(client, alice_auth, '{"texts": ["A fine text.", "bad \\ud800 text"]}')
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "bad_request"
    assert "texts.1" in response.json()["message"] and "surrogate" in response.json()["message"]
    head = _fetch(client, alice_auth, '{"texts": ["A fine text."], "head": "\\udfff"}')
    assert head.status_code == 400 and "head" in head.json()["message"]
    assert _fetch(client, alice_auth, b'{"texts": ["\xff\xfe"]}').status_code == 400
    assert _put_raw(client, alice_auth, '{"text": "\\ud800"}').status_code == 400


@pytest.mark.django_db
def test_a_whitespace_only_put_is_a_400_and_stores_nothing(alice, alice_auth, settings) -> None:
    settings.KDN_PUT_WAIT_S = 1  # were it sent to a KV worker, the test would not wait long
    client = Client()
    for blank in (" ", "\n\t  \n", "\u3000\u00a0"):
        response = _put_raw(client, alice_auth, {"text": blank})
        assert response.status_code == 400, (blank, response.content)
        assert response.json()["code"] == "bad_request"
        assert "only whitespace" in response.json()["message"]
    assert not StoredText.objects.filter(owner=alice).exists()
    usage = client.get("/api/v1/documents/usage", **alice_auth).json()
    assert usage["kdn_tokens"] == 0
    assert _fetch(client, alice_auth, {"texts": ["  "]}).status_code == 400
