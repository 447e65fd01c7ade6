"""Opening the chat warms the passages of the user's latest answers on the worker that will
serve them (the real broker carries the task; no inference worker runs here)."""

from __future__ import annotations

import base64
import json

import pytest
import redis
from django.conf import settings

from kvservice.protocol import INFERENCE_QUEUE, WARM_TASK
from tests.webapp.dashboard.factories import make_answers, make_document
from webapp.chat import services

pytestmark = pytest.mark.django_db


@pytest.fixture
def broker():
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(INFERENCE_QUEUE)
    yield client
    client.delete(INFERENCE_QUEUE)
    for key in client.scan_iter("ragblend:warm-recent:*"):
        client.delete(key)


def _warm_tasks(client) -> list[list]:
    """The args of every warm task waiting on the shared queue (no worker is up: the home
    queue is the shared one)."""
    found = []
    for raw in client.lrange(INFERENCE_QUEUE, 0, -1):
        message = json.loads(raw)
        if message["headers"]["task"] == WARM_TASK:
            args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
            found.append(args)
    return found


def test_opening_the_chat_warms_the_users_cited_passages_once_per_window(
    broker, client, django_user_model
) -> None:
    alice = django_user_model.objects.create_user(username="alice", password="alice-pass")
    mallory = django_user_model.objects.create_user(username="mallory", password="mallory-pass")
    document = make_document(alice, chunks=3)  # its answers cite chunks 0 and 1, not 2
    make_answers(alice, document)
    make_answers(mallory, make_document(mallory, "Mallory's notes"))
    cited = sorted(document.chunks.filter(index__lt=2).values_list("kv_key", flat=True))

    client.force_login(alice)
    assert client.get("/chat/").status_code == 200
    assert _warm_tasks(broker) == [[cited, "cpu"]]  # hers only, cited only, into the CPU tier
    conversation = alice.conversations.first()
    assert client.get(f"/chat/{conversation.id}/").status_code == 200
    assert len(_warm_tasks(broker)) == 1  # once per window

    client.force_login(mallory)
    client.get("/chat/")
    tasks = _warm_tasks(broker)  # newest first
    assert len(tasks) == 2 and tasks[1] == [cited, "cpu"] and not set(tasks[0][0]) & set(cited)


def test_nothing_is_sent_without_cached_passages(broker, django_user_model) -> None:
    newcomer = django_user_model.objects.create_user(username="newcomer", password="new-pass1")
    make_answers(newcomer)  # answers without citations
    assert services.chat_warm_recent(user=newcomer) == []
    assert _warm_tasks(broker) == []
