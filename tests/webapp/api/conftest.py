from __future__ import annotations

import pytest


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
