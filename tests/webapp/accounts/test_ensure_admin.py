"""`manage.py ensure_admin`: the first admin account, from ADMIN_USERNAME / ADMIN_PASSWORD /
ADMIN_EMAIL as the configuration registry reads them, and only once."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

pytestmark = pytest.mark.django_db


def _ensure_admin() -> str:
    out = StringIO()
    call_command("ensure_admin", stdout=out)
    return out.getvalue()


def test_the_admin_comes_from_the_environment_and_is_made_once(monkeypatch) -> None:
    monkeypatch.setenv("ADMIN_USERNAME", " boss ")
    monkeypatch.setenv("ADMIN_PASSWORD", "pw-boss-1234567")
    monkeypatch.setenv("ADMIN_EMAIL", "boss@example.com")
    said = _ensure_admin()
    assert "Created admin account: boss / (from ADMIN_PASSWORD)" in said
    boss = get_user_model().objects.get(username="boss")
    assert boss.is_superuser and boss.email == "boss@example.com"
    assert boss.check_password("pw-boss-1234567")
    assert "exists already" in _ensure_admin()


def test_without_a_password_one_is_made_and_shown_once(monkeypatch) -> None:
    for name in ("ADMIN_USERNAME", "ADMIN_PASSWORD", "ADMIN_EMAIL"):
        monkeypatch.delenv(name, raising=False)
    said = _ensure_admin()
    shown = said.split("admin / ")[1].split()[0]
    assert get_user_model().objects.get(username="admin").check_password(shown)
