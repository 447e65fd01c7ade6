"""Wrong passwords for one account, from any addresses, lock its password logins for a while
(ratelimits.py, beside the per-address limits): the same 429 whether the password was right
and whether the account exists; the lock ends by itself, staff lift it on the Users page, and
changing the password lifts it; sessions already logged in are not touched. Counted in the
real valkey, which the whole test session shares: each test locks usernames of its own (never
the shared fixtures' users), from addresses of its own (documentation ranges, never
contacted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from deploy.services import free_port
from tests.conftest import ROOT
from tests.webapp.test_settings import STRONG_KEY, _manage

pytestmark = pytest.mark.django_db

User = get_user_model()
PASSWORD = "Quiet-river-2041"


@pytest.fixture(autouse=True)
def _the_products_failure_limit(settings) -> None:
    """The product's default (the suite sets a limit no test reaches, tests/conftest.py)."""
    settings.LOGIN_ACCOUNT_FAILURE_LIMIT = 10


def _log_in(username: str, password: str, address: str, client: Client | None = None):
    return (client or Client()).post(
        reverse("login"), {"username": username, "password": password}, REMOTE_ADDR=address
    )


def _guess(username: str, times: int, network: str = "198.51.100") -> list[int]:
    """``times`` wrong passwords for ``username``, each from an address of its own; their
    status codes."""
    return [_log_in(username, f"guess-{n}", f"{network}.{n + 1}").status_code for n in range(times)]


def _assert_account_locked(response) -> int:
    """The account's lock page: a 429 with Retry-After; returns the seconds it says."""
    assert response.status_code == 429
    retry_after = int(response["Retry-After"])
    assert retry_after > 0
    html = response.content.decode()
    assert 'id="account-locked"' in html and 'class="topbar"' in html  # the styled page
    assert "Password logins for this account are paused" in html
    return retry_after


def _without_csrf_tokens(html: str) -> str:
    html = re.sub(r'"X-CSRFToken": "[^"]*"', "", html)
    return re.sub(r'name="csrfmiddlewaretoken" value="[^"]*"', "", html)


def test_wrong_passwords_from_many_addresses_lock_the_account(settings) -> None:
    """Twelve wrong passwords, each from another address (none reaches the per-address
    limits), then the right one from a thirteenth: refused, for the lockout period."""
    User.objects.create_user(username="quinn", password=PASSWORD)
    limit = 10
    statuses = _guess("quinn", 12, network="198.51.100")
    assert statuses == [200] * (limit - 1) + [429] * (12 - limit + 1)
    client = Client()
    refused = _log_in("quinn", PASSWORD, "198.51.100.200", client)
    retry_after = _assert_account_locked(refused)
    assert retry_after <= settings.LOGIN_ACCOUNT_LOCKOUT.total_seconds() == 15 * 60
    assert client.get(reverse("api_keys")).status_code == 302  # not logged in
    User.objects.create_user(username="rhea", password=PASSWORD)
    assert _log_in("rhea", PASSWORD, "198.51.100.200").status_code == 302  # others log in


def test_the_lock_ends_by_itself(settings) -> None:
    settings.LOGIN_ACCOUNT_FAILURE_LIMIT = 2
    settings.LOGIN_ACCOUNT_LOCKOUT = timedelta(seconds=6)
    User.objects.create_user(username="sven", password=PASSWORD)
    assert _guess("sven", 2, network="198.51.100") == [200, 429]
    retry_after = _assert_account_locked(_log_in("sven", PASSWORD, "198.51.100.201"))
    assert retry_after <= 6
    time.sleep(retry_after + 0.5)
    assert _log_in("sven", PASSWORD, "198.51.100.201").status_code == 302


def test_staff_see_the_lock_and_lift_it_on_the_users_page(client, staff) -> None:
    tara = User.objects.create_user(username="tara", password=PASSWORD)
    _guess("tara", 10, network="203.0.113")
    _assert_account_locked(_log_in("tara", PASSWORD, "203.0.113.200"))
    client.force_login(staff)
    page = client.get(reverse("users")).content.decode()
    row = re.search(rf'<tr id="user-{tara.pk}".*?</tr>', page, re.S).group(0)
    assert "locked until" in row and reverse("user_unlock", args=[tara.pk]) in row
    staff_row = re.search(rf'<tr id="user-{staff.pk}".*?</tr>', page, re.S).group(0)
    assert "locked until" not in staff_row

    response = client.post(reverse("user_unlock", args=[tara.pk]), follow=True)
    assert response.redirect_chain[-1][0] == reverse("users")
    html = response.content.decode()
    assert "Password logins for “tara” unlocked" in html
    row = re.search(rf'<tr id="user-{tara.pk}".*?</tr>', html, re.S).group(0)
    assert "locked until" not in row
    assert _log_in("tara", PASSWORD, "203.0.113.200").status_code == 302


def test_only_staff_lift_a_lock(client, alice) -> None:
    uma = User.objects.create_user(username="uma", password=PASSWORD)
    _guess("uma", 10, network="203.0.113")
    client.force_login(alice)
    assert client.post(reverse("user_unlock", args=[uma.pk])).status_code == 403
    _assert_account_locked(_log_in("uma", PASSWORD, "203.0.113.201"))


def test_a_locked_user_keeps_the_session_they_have() -> None:
    User.objects.create_user(username="vera", password=PASSWORD)
    logged_in = Client()
    assert _log_in("vera", PASSWORD, "192.0.2.200", logged_in).status_code == 302
    _guess("vera", 10, network="192.0.2")
    _assert_account_locked(_log_in("vera", PASSWORD, "192.0.2.201"))
    assert logged_in.get(reverse("api_keys")).status_code == 200  # still logged in


