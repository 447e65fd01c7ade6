"""A conversation searches only its scope (collections and documents), what its owner may
read at each question; a collection shared with a user is searched under its owner's KV
scope, so the worker finds the KV the owner's upload stored."""

from __future__ import annotations

import base64
import json

import pytest
from django.conf import settings

from kvservice.protocol import GENERATE_TASK, INFERENCE_QUEUE
from tests.webapp.chat.test_chat import PASSAGES, make_document
from tests.webapp.chat.test_grounding import _ask
from webapp.chat import services
from webapp.chat.retrieval import retrieve_chunks
from webapp.documents import services as documents
from webapp.documents.embeddings import embed_texts
from webapp.documents.kv import kv_scope_for
from webapp.documents.selectors import Scope

pytestmark = pytest.mark.django_db


def _queued_requests(client) -> list[dict]:
    """The generate requests waiting on the shared queue (no worker runs here)."""
    found = []
    for raw in client.lrange(INFERENCE_QUEUE, 0, -1):
        message = json.loads(raw)
        if message["headers"]["task"] == GENERATE_TASK:
            args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
            found.append(args[0])
    return found


def _titles(user, question: str, scope: Scope) -> list[str]:
    vector = embed_texts([question])[0]
    found = retrieve_chunks(
        user=user, question=question, query_embedding=vector, top_k=6, scope=scope
    )
    return [chunk.document.title for chunk in found]


@pytest.fixture
def library(alice):
    """Alice's three documents; "Science" holds only the one about Europa."""
    space = make_document(alice, "space.md", [PASSAGES["space"]])
    make_document(alice, "rivers.md", [PASSAGES["rivers"]])
    make_document(alice, "cooking.md", [PASSAGES["cooking"]])
    science = documents.collection_create(owner=alice, name="Science")
    science.documents.add(space)
    return science


def test_a_scoped_conversation_retrieves_only_from_its_collections_and_documents(
    alice, library, queue
) -> None:
    question = "Which moon hides an ocean, and where does the Danube flow?"
    assert set(_titles(alice, question, Scope())) >= {"space.md", "rivers.md"}
    assert set(_titles(alice, question, Scope.of([library.pk]))) == {"space.md"}
    rivers = alice.documents.get(title="rivers.md")
    assert set(_titles(alice, question, Scope.of([library.pk], [rivers.pk]))) == {
        "space.md",
        "rivers.md",
    }

    conversation = services.conversation_create(owner=alice)
    services.conversation_set_scope(
        user=alice, conversation=conversation, collection_ids=[library.pk], document_ids=[]
    )
    answer = _ask(alice, conversation, question)
    assert {c.document_title for c in answer.citations.all()} == {"space.md"}


def test_a_scope_with_nothing_ready_says_so(alice, library, queue) -> None:
    library.documents.clear()
    conversation = services.conversation_create(owner=alice)
    services.conversation_set_scope(
        user=alice, conversation=conversation, collection_ids=[library.pk], document_ids=[]
    )
    answer = _ask(alice, conversation, "Europa ocean?")
    answer.refresh_from_db()
    assert answer.content == services.NOTHING_IN_SCOPE and answer.citations.count() == 0


def test_another_user_can_neither_scope_to_nor_retrieve_from_an_unshared_collection(
    client, alice, bob, library
) -> None:
    conversation = services.conversation_create(owner=bob)
    with pytest.raises(services.ScopeNotFound):
        services.conversation_set_scope(
            user=bob, conversation=conversation, collection_ids=[library.pk], document_ids=[]
        )
    space = library.documents.get()
    with pytest.raises(services.ScopeNotFound):
        services.conversation_set_scope(
            user=bob, conversation=conversation, collection_ids=[], document_ids=[space.pk]
        )
    client.force_login(bob)
    response = client.post(f"/chat/{conversation.id}/scope", {"collections": [library.pk]})
    assert response.status_code == 404
    assert conversation.scope.is_everything
    # Even a scope forged past those checks reads none of alice's chunks.
    assert _titles(bob, "Europa ocean Jupiter", Scope.of([library.pk], [space.pk])) == []


def test_a_user_whose_only_documents_are_shared_with_them_is_told_where_they_are(
    alice, bob, library, queue
) -> None:
    conversation = services.conversation_create(owner=bob)
    answer = _ask(bob, conversation, "Which moon has an ocean under its ice?")
    answer.refresh_from_db()
    assert answer.content == services.NOTHING_FOUND  # nothing of his, nothing shared

    documents.collection_share(collection=library, usernames=["bob"])
    answer = _ask(bob, services.conversation_create(owner=bob), "Which moon has an ocean?")
    answer.refresh_from_db()  # not "you have no ready documents yet": he has some to read
    assert answer.content == services.NOTHING_OF_YOUR_OWN and "Search in" in answer.content
    assert answer.citations.count() == 0 and queue.llen(INFERENCE_QUEUE) == 0


