"""Collections and scopes through the API: a query (and an OpenAI-style completion) searches
the collections and documents it names, each one the caller's own or shared with them."""

from __future__ import annotations

import pytest

from tests.webapp.api.conftest import bearer
from tests.webapp.api.fake_worker import FakeInferenceWorker
from tests.webapp.chat.test_chat import PASSAGES, make_document
from webapp.documents import services as documents
from webapp.documents.kv import kv_scope_for
from webapp.redis import redis_client

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def worker():
    with FakeInferenceWorker(redis_client()) as fake:
        yield fake


@pytest.fixture
def kitchen(alice):
    """Alice's "Kitchen" collection: the risotto passage; the other two are outside it."""
    make_document(alice, "space.md", [PASSAGES["space"]])
    make_document(alice, "rivers.md", [PASSAGES["rivers"]])
    collection = documents.collection_create(owner=alice, name="Kitchen")
    collection.documents.add(make_document(alice, "cooking.md", [PASSAGES["cooking"]]))
    return collection


def _query(client, auth, **payload):
    return client.post("/api/v1/query", payload, content_type="application/json", **auth)


def test_a_query_searches_only_the_collections_it_names(
    client, alice, alice_auth, kitchen, worker
) -> None:
    question = "Which moon has an ocean, and which rice goes into a risotto?"
    body = _query(client, alice_auth, question=question, collection_ids=[kitchen.pk]).json()
    assert [c["text"] for c in body["citations"] + body["also_retrieved"]] == [PASSAGES["cooking"]]
    detail = client.get(f"/api/v1/conversations/{body['conversation_id']}", **alice_auth).json()
    assert detail["scope"] == {
        "collection_ids": [kitchen.pk],
        "document_ids": [],
        "everything": False,
    }

    # The conversation keeps its scope; empty lists widen it to all of alice's documents.
    follow = _query(
        client, alice_auth, question=question, conversation_id=body["conversation_id"]
    ).json()
    assert {c["document_id"] for c in follow["citations"] + follow["also_retrieved"]} == {
        kitchen.documents.get().pk
    }
    wide = _query(
        client,
        alice_auth,
        question=question,
        conversation_id=body["conversation_id"],
        collection_ids=[],
        document_ids=[],
    ).json()
    assert len({c["document_id"] for c in wide["citations"] + wide["also_retrieved"]}) >= 2


def test_collections_list_own_and_shared_and_hide_the_rest(
    client, alice, bob, mallory_auth, kitchen
) -> None:
    bob_auth = bearer(bob)
    assert client.get("/api/v1/collections", **mallory_auth).json() == {"count": 0, "items": []}
    assert client.get(f"/api/v1/collections/{kitchen.pk}", **mallory_auth).status_code == 404

    documents.collection_share(collection=kitchen, usernames=["bob"])
    listing = client.get("/api/v1/collections", **bob_auth).json()
    (item,) = listing["items"]
    assert (item["id"], item["name"], item["owner"], item["read_only"]) == (
        kitchen.pk,
        "Kitchen",
        "alice",
        True,
    )
    assert item["document_ids"] == [kitchen.documents.get().pk]
    own = client.get(f"/api/v1/collections/{kitchen.pk}", **bearer(alice)).json()
    assert own["read_only"] is False


def test_a_scope_of_someone_elses_collection_or_document_is_a_404(
    client, alice, mallory, mallory_auth, kitchen, worker
) -> None:
    document = kitchen.documents.get()
    for scope in ({"collection_ids": [kitchen.pk]}, {"document_ids": [document.pk]}):
        response = _query(client, mallory_auth, question="Risotto rice?", **scope)
        assert response.status_code == 404 and response.json()["code"] == "not_found", scope
        completion = client.post(
            "/v1/chat/completions",
            {"model": "ragblend", "messages": [{"role": "user", "content": "Risotto?"}], **scope},
            content_type="application/json",
            **mallory_auth,
        )
        assert completion.status_code == 404, completion.content
    assert not mallory.conversations.exists()  # nothing was created for the refused scopes
    assert worker.requests == []


def test_a_shared_collection_answers_through_the_api_in_the_owners_kv_scope(
    client, alice, bob, kitchen, worker
) -> None:
    documents.collection_share(collection=kitchen, usernames=["bob"])
    response = client.post(
        "/v1/chat/completions",
        {
            "model": "ragblend",
            "collection_ids": [kitchen.pk],
            "messages": [{"role": "user", "content": "Which rice goes into a risotto?"}],
        },
        content_type="application/json",
        **bearer(bob),
    )
    assert response.status_code == 200, response.content
    assert response.json()["citations"][0]["text"] == PASSAGES["cooking"]
    assert [ref["kv_scope"] for ref in worker.requests[-1]["chunks"]] == [kv_scope_for(alice.pk)]


