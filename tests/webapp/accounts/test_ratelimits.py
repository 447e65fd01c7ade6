"""Logging in and signing up are limited per client address (#18): past LOGIN_RATE_LIMIT or
SIGNUP_RATE_LIMIT POSTs from one address, a styled 429 with Retry-After; up to it pass, and
another address is not affected. Counted in the real valkey; each test uses addresses of its
own (documentation ranges, never contacted), and limits per day, so no period ends mid-test."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from webapp.accounts import services
from webapp.accounts.models import Invite

pytestmark = pytest.mark.django_db

User = get_user_model()
PASSWORD = "Quiet-river-2041"


def _log_in(client: Client, address: str, username: str, password: str):
    return client.post(
        reverse("login"), {"username": username, "password": password}, REMOTE_ADDR=address
    )


def _assert_too_many(response) -> None:
    assert response.status_code == 429
    assert int(response["Retry-After"]) > 0
    html = response.content.decode()
    assert 'id="error-429"' in html and 'class="topbar"' in html  # the styled page


def test_as_many_login_attempts_as_the_limit_pass(client, alice, settings) -> None:
    settings.LOGIN_RATE_LIMIT = "3/d"
    for username in ("ann", "ben"):  # wrong passwords, each username once (no axes lockout)
        assert _log_in(client, "203.0.113.10", username, "guess").status_code == 200
    assert _log_in(client, "203.0.113.10", "alice", "pw-alice-123").status_code == 302


def test_login_attempts_past_the_limit_are_429_from_that_address_only(
    client, alice, settings
) -> None:
    settings.LOGIN_RATE_LIMIT = "3/d"
    for username in ("ann", "ben", "cal"):
        assert _log_in(client, "203.0.113.20", username, "guess").status_code == 200
    refused = _log_in(client, "203.0.113.20", "alice", "pw-alice-123")  # right, but too many
    _assert_too_many(refused)
    assert "login attempts" in refused.content.decode()
    assert client.get(reverse("api_keys")).status_code == 302  # not signed in
    assert client.get(reverse("login"), REMOTE_ADDR="203.0.113.20").status_code == 200
    assert _log_in(Client(), "203.0.113.21", "alice", "pw-alice-123").status_code == 302


def test_the_admin_login_counts_against_the_same_limit(client, staff, settings) -> None:
    settings.LOGIN_RATE_LIMIT = "1/d"
    assert _log_in(client, "203.0.113.30", "nobody", "guess").status_code == 200
    response = client.post(
        reverse("admin:login"),
        {"username": "stella", "password": "pw-stella-123"},
        REMOTE_ADDR="203.0.113.30",
    )
    _assert_too_many(response)


def test_signups_past_the_limit_are_429_and_make_nobody(client, settings) -> None:
    settings.SIGNUP_ENABLED = True
    settings.SIGNUP_RATE_LIMIT = "2/d"

    def sign_up(username: str, password2: str = PASSWORD):
        return client.post(
            reverse("signup"),
            {"username": username, "password1": PASSWORD, "password2": password2},
            REMOTE_ADDR="198.51.100.40",
        )

    assert sign_up("ivy", password2="mismatch").status_code == 422  # counted all the same
    assert sign_up("jay").status_code == 302
    refused = sign_up("kim")
    _assert_too_many(refused)
    assert "sign-up attempts" in refused.content.decode()
    assert not User.objects.filter(username="kim").exists()


def test_accepting_an_invite_counts_as_a_signup(client, staff, settings) -> None:
    settings.SIGNUP_RATE_LIMIT = "1/d"
    _, token = services.invite_create(created_by=staff)
    url = reverse("invite_accept", args=[token])

    def accept(password2: str):
        fields = {"username": "nina", "password1": PASSWORD, "password2": password2}
        return client.post(url, fields, REMOTE_ADDR="198.51.100.50")

    assert accept("mismatch").status_code == 422
    _assert_too_many(accept(PASSWORD))
    assert Invite.objects.get().used_at is None
    assert not User.objects.filter(username="nina").exists()


def test_behind_a_trusted_proxy_each_client_counts_on_its_own(alice, settings) -> None:
    """Behind the ingress every request comes from its address: the client is the last
    X-Forwarded-For entry, so one client past the limit does not lock the others out, and an
    entry the client wrote itself (further left) does not get it a fresh budget."""
    settings.LOGIN_RATE_LIMIT = "2/d"

    def log_in(remote: str, forwarded: str, password: str = "guess"):
        return Client().post(
            reverse("login"),
            {"username": "alice", "password": password},
            REMOTE_ADDR=remote,
            HTTP_X_FORWARDED_FOR=forwarded,
        )

    settings.TRUSTED_PROXY_COUNT = 1
    proxy = "10.0.0.5"
    for forged in ("198.51.100.1", "198.51.100.2"):  # a different lie each time, same client
        assert log_in(proxy, f"{forged}, 203.0.113.30").status_code == 200
    _assert_too_many(log_in(proxy, "198.51.100.3, 203.0.113.30"))
    assert log_in(proxy, "203.0.113.31", "pw-alice-123").status_code == 302  # another client

    settings.TRUSTED_PROXY_COUNT = 0  # no proxy trusted: the header is the client's own words
    for forged in ("203.0.113.32", "203.0.113.33"):
        assert log_in("203.0.113.34", forged).status_code == 200
    _assert_too_many(log_in("203.0.113.34", "203.0.113.35"))
