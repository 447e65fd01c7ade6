"""Text the database cannot store (a NUL character, a lone surrogate) in a page's form or query
string is a 400 before any view runs, never a 500, and nothing is written (#48): each form that
gave a 500 is tried with both. A form sends a lone surrogate as the bytes a client encodes it
to (``%ED%A0%80``), which are not UTF-8; a JSON body sends it as ``"\\ud800"``. The login
lockout's 429 says when to come back (Retry-After), as the rate limits' 429 does."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from urllib.parse import quote

import pytest
from django.contrib.auth import get_user_model
from django.test import AsyncClient, Client

from tests.webapp.api.conftest import bearer
from webapp.accounts.models import ApiKey, Invite
from webapp.chat.models import Conversation, Message
from webapp.documents.models import Collection

pytestmark = pytest.mark.django_db

User = get_user_model()
FORM = "application/x-www-form-urlencoded"
HOSTILE = {"nul": "Kit\x00chen", "lone surrogate": "Kit\ud800chen"}


@pytest.fixture(params=list(HOSTILE))
def hostile(request) -> str:
    return HOSTILE[request.param]


def _encoded(**fields: str) -> str:
    """A urlencoded form as a client sends it: a lone surrogate as its (invalid) UTF-8."""
    return "&".join(
        f"{quote(name, errors='surrogatepass')}={quote(value, errors='surrogatepass')}"
        for name, value in fields.items()
    )


def _post(client: Client, url: str, **fields: str):
    return client.post(url, _encoded(**fields), content_type=FORM)


def _assert_refused(response) -> None:
    assert response.status_code == 400, response.content[:300]
    html = response.content.decode()
    assert 'id="error-400"' in html and 'class="topbar"' in html  # the styled page


@pytest.fixture
def alice_client(client, alice) -> Client:
    client.force_login(alice)
    return client


@pytest.fixture
def staff_client(client, staff) -> Client:
    client.force_login(staff)
    return client


def test_a_collections_name_is_refused(alice_client, hostile) -> None:
    _assert_refused(_post(alice_client, "/documents/collections/", name=hostile))
    assert not Collection.objects.exists()


def test_a_collections_new_name_is_refused(alice_client, alice, hostile) -> None:
    kitchen = Collection.objects.create(owner=alice, name="Kitchen")
    _assert_refused(
        _post(alice_client, f"/documents/collections/{kitchen.pk}/rename", name=hostile)
    )
    kitchen.refresh_from_db()
    assert kitchen.name == "Kitchen"


def test_a_username_to_share_with_is_refused(alice_client, alice, bob, hostile) -> None:
    kitchen = Collection.objects.create(owner=alice, name="Kitchen")
    url = f"/documents/collections/{kitchen.pk}/share"
    _assert_refused(_post(alice_client, url, usernames=f"bob {hostile}"))
    assert not kitchen.shared_with.exists()


def test_an_api_keys_name_is_refused(alice_client, hostile) -> None:
    _assert_refused(_post(alice_client, "/accounts/api-keys/", name=hostile))
    assert not ApiKey.objects.exists()


def test_a_chat_search_is_refused(alice_client, alice, hostile) -> None:
    Conversation.objects.create(owner=alice, title="Kitchen")
    response = alice_client.get(f"/chat/?{_encoded(q=hostile)}")
    _assert_refused(response)
    assert "Kitchen" not in response.content.decode()


def test_a_conversations_title_and_a_question_are_refused(alice_client, alice, hostile) -> None:
    conversation = Conversation.objects.create(owner=alice, title="Kitchen")
    _assert_refused(_post(alice_client, f"/chat/{conversation.pk}/rename", title=hostile))
    _assert_refused(_post(alice_client, f"/chat/{conversation.pk}/ask", question=hostile))
    conversation.refresh_from_db()
    assert conversation.title == "Kitchen"
    assert not Message.objects.exists()


def test_a_new_users_name_is_refused(staff_client, hostile) -> None:
    response = _post(staff_client, "/accounts/users/", username=hostile, email="")
    _assert_refused(response)
    assert list(User.objects.values_list("username", flat=True)) == ["stella"]


def test_an_invites_username_is_refused(staff_client, hostile) -> None:
    _assert_refused(_post(staff_client, "/accounts/invites/", username=hostile, email=""))
    assert not Invite.objects.exists()


def test_the_refusal_names_the_field(alice_client) -> None:
    response = _post(alice_client, "/documents/collections/", name="Kit\x00chen")
    assert "The field “name” holds a NUL character" in response.content.decode()
    surrogate = _post(alice_client, "/documents/collections/", name="Kit\ud800chen")
    assert "not valid UTF-8" in surrogate.content.decode()


def test_a_multipart_form_and_a_fields_name_are_checked_too(alice_client) -> None:
    _assert_refused(alice_client.post("/documents/collections/", {"name": "Kit\x00chen"}))
    _assert_refused(_post(alice_client, "/documents/collections/", **{"na\x00me": "Kitchen"}))
    assert not Collection.objects.exists()


def test_htmx_gets_the_message_as_a_fragment(alice_client, alice) -> None:
    conversation = Conversation.objects.create(owner=alice, title="Kitchen")
    response = alice_client.post(
        f"/chat/{conversation.pk}/ask",
        _encoded(question="Kit\x00chen"),
        content_type=FORM,
        HTTP_HX_REQUEST="true",
    )
    assert response.status_code == 400
    html = response.content.decode()
    assert "<html" not in html and "holds a NUL character" in html


def test_pages_served_over_asgi_are_checked_too() -> None:
    """Production serves ASGI (the test client above is WSGI): the query string reaches the
    check the same way there."""
    response = asyncio.run(AsyncClient().get("/accounts/login/?next=/%00"))
    assert response.status_code == 400
    assert "The field “next” holds a NUL character" in response.content.decode()


def test_text_that_can_be_stored_passes(alice_client, alice) -> None:
    """Only the unstorable is refused: a replacement character sent as valid UTF-8, or a
    control character the service cleans, is not."""
    response = _post(alice_client, "/documents/collections/", name="Kit\ufffdchen\x07")
    assert response.status_code == 302
    assert Collection.objects.get(owner=alice).name == "Kit\ufffdchen\x07"


def test_the_apis_refuse_a_lone_surrogate_in_json_with_a_422(client, alice) -> None:
    """The APIs check their JSON themselves (``Text``), in their own error shapes; the OpenAI
    route's message content was a 500."""
    json_request = {"content_type": "application/json", **bearer(alice)}
    named = client.post("/api/v1/collections", {"name": "Kit\ud800chen"}, **json_request)
    assert named.status_code == 422 and named.json()["code"] == "invalid_request"
    asked = client.post(
        "/v1/chat/completions",
        {"model": "ragblend", "messages": [{"role": "user", "content": "Kit\ud800chen"}]},
        **json_request,
    )
    assert asked.status_code == 422, asked.content
    assert "messages.0.content" in asked.json()["error"]["message"]
    assert not Collection.objects.exists() and not Conversation.objects.exists()


# --- the login lockout's Retry-After ---------------------------------------------------------


def _log_in(client: Client, password: str, address: str):
    return client.post(
        "/accounts/login/", {"username": "alice", "password": password}, REMOTE_ADDR=address
    )


@pytest.mark.parametrize(("minutes", "address"), [(15, "203.0.113.70"), (2, "203.0.113.71")])
def test_the_lockout_says_when_to_come_back(client, alice, settings, minutes, address) -> None:
    settings.LOGIN_RATE_LIMIT = "1000/d"  # the per-address limit stays out of the way
    settings.AXES_COOLOFF_TIME = timedelta(minutes=minutes)
    for _ in range(settings.AXES_FAILURE_LIMIT):
        _log_in(client, "guess", address)
    locked = _log_in(client, "pw-alice-123", address)
    assert locked.status_code == 429
    assert locked["Retry-After"] == str(minutes * 60)
    assert f"Try again in {minutes} minutes" in locked.content.decode()
