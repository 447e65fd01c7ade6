"""The first page tells an admin when the bundled demo model answers, and how to set another."""

from __future__ import annotations

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db


def _first_page(client, user) -> str:
    client.force_login(user)
    response = client.get(reverse("chat:index"))
    assert response.status_code == 200
    return response.content.decode()


def test_staff_are_told_the_bundled_model_is_a_demo(client, staff, settings):
    settings.MODEL_PATH = ""
    page = _first_page(client, staff)
    assert 'id="demo-model"' in page
    assert "SmolLM2-135M" in page and "MODEL_PATH=" in page


def test_no_demo_notice_once_a_model_is_set(client, staff, settings):
    settings.MODEL_PATH = "/models/Qwen3-4B"
    assert 'id="demo-model"' not in _first_page(client, staff)


def test_users_are_not_shown_the_operators_notice(client, alice, settings):
    settings.MODEL_PATH = ""
    assert 'id="demo-model"' not in _first_page(client, alice)
