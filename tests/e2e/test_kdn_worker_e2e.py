"""An inference worker with ``KV_SOURCE=kdn`` and no S3 credentials answers a question from
the KV the ingest worker stored, read through the web server's knowledge delivery API with
the token the question carries (the real Celery worker, a live server, the real inference
worker and the bundled model)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import pytest
from django.test import TestCase, override_settings

from tests.conftest import _spawn_worker, _stop, wait_for
from tests.e2e.test_chat_e2e import collect_stream, upload_ready, wait_recorded
from webapp.chat import services as chat
from webapp.redis import redis_client

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

KDN_QUEUE = "inference-kdn"
KDN_HEARTBEAT_KEY = "ragblend:inference:heartbeat:kdn"
TEXT = (
    "The Varnholt observatory sits above the village of Ostrel. Its great telescope was "
    "ground by the optician Mira Dalen in 1902, and on clear nights it shows the rings of "
    "Saturn to visitors who climb the four hundred steps from the harbour."
)


def _heartbeat() -> dict:
    return json.loads(redis_client().get(KDN_HEARTBEAT_KEY) or "{}")


@pytest.fixture
def kdn_inference_worker(redis_service, live_server, tmp_path) -> Iterator[None]:
    """``python -m kvservice.worker`` reading KV through ``live_server``'s /kdn/v1: no S3
    variable in its environment, no disk tier (what it serves came through the API)."""
    # No S3 variable, and no Django settings (the worker is not a Django process: Celery
    # would set Django up for it, and the settings want S3).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("S3_") and k != "DJANGO_SETTINGS_MODULE"
    }
    env |= {
        "KV_SOURCE": "kdn",
        "KDN_URL": live_server.url,
        "KV_DISK_CAPACITY_BYTES": "0",
        "INFERENCE_QUEUE": KDN_QUEUE,
        "HEARTBEAT_KEY": KDN_HEARTBEAT_KEY,
        "INFERENCE_CONCURRENCY": "2",
        "INFERENCE_NODE_NAME": "inference-kdn@%h",
        "PYTHONUNBUFFERED": "1",
    }
    log_path = tmp_path / "inference-kdn.log"
    process = _spawn_worker([sys.executable, "-m", "kvservice.worker"], log_path, env)
    try:
        wait_for(
            lambda: process.poll() is not None or _heartbeat().get("model_loaded"),
            timeout=300,
            interval=1,
            what="the KV_SOURCE=kdn worker",
        )
        if process.poll() is not None:
            raise RuntimeError(f"the worker died:\n{log_path.read_text()[-3000:]}")
        yield
    finally:
        _stop(process, log_path)
        redis_client().delete(KDN_HEARTBEAT_KEY)
    assert "S3 unreachable" not in log_path.read_text()


# The web side signs a question's KV tokens only where it is told the workers read the KDN.
@override_settings(INFERENCE_QUEUE=KDN_QUEUE, CHAT_MAX_NEW_TOKENS=24, KV_SOURCE="kdn")
def test_a_kdn_worker_answers_from_kv_fetched_through_the_api(
    celery_worker_process, kdn_inference_worker, django_user_model
) -> None:
    user = django_user_model.objects.create_user(username="astronomer", password="pw-astro-1")
    upload_ready(user, TEXT, "varnholt.txt")
    conversation = chat.conversation_create(owner=user)
    with TestCase.captureOnCommitCallbacks(execute=True):
        answer = chat.chat_ask(
            user=user, conversation=conversation, question="Who ground the Varnholt telescope?"
        )
    tokens, kind, payload = collect_stream(str(answer.request_id))
    assert kind == "done", payload
    assert payload["text"].strip()
    tiers = payload["metrics"]["chunk_tiers"]
    assert set(tiers) == {str(c.chunk_id) for c in answer.citations.all()}
    assert set(tiers.values()) == {"kdn"}, tiers  # read through the API, none recomputed
    wait_recorded(answer)

    def kept() -> dict | None:  # what it read is in its own memory tier, as from S3
        store = _heartbeat().get("store") or {}
        tiers = {t["name"]: t for t in store.get("tiers", [])}
        return tiers if tiers.get("cpu", {}).get("entries") else None

    tiers = wait_for(kept, timeout=30, what="the worker's heartbeat to show its CPU tier")
    assert list(tiers) == ["cpu", "kdn"]
    assert tiers["kdn"]["hits"] >= 1 and tiers["kdn"]["bytes_read"] > 0
    assert tiers["cpu"]["entries"] >= len(payload["metrics"]["chunk_tiers"])
