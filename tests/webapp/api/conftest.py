from __future__ import annotations

import pytest


@pytest.fixture
def mallory(django_user_model):
    return django_user_model.objects.create_user(username="mallory", password="pw-mallory-123")


def bearer(user, name: str = "test") -> dict[str, str]:
    from webapp.accounts.services import api_key_create

    _, plaintext = api_key_create(user=user, name=name)
    return {"HTTP_AUTHORIZATION": f"Bearer {plaintext}"}


@pytest.fixture
def alice_auth(alice) -> dict[str, str]:
    return bearer(alice)


@pytest.fixture
def mallory_auth(mallory) -> dict[str, str]:
    return bearer(mallory)
