"""Users the web app's tests share: alice, a staff member, mallory (never let in) and bob
(whom alice shares with)."""

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


@pytest.fixture
def mallory(django_user_model):
    """Someone who must never see alice's things."""
    return django_user_model.objects.create_user(username="mallory", password="pw-mallory-123")


@pytest.fixture
def bob(django_user_model):
    """Someone alice shares with."""
    return django_user_model.objects.create_user(username="bob", password="pw-bob-123")
