"""Accounts in the product: changing one's password, staff adding users, self sign-up (off
unless SIGNUP_ENABLED)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from webapp.accounts import services

pytestmark = pytest.mark.django_db

User = get_user_model()


def _can_log_in(username: str, password: str) -> bool:
    return (
        Client().post(reverse("login"), {"username": username, "password": password}).status_code
        == 302
    )


# --- password change -----------------------------------------------------------------------


def test_nav_links_to_the_password_page(client, alice) -> None:
    client.force_login(alice)
    html = client.get(reverse("api_keys")).content.decode()
    assert f'href="{reverse("password_change")}"' in html
    assert f'href="{reverse("users")}"' not in html  # the users page is for staff


def test_password_change_needs_login(client) -> None:
    response = client.get(reverse("password_change"))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("login"))


def test_password_change_takes_the_new_password_and_keeps_the_session(client, alice) -> None:
    client.force_login(alice)
    page = client.get(reverse("password_change"))
    assert page.status_code == 200 and 'class="topbar"' in page.content.decode()
    response = client.post(
        reverse("password_change"),
        {
            "old_password": "pw-alice-123",
            "new_password1": "Harbour-lights-77",
            "new_password2": "Harbour-lights-77",
        },
    )
    assert response.status_code == 302
    assert response["Location"] == reverse("password_change_done")
    assert client.get(reverse("api_keys")).status_code == 200  # still logged in
    assert _can_log_in("alice", "Harbour-lights-77")
    assert not _can_log_in("alice", "pw-alice-123")


def test_password_change_refuses_a_wrong_old_password(client, alice) -> None:
    client.force_login(alice)
    response = client.post(
        reverse("password_change"),
        {
            "old_password": "wrong",
            "new_password1": "Harbour-lights-77",
            "new_password2": "Harbour-lights-77",
        },
    )
    assert response.status_code == 200
    assert "Your old password was entered incorrectly" in response.content.decode()
    alice.refresh_from_db()
    assert alice.check_password("pw-alice-123")


# --- staff add users -----------------------------------------------------------------------


def test_users_page_is_staff_only(client, alice) -> None:
    assert client.get(reverse("users")).status_code == 302  # anonymous: to the login page
    client.force_login(alice)
    for method in (client.get, client.post):
        response = method(reverse("users"), {"username": "mallory"})
        assert response.status_code == 403
        assert 'id="error-403"' in response.content.decode()
    assert not User.objects.filter(username="mallory").exists()


def test_staff_add_a_user_with_a_generated_password_shown_once(client, staff) -> None:
    client.force_login(staff)
    assert f'href="{reverse("users")}"' in client.get(reverse("users")).content.decode()
    response = client.post(reverse("users"), {"username": "dora", "email": "dora@example.org"})
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    password = response.context["password"]
    assert len(password) >= 16 and f">{password}<" in response.content.decode()
    dora = User.objects.get(username="dora")
    assert dora.email == "dora@example.org" and not dora.is_staff and dora.is_active
    assert _can_log_in("dora", password)
    again = client.get(reverse("users")).content.decode()
    assert password not in again and "dora" in again  # listed, the password never again


def test_staff_add_a_user_with_a_given_password(client, staff) -> None:
    client.force_login(staff)
    client.post(reverse("users"), {"username": "ed", "password": "Quiet-river-2041"})
    assert _can_log_in("ed", "Quiet-river-2041")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"username": "ALICE"}, "is taken"),
        ({"username": ""}, "Give the user a username."),
        ({"username": "bad name!"}, "Enter a valid username"),
        ({"username": "fay", "email": "not-an-address"}, "is not an email address"),
        ({"username": "gus", "password": "123"}, "too short"),
    ],
)
def test_staff_add_user_refusals_are_shown(client, staff, alice, fields, message) -> None:
    client.force_login(staff)
    before = User.objects.count()
    response = client.post(reverse("users"), fields)
    assert response.status_code == 422
    assert message in response.content.decode()
    assert User.objects.count() == before


def test_user_create_service_generates_distinct_passwords() -> None:
    _, first = services.user_create(username="u1")
    _, second = services.user_create(username="u2")
    assert first != second


# --- self sign-up ---------------------------------------------------------------------------


def test_signup_is_off_by_default(client, settings) -> None:
    assert settings.SIGNUP_ENABLED is False
    assert client.get(reverse("signup")).status_code == 404
    response = client.post(
        reverse("signup"),
        {"username": "hal", "password1": "Quiet-river-2041", "password2": "Quiet-river-2041"},
    )
    assert response.status_code == 404
    assert not User.objects.filter(username="hal").exists()
    assert reverse("signup") not in client.get(reverse("login")).content.decode()


def test_signup_when_enabled_creates_a_plain_user_and_logs_in(client, settings) -> None:
    settings.SIGNUP_ENABLED = True
    assert f'href="{reverse("signup")}"' in client.get(reverse("login")).content.decode()
    response = client.post(
        reverse("signup"),
        {
            "username": "hal",
            "password1": "Quiet-river-2041",
            "password2": "Quiet-river-2041",
            "is_staff": "on",
        },
    )
    assert response.status_code == 302
    hal = User.objects.get(username="hal")
    assert not hal.is_staff and not hal.is_superuser
    assert client.get(reverse("api_keys")).status_code == 200  # logged in


def test_signup_refuses_mismatched_passwords_and_taken_names(client, settings, alice) -> None:
    settings.SIGNUP_ENABLED = True
    mismatch = client.post(
        reverse("signup"),
        {"username": "ivy", "password1": "Quiet-river-2041", "password2": "Quiet-river-2042"},
    )
    assert mismatch.status_code == 422
    taken = client.post(
        reverse("signup"),
        {"username": "Alice", "password1": "Quiet-river-2041", "password2": "Quiet-river-2041"},
    )
    assert taken.status_code == 422
    assert not User.objects.filter(username__in=["ivy", "Alice"]).exists()