def test_a_shared_collection_is_searched_in_its_owners_kv_scope(
    client, alice, bob, library, queue
) -> None:
    assert settings.KV_CACHE_SCOPE == "user"
    documents.collection_share(collection=library, usernames=["bob"])
    conversation = services.conversation_create(owner=bob)
    client.force_login(bob)
    response = client.post(
        f"/chat/{conversation.id}/scope", {"collections": [library.pk]}, HTTP_HX_REQUEST="true"
    )
    assert "Science" in response.content.decode()  # the "Search in" summary names it
    answer = _ask(bob, conversation, "Which moon has an ocean under its ice?")
    assert [c.document_title for c in answer.citations.all()] == ["space.md"]
    (request,) = _queued_requests(queue)
    # Alice's chunk KV is stored under her scope: bob's own ("u<bob>") would miss it.
    assert [ref["kv_scope"] for ref in request["chunks"]] == [kv_scope_for(alice.pk)]
    assert kv_scope_for(alice.pk) != kv_scope_for(bob.pk)

    # Bob reads the passage in his citation, and alice's document page (read-only) from it
    # while the collection is shared with him.
    citation = answer.citations.get()
    page = client.get(f"/chat/citations/{citation.id}/").content.decode()
    assert PASSAGES["space"] in page and "From a collection shared with you." in page
    assert f'href="/documents/{citation.document_id}/"' in page
    assert client.get(f"/documents/{citation.document_id}/").status_code == 200
    documents.collection_share(collection=library, usernames=[])
    page = client.get(f"/chat/citations/{citation.id}/").content.decode()
    assert "no longer shared with you" in page and f"/documents/{citation.document_id}/" not in page
    assert client.get(f"/documents/{citation.document_id}/").status_code == 404


def test_unsharing_takes_effect_at_the_next_question(alice, bob, library, queue) -> None:
    documents.collection_share(collection=library, usernames=["bob"])
    conversation = services.conversation_create(owner=bob)
    services.conversation_set_scope(
        user=bob, conversation=conversation, collection_ids=[library.pk], document_ids=[]
    )
    assert _ask(bob, conversation, "Europa ocean?").citations.count() == 1
    documents.collection_share(collection=library, usernames=[])
    answer = _ask(bob, conversation, "Europa ocean?")
    assert answer.citations.count() == 0
    answer.refresh_from_db()
    assert answer.content == services.SCOPE_GONE


QUESTION = "Which moon hides an ocean, and where does the Danube flow?"


def _scoped_to(user, *, collection_ids=(), document_ids=()):
    conversation = services.conversation_create(owner=user)
    services.conversation_set_scope(
        user=user,
        conversation=conversation,
        collection_ids=collection_ids,
        document_ids=document_ids,
    )
    return conversation


def test_deleting_the_scoped_collection_reads_nothing_not_everything(alice, library, queue) -> None:
    conversation = _scoped_to(alice, collection_ids=[library.pk])
    documents.collection_delete(collection=library)
    assert set(_titles(alice, QUESTION, Scope())) >= {"space.md", "rivers.md"}  # all of hers
    scope = conversation.scope
    assert not scope.is_everything and not scope.collection_ids
    assert _titles(alice, QUESTION, scope) == []

    answer = _ask(alice, conversation, QUESTION)
    answer.refresh_from_db()
    assert answer.citations.count() == 0 and answer.content == services.SCOPE_GONE
    assert _queued_requests(queue) == []  # nothing sent to the model


def test_deleting_the_scoped_documents_reads_nothing_not_everything(alice, library, queue) -> None:
    rivers = alice.documents.get(title="rivers.md")
    conversation = _scoped_to(alice, document_ids=[rivers.pk])
    assert [c.document_title for c in _ask(alice, conversation, QUESTION).citations.all()] == [
        "rivers.md"
    ]
    documents.document_delete(document=rivers)
    answer = _ask(alice, conversation, QUESTION)
    answer.refresh_from_db()
    assert answer.citations.count() == 0 and answer.content == services.SCOPE_GONE


def test_a_scope_partly_deleted_keeps_what_is_left(alice, library, queue) -> None:
    cooking = alice.documents.get(title="cooking.md")
    conversation = _scoped_to(alice, collection_ids=[library.pk], document_ids=[cooking.pk])
    documents.collection_delete(collection=library)
    found = _titles(alice, "Europa ocean, and risotto rice?", conversation.scope)
    assert found == ["cooking.md"]


def test_the_scope_panel_says_the_scope_is_gone_until_another_is_chosen(
    client, alice, library
) -> None:
    conversation = _scoped_to(alice, collection_ids=[library.pk])
    client.force_login(alice)
    page = client.get(f"/chat/{conversation.id}/").content.decode()
    assert 'id="scope-gone"' not in page and ">Science</strong>" in page
    documents.collection_delete(collection=library)
    page = client.get(f"/chat/{conversation.id}/").content.decode()
    assert 'id="scope-gone"' in page and 'id="scope-names">nothing</strong>' in page
    assert '<details id="scope" class="scope card" open>' in page  # the choice in view

    # Choosing none, on purpose, searches all of her documents again.
    response = client.post(f"/chat/{conversation.id}/scope", {}, HTTP_HX_REQUEST="true")
    assert 'id="scope-gone"' not in response.content.decode()
    assert "all your documents" in response.content.decode()
    conversation.refresh_from_db()
    assert conversation.scope.is_everything
