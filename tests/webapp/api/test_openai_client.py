"""The official ``openai`` package, pointed at the live test server, gets a non-streamed and
a streamed completion citing an uploaded document: first with a stand-in inference worker
(fast), then end to end with the real Celery and inference workers (slow)."""

from __future__ import annotations

import time

import openai
import pytest

from tests.conftest import wait_for
from tests.webapp.api.conftest import bearer
from tests.webapp.api.fake_worker import FakeInferenceWorker
from tests.webapp.chat.test_chat import PASSAGES, make_document
from webapp.redis import redis_client


def _client(live_server, user) -> openai.OpenAI:
    api_key = bearer(user)["HTTP_AUTHORIZATION"].removeprefix("Bearer ")
    return openai.OpenAI(
        base_url=f"{live_server.url}/v1", api_key=api_key, timeout=600, max_retries=0
    )


def _complete_both_ways(client: openai.OpenAI, question: str):
    messages = [{"role": "user", "content": question}]
    completion = client.chat.completions.create(model="ragblend", messages=messages)
    chunks = list(client.chat.completions.create(model="ragblend", messages=messages, stream=True))
    return completion, chunks


@pytest.mark.django_db(transaction=True)
def test_openai_package_with_a_stand_in_worker(live_server, alice) -> None:
    document = make_document(alice, "kitchen notes", list(PASSAGES.values()))
    client = _client(live_server, alice)
    assert [m.id for m in client.models.list()] == ["ragblend"]
    with FakeInferenceWorker(redis_client()):
        completion, chunks = _complete_both_ways(client, "Which rice goes into a risotto?")

    assert completion.choices[0].message.content == "Arborio rice [1]."
    assert completion.usage.completion_tokens == 3
    cited = completion.model_extra["citations"]
    assert cited[0]["document_id"] == document.id and cited[0]["text"] == PASSAGES["cooking"]

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Arborio rice [1]."
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].model_extra["citations"][0]["document_id"] == document.id

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{live_server.url}/v1", api_key="rbk_wrong", max_retries=0
        ).models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])


DOCUMENT = (
    "# The Zorvath lighthouse\n\n"
    "The Zorvath lighthouse stands on the island of Kelmora. It was built in 1887 by the "
    "engineer Ilse Varnhagen. Its lamp is painted bright green, so sailors call it the "
    "Green Eye of Kelmora.\n"
)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.django_db(transaction=True)
def test_openai_package_end_to_end_cites_an_uploaded_document(
    live_server, client, alice, celery_worker_process, inference_worker_process
) -> None:
    from django.core.files.uploadedfile import SimpleUploadedFile

    headers = bearer(alice)
    upload = SimpleUploadedFile("zorvath.md", DOCUMENT.encode())
    created = client.post("/api/v1/documents", {"file": upload}, **headers).json()

    def ready() -> bool:
        detail = client.get(f"/api/v1/documents/{created['id']}", **headers).json()
        assert detail["status"] != "failed", detail["error"]
        return detail["status"] == "ready"

    wait_for(ready, timeout=600, interval=1, what="the document to be ready")

    started = time.monotonic()
    completion, chunks = _complete_both_ways(
        _client(live_server, alice), "Who built the Zorvath lighthouse?"
    )
    assert time.monotonic() - started < 600
    assert completion.choices[0].message.content.strip()
    # The document was retrieved: cited when the answer uses it, else under also_retrieved.
    given = completion.model_extra["citations"] + completion.model_extra["also_retrieved"]
    assert given[0]["document_id"] == created["id"]
    assert completion.model_extra["ragblend"]["metrics"]["mode"] == "blend"

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    last = chunks[-1].model_extra
    assert (last["citations"] + last["also_retrieved"])[0]["document_id"] == created["id"]