def test_collections_are_made_changed_and_deleted_by_their_owner_only(
    client, alice, alice_auth, bob, mallory, mallory_auth
) -> None:
    json = {"content_type": "application/json"}
    mine = make_document(alice, "cooking.md", [PASSAGES["cooking"]])
    theirs = make_document(mallory, "space.md", [PASSAGES["space"]])
    created = client.post(
        "/api/v1/collections",
        {"name": "Kitchen", "shared_with": ["bob"], "document_ids": [mine.pk, theirs.pk]},
        **json,
        **alice_auth,
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["document_ids"] == [mine.pk] and not body["read_only"]  # not mallory's
    url = f"/api/v1/collections/{body['id']}"

    bob_auth = bearer(bob)  # shared with: reads it, changes nothing
    assert client.get(url, **bob_auth).json()["read_only"] is True
    assert client.patch(url, {"name": "Bob's"}, **json, **bob_auth).status_code == 403
    assert client.delete(url, **bob_auth).status_code == 403
    for response in (
        client.patch(url, {"name": "x"}, **json, **mallory_auth),
        client.delete(url, **mallory_auth),
    ):
        assert response.status_code == 404  # not shared with mallory: not there at all

    renamed = client.patch(url, {"name": "Cooking", "shared_with": []}, **json, **alice_auth)
    assert renamed.status_code == 200 and renamed.json()["name"] == "Cooking"
    assert client.get(url, **bob_auth).status_code == 404  # unshared
    documents.collection_create(owner=alice, name="Garden")
    assert client.patch(url, {"name": "Garden"}, **json, **alice_auth).status_code == 400
    refused = client.patch(url, {"name": "Pantry", "shared_with": ["nobody"]}, **json, **alice_auth)
    assert refused.status_code == 400 and "nobody" in refused.json()["message"]
    assert client.get(url, **alice_auth).json()["name"] == "Cooking"  # nothing half-done

    assert client.delete(url, **alice_auth).status_code == 204
    assert client.get(url, **alice_auth).status_code == 404
    mine.refresh_from_db()  # the documents stay


def test_a_document_shared_with_you_reads_through_the_api_and_only_its_owner_deletes_it(
    client, alice, alice_auth, bob, mallory_auth, kitchen
) -> None:
    """The API keeps the document pages' rule: a shared reader reads it (``read_only``), a
    delete by them is a 403 that deletes nothing; anyone else gets a 404, as after unsharing."""
    document = kitchen.documents.get()
    url = f"/api/v1/documents/{document.pk}"
    assert client.get(url, **alice_auth).json()["read_only"] is False
    assert client.get(url, **bearer(bob)).status_code == 404  # not shared yet
    kitchen.shared_with.add(bob)

    read = client.get(url, **bearer(bob))
    assert read.status_code == 200, read.content
    assert read.json()["title"] == document.title and read.json()["read_only"] is True
    assert client.delete(url, **bearer(bob)).status_code == 403
    assert client.get(url, **mallory_auth).status_code == 404
    assert client.delete(url, **mallory_auth).status_code == 404
    assert client.get(url, **alice_auth).status_code == 200  # nothing was deleted

    kitchen.shared_with.remove(bob)
    assert client.get(url, **bearer(bob)).status_code == 404
    assert client.delete(url, **alice_auth).status_code == 204


def test_a_key_holder_with_only_shared_collections_is_told_of_collection_ids(
    client, alice, bob, kitchen, worker
) -> None:
    """Not the page's "Search in": a program names collections in its request."""
    documents.collection_share(collection=kitchen, usernames=["bob"])
    bob_auth = bearer(bob)
    body = _query(client, bob_auth, question="Which rice goes into a risotto?").json()
    completion = client.post(
        "/v1/chat/completions",
        {"model": "ragblend", "messages": [{"role": "user", "content": "Risotto rice?"}]},
        content_type="application/json",
        **bob_auth,
    ).json()
    for answer in (body["answer"], completion["choices"][0]["message"]["content"]):
        assert "collection_ids" in answer and "Search in" not in answer
    assert body["citations"] == [] and body["metrics"]["not_found"] is True
    scoped = _query(
        client, bob_auth, question="Which rice goes into a risotto?", collection_ids=[kitchen.pk]
    ).json()
    assert [c["text"] for c in scoped["citations"] + scoped["also_retrieved"]] == [
        PASSAGES["cooking"]
    ]  # what the hint says works
