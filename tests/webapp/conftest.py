"""Users the web app's tests share: a plain user and a staff member."""

from __future__ import annotations

import pytest


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user(username="alice", password="pw-alice-123")


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user(
        username="stella", password="pw-stella-123", is_staff=True
    )
