"""The first page tells everyone when the bundled demo model answers (its answers are weak),
and how another is set: an admin the command, a user that the operator can."""

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


def test_users_are_told_too_and_that_the_operator_sets_another(client, alice, settings):
    settings.MODEL_PATH = ""
    page = _first_page(client, alice)
    notice = page.split('id="demo-model"')[1].split("</div>")[0]
    assert "This is the demo model." in notice and "answers are often wrong" in notice
    assert "operator can switch to a stronger model" in notice and "MODEL_PATH" in notice
    assert "make dev" not in notice  # the command is the operator's, not the user's


def test_no_demo_notice_for_users_once_a_model_is_set(client, alice, settings):
    settings.MODEL_PATH = "/models/Qwen3-4B"
    assert 'id="demo-model"' not in _first_page(client, alice)
