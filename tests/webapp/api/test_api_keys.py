"""API keys: stored hashed, shown once, revocable from the page and the command line."""

from __future__ import annotations

import hashlib
import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from webapp.accounts.models import ApiKey
from webapp.accounts.services import api_key_authenticate, api_key_create, api_key_revoke

pytestmark = pytest.mark.django_db


def test_key_is_stored_only_as_its_hash(alice) -> None:
    api_key, plaintext = api_key_create(user=alice, name="script")
    row = ApiKey.objects.get(pk=api_key.pk)
    assert row.key_sha256 == hashlib.sha256(plaintext.encode()).hexdigest()
    assert plaintext not in {row.key_sha256, row.prefix, row.name}
    assert plaintext.startswith(row.prefix)
    assert api_key_authenticate(plaintext=plaintext).user == alice
    assert api_key_authenticate(plaintext=plaintext + "x") is None


def test_revoked_key_no_longer_authenticates(alice) -> None:
    api_key, plaintext = api_key_create(user=alice, name="script")
    api_key_revoke(api_key=api_key)
    assert api_key_authenticate(plaintext=plaintext) is None


def test_create_api_key_command_prints_the_key_once(alice) -> None:
    out = io.StringIO()
    call_command("create_api_key", "alice", "--name", "cron", stdout=out, stderr=io.StringIO())
    plaintext = out.getvalue().strip()
    assert api_key_authenticate(plaintext=plaintext).name == "cron"
    with pytest.raises(CommandError, match="No user"):
        call_command("create_api_key", "nobody", stdout=io.StringIO())


def test_keys_page_creates_shows_once_and_revokes(client, alice, mallory) -> None:
    client.force_login(alice)
    response = client.post("/accounts/api-keys/", {"name": "laptop"})
    api_key = ApiKey.objects.get(user=alice)
    plaintext = response.context["plaintext"]
    assert plaintext.encode() in response.content
    assert plaintext.encode() not in client.get("/accounts/api-keys/").content  # shown once
    assert client.post("/accounts/api-keys/", {"name": "  "}).status_code == 422

    client.force_login(mallory)  # another user cannot revoke it
    assert client.post(f"/accounts/api-keys/{api_key.pk}/revoke").status_code == 404
    client.force_login(alice)
    assert client.post(f"/accounts/api-keys/{api_key.pk}/revoke").status_code == 302
    assert api_key_authenticate(plaintext=plaintext) is None