def test_the_lock_does_not_tell_whether_the_account_exists() -> None:
    """An unknown username is counted and locked as an account is, and once locked the
    page is the same, whatever the password."""
    User.objects.create_user(username="wren", password=PASSWORD)
    for n in range(10):  # in turns, so both are locked at about the same moment
        address = f"192.0.2.{n + 101}"
        known, unknown = (_log_in(name, f"guess-{n}", address) for name in ("wren", "wren-nobody"))
        assert known.status_code == unknown.status_code == (429 if n == 9 else 200)
        assert _without_csrf_tokens(known.content.decode()) == _without_csrf_tokens(
            unknown.content.decode()
        )
    pages = [
        _log_in("wren", PASSWORD, "192.0.2.202"),
        _log_in("wren", "guess", "192.0.2.203"),
        _log_in("wren-nobody", PASSWORD, "192.0.2.204"),
    ]
    waits = [_assert_account_locked(page) for page in pages]
    assert max(waits) - min(waits) <= 3
    bodies = {_without_csrf_tokens(page.content.decode()) for page in pages}
    assert len(bodies) == 1
    assert "wren" not in bodies.pop()


def test_every_spelling_of_a_username_counts_against_its_account() -> None:
    """The login form strips the username and NFKC-normalises it, so " zane" and the
    full-width "ｚａｎｅ" log in as zane: their wrong passwords are zane's."""
    User.objects.create_user(username="zane", password=PASSWORD)
    spellings = ["zane", " zane", "zane ", "ｚａｎｅ", "\tzane"]
    for n in range(10):
        _log_in(spellings[n % len(spellings)], "guess", f"198.18.3.{n + 1}")
    _assert_account_locked(_log_in("zane", PASSWORD, "198.18.3.200"))


def test_changing_the_password_lifts_the_lock(client) -> None:
    xena = User.objects.create_user(username="xena", password=PASSWORD)
    client.force_login(xena)  # logged in before the lock: the session still works
    _guess("xena", 10, network="198.18.0")
    _assert_account_locked(_log_in("xena", PASSWORD, "198.18.0.199"))
    new_password = "Harbour-lights-77"
    response = client.post(
        reverse("password_change"),
        {"old_password": PASSWORD, "new_password1": new_password, "new_password2": new_password},
    )
    assert response.status_code == 302
    assert _log_in("xena", new_password, "198.18.0.200").status_code == 302


def test_the_admin_login_is_locked_too() -> None:
    User.objects.create_user(username="stefan", password=PASSWORD, is_staff=True)
    _guess("stefan", 10, network="198.18.1")
    response = Client().post(
        reverse("admin:login"),
        {"username": "stefan", "password": PASSWORD},
        REMOTE_ADDR="198.18.1.200",
    )
    _assert_account_locked(response)


def test_one_address_alone_does_not_lock_the_account(settings) -> None:
    """From one address the per-address lockout (django-axes) stops the guessing first; its
    refusals, which never check a password, are not counted against the account: a person
    who mistyped their password many times from their own address is not locked out of
    every other one."""
    User.objects.create_user(username="yuri", password=PASSWORD)
    client = Client()
    for _ in range(settings.LOGIN_ACCOUNT_FAILURE_LIMIT + 2):
        assert _log_in("yuri", "guess", "198.18.2.1", client).status_code in (200, 429)
    assert _log_in("yuri", PASSWORD, "198.18.2.1").status_code == 429  # axes, this address
    assert _log_in("yuri", PASSWORD, "198.18.2.2").status_code == 302  # another address


def test_logging_in_and_the_users_page_work_with_the_cache_down(client, staff, settings, caplog):
    """The locks live in Django's cache (valkey): with it down a login is let through and
    the users page lists everyone, each logged, rather than a 503 for everybody."""
    nothing_there = f"redis://127.0.0.1:{free_port()}/0"
    settings.CACHES = {"default": {**settings.CACHES["default"], "LOCATION": nothing_there}}
    assert _log_in("stella", "guess", "198.18.4.1").status_code == 200
    assert _log_in("stella", "pw-stella-123", "198.18.4.1", client).status_code == 302
    assert "the login account lock is not checked, the cache is down" in caplog.text
    page = client.get(reverse("users"))
    assert page.status_code == 200 and f'id="user-{staff.pk}"' in page.content.decode()
    assert "login locks are not shown, the cache is down" in caplog.text


def test_a_lock_setting_under_one_is_refused_at_start() -> None:
    for name in ("LOGIN_ACCOUNT_FAILURE_LIMIT", "LOGIN_ACCOUNT_LOCKOUT_MINUTES"):
        result = _manage("check", SECRET_KEY=STRONG_KEY, **{name: "0"})
        assert result.returncode != 0, name
        assert f"{name} must be at least 1, not '0'" in result.stderr, name


def test_the_defaults_are_ten_wrong_passwords_within_fifteen_minutes() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGIN_ACCOUNT_")}
    show = (
        "from django.conf import settings as s; "
        "print(s.LOGIN_ACCOUNT_FAILURE_LIMIT, s.LOGIN_ACCOUNT_LOCKOUT.total_seconds())"
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", show],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    last_line = result.stdout.strip().splitlines()[-1:]  # after the shell's own notices
    assert last_line == ["10 900.0"], result.stdout + result.stderr
