"""The controller setting on the dashboard reaches the inference request chat sends."""

from __future__ import annotations

import base64
import json

import pytest
from django.urls import reverse

from kvservice.protocol import GENERATE_TASK, INFERENCE_QUEUE, GenerateRequest
from tests.webapp.chat.test_chat import PASSAGES, make_document
from webapp.chat import services as chat
from webapp.redis import redis_client

pytestmark = pytest.mark.django_db


def _ask_and_take_request(user, capture) -> GenerateRequest:
    """Ask a question and return the request left in the Redis ``inference`` list (removed:
    no inference worker runs in this test)."""
    client = redis_client()
    client.delete(INFERENCE_QUEUE)
    if not user.documents.exists():  # with nothing retrieved, no request is sent
        make_document(user, "notes", list(PASSAGES.values()))
    conversation = chat.conversation_create(owner=user)
    with capture(execute=True):
        chat.chat_ask(user=user, conversation=conversation, question="Where is the Danube?")
    raw = client.lrange(INFERENCE_QUEUE, 0, -1)
    client.delete(INFERENCE_QUEUE)
    assert len(raw) == 1
    envelope = json.loads(raw[0])
    assert envelope["headers"]["task"] == GENERATE_TASK
    args = json.loads(base64.b64decode(envelope["body"]))[0]
    return GenerateRequest.from_dict(args[0])


def test_fixed_ratio_set_on_the_dashboard_goes_into_the_next_request(
    staff_client, staff, django_capture_on_commit_callbacks
) -> None:
    capture = django_capture_on_commit_callbacks
    assert _ask_and_take_request(staff, capture).recompute_ratio is None  # auto by default

    staff_client.post(reverse("dashboard:controller"), {"mode": "fixed", "fixed_ratio": "0.35"})
    assert _ask_and_take_request(staff, capture).recompute_ratio == pytest.approx(0.35)

    staff_client.post(reverse("dashboard:controller"), {"mode": "auto"})
    assert _ask_and_take_request(staff, capture).recompute_ratio is None
