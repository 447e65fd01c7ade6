"""Invites (#18): staff make a link (staff only) that lets one person create their account and
be signed in; it works once, until it expires (INVITE_VALID_DAYS, 7 by default); a used,
expired or unknown link is a styled page that says which."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from webapp.accounts import services
from webapp.accounts.models import Invite

pytestmark = pytest.mark.django_db

User = get_user_model()
PASSWORD = "Quiet-river-2041"


def _link_path(token: str) -> str:
    return reverse("invite_accept", args=[token])


def _accept(client: Client, token: str, username: str = "nina", password: str = PASSWORD):
    return client.post(
        _link_path(token), {"username": username, "password1": password, "password2": password}
    )


def test_the_invites_page_is_staff_only(client, alice) -> None:
    assert client.get(reverse("invites")).status_code == 302  # anonymous: to the login page
    client.force_login(alice)
    for method in (client.get, client.post):
        response = method(reverse("invites"), {"username": "mallory"})
        assert response.status_code == 403
        assert 'id="error-403"' in response.content.decode()
    assert not Invite.objects.exists()


def test_staff_make_a_link_shown_once_valid_seven_days(client, staff, settings) -> None:
    assert settings.INVITE_VALID_DAYS == 7
    client.force_login(staff)
    assert f'href="{reverse("invites")}"' in client.get(reverse("users")).content.decode()
    response = client.post(reverse("invites"), {"email": "nina@example.org"})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    link = response.context["invite_link"]
    assert link.startswith("http://testserver/accounts/invite/")
    assert f'value="{link}"' in response.content.decode()
    invite = Invite.objects.get()
    token = link.rstrip("/").rsplit("/", 1)[1]
    assert invite.created_by == staff and invite.token_sha256 != token and len(token) >= 40
    assert abs(invite.expires_at - (timezone.now() + timedelta(days=7))) < timedelta(minutes=1)
    again = client.get(reverse("invites")).content.decode()
    assert token not in again and "nina@example.org" in again  # listed, the link never again


def test_staff_choose_how_many_days(client, staff) -> None:
    client.force_login(staff)
    client.post(reverse("invites"), {"days": "2"})
    invite = Invite.objects.get()
    assert abs(invite.expires_at - (timezone.now() + timedelta(days=2))) < timedelta(minutes=1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"username": "ALICE"}, "is taken"),
        ({"username": "bad name!"}, "Enter a valid username"),
        ({"email": "not-an-address"}, "is not an email address"),
        ({"days": "0"}, "valid for 1 to 90 days"),
        ({"days": "91"}, "valid for 1 to 90 days"),
        ({"days": "a week"}, "valid for 1 to 90 days"),
    ],
)
def test_invite_refusals_are_shown(client, staff, alice, fields, message) -> None:
    client.force_login(staff)
    response = client.post(reverse("invites"), fields)
    assert response.status_code == 422 and message in response.content.decode()
    assert not Invite.objects.exists()


def test_a_link_makes_one_account_signs_it_in_and_works_once(staff) -> None:
    _, token = services.invite_create(created_by=staff)
    person = Client()
    page = person.get(_link_path(token))
    assert page.status_code == 200 and 'id="invite-accept-form"' in page.content.decode()
    response = _accept(person, token, username="nina")
    assert response.status_code == 302 and response["Location"] == "/"
    nina = User.objects.get(username="nina")
    assert not nina.is_staff and nina.check_password(PASSWORD)
    assert person.get(reverse("api_keys")).status_code == 200  # signed in
    invite = Invite.objects.get()
    assert invite.used_by == nina and invite.state == Invite.State.USED

    someone_else = Client()
    for response in (someone_else.get(_link_path(token)), _accept(someone_else, token, "omar")):
        assert response.status_code == 410
        html = response.content.decode()
        assert 'id="invite-refused"' in html and "has been used already" in html
    assert not User.objects.filter(username="omar").exists()


def test_an_expired_link_is_refused(client, staff) -> None:
    invite, token = services.invite_create(created_by=staff)
    Invite.objects.filter(pk=invite.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    for response in (client.get(_link_path(token)), _accept(client, token)):
        assert response.status_code == 410
        html = response.content.decode()
        assert "This invite link has expired" in html and 'class="topbar"' in html  # styled
    assert not User.objects.filter(username="nina").exists()
    assert Invite.objects.get().used_at is None


def test_an_unknown_link_is_a_styled_404(client) -> None:
    for token in ("not-a-token", "x" * 500):
        response = client.get(_link_path(token))
        assert response.status_code == 404
        assert "This invite link is not valid" in response.content.decode()


def test_an_invite_tied_to_a_username_and_email_gives_them(client, staff) -> None:
    _, token = services.invite_create(created_by=staff, username="nina", email="nina@example.org")
    page = client.get(_link_path(token)).content.decode()
    assert "Your username is “nina”" in page and "disabled" in page
    assert _accept(client, token, username="somebody-else").status_code == 302
    nina = User.objects.get(username="nina")
    assert nina.email == "nina@example.org"
    assert not User.objects.filter(username="somebody-else").exists()


def test_a_refused_password_keeps_the_link_usable(client, staff) -> None:
    _, token = services.invite_create(created_by=staff)
    response = _accept(client, token, password="123")
    assert response.status_code == 422 and "too short" in response.content.decode()
    assert Invite.objects.get().used_at is None
    assert _accept(client, token).status_code == 302


def test_staff_withdraw_an_unused_invite_and_its_link_then_says_it_expired(
    client, staff, alice
) -> None:
    invite, token = services.invite_create(created_by=staff, username="nina")
    withdraw = reverse("invite_withdraw", args=[invite.pk])
    client.force_login(alice)  # not staff: refused, nothing changes
    assert client.post(withdraw).status_code == 403
    assert Client().get(_link_path(token)).status_code == 200

    client.force_login(staff)
    assert 'class="danger">Withdraw' in client.get(reverse("invites")).content.decode()
    response = client.post(withdraw, follow=True)
    assert "withdrawn" in response.content.decode()
    refused = _accept(Client(), token)
    assert refused.status_code == 410 and "expired" in refused.content.decode()
    assert not User.objects.filter(username="nina").exists()
    again = client.post(withdraw, follow=True)  # already over: said so, nothing changes
    assert "nothing changed" in again.content.decode()
    assert client.get(withdraw).status_code == 405


def test_a_used_invite_cannot_be_withdrawn(client, staff) -> None:
    invite, token = services.invite_create(created_by=staff)
    assert _accept(Client(), token).status_code == 302
    client.force_login(staff)
    client.post(reverse("invite_withdraw", args=[invite.pk]))
    invite.refresh_from_db()
    assert invite.state == Invite.State.USED and invite.expires_at > timezone.now()
