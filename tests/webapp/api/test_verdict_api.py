"""The APIs say what the chat page says: an answer no passage supports is "not found" with
its words apart (``withheld``), never the words as the answer; the time to first token as a
user waits for it beside the worker's; ratios to 3 decimals."""

from __future__ import annotations

import json

import pytest

from kvservice.serve.citing import UNSUPPORTED
from tests.webapp.api.conftest import bearer
from tests.webapp.api.fake_worker import FakeInferenceWorker
from tests.webapp.chat.test_chat import PASSAGES, make_document
from webapp.redis import redis_client

pytestmark = pytest.mark.django_db(transaction=True)

QUESTION = "Which rice goes into a risotto?"
UNSUPPORTED_WORDS = ("The", " answer", " is:", " 4")
LONG_RATIO = 0.20041213932375773


@pytest.fixture
def unsupported_worker():
    """The real verdict on words no passage holds, recorded as the worker's report is."""
    with FakeInferenceWorker(
        redis_client(),
        words=UNSUPPORTED_WORDS,
        judged=True,
        record=True,
        metrics={"recompute_ratio": LONG_RATIO},
    ) as worker:
        yield worker


def test_query_gives_not_found_with_the_words_withheld_and_ratios_rounded(
    client, alice, alice_auth, unsupported_worker
) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    response = client.post(
        "/api/v1/query", {"question": QUESTION}, content_type="application/json", **alice_auth
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["answer"] == UNSUPPORTED and body["withheld"] == "The answer is: 4"
    assert body["citations"] == [] and body["metrics"]["citation"] == "unsupported"
    metrics = body["metrics"]
    assert metrics["recompute_ratio"] == 0.2
    assert metrics["ttft_seen_s"] is not None and metrics["ttft_seen_s"] >= metrics["ttft_s"]

    detail = client.get(f"/api/v1/conversations/{body['conversation_id']}", **alice_auth).json()
    recorded = detail["messages"][-1]
    assert recorded["content"] == UNSUPPORTED and recorded["withheld"] == "The answer is: 4"
    assert recorded["metrics"]["recompute_ratio"] == 0.2
    assert recorded["metrics"]["ttft_seen_s"] >= recorded["metrics"]["ttft_s"]


def test_openai_content_is_not_found_and_a_stream_marks_the_words_withdrawn(
    client, alice, alice_auth, unsupported_worker
) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    payload = {"model": "ragblend", "messages": [{"role": "user", "content": QUESTION}]}
    response = client.post(
        "/v1/chat/completions", payload, content_type="application/json", **alice_auth
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["choices"][0]["message"]["content"] == UNSUPPORTED
    assert body["ragblend"]["withheld"] == "The answer is: 4"
    assert body["ragblend"]["metrics"]["recompute_ratio"] == 0.2

    streamed = client.post(
        "/v1/chat/completions",
        payload | {"stream": True},
        content_type="application/json",
        **alice_auth,
    )
    chunks = [
        json.loads(block.removeprefix("data: "))
        for block in b"".join(streamed).decode().strip().split("\n\n")
        if block != "data: [DONE]"
    ]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text.startswith("The answer is: 4") and "(Withdrawn:" in text
    assert chunks[-1]["ragblend"]["withheld"] == "The answer is: 4"


def test_cache_stats_round_the_mean_ratio(client, alice, alice_auth, unsupported_worker) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    client.post(
        "/api/v1/query", {"question": QUESTION}, content_type="application/json", **alice_auth
    )
    alice.is_staff = True
    alice.save()
    stats = client.get("/api/v1/cache/stats", **bearer(alice, "staff")).json()
    blend = next(row for row in stats["modes"] if row["mode"] == "blend")
    assert blend["mean_recompute_ratio"] == 0.2
