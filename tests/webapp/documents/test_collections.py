"""Collections: the owner creates, renames, fills, shares and deletes them; someone else sees
nothing (404); a user it is shared with reads it and changes nothing (403)."""

from __future__ import annotations

import pytest

from webapp.documents import services
from webapp.documents.models import Collection, Document

pytestmark = pytest.mark.django_db


def _document(owner, title: str) -> Document:
    return Document.objects.create(
        owner=owner, title=title, content_sha256=title.ljust(64, "0"), status="ready"
    )


@pytest.fixture
def handbook(user) -> Collection:
    collection = services.collection_create(owner=user, name="Handbook")
    collection.documents.add(_document(user, "harbour.md"))
    return collection


def test_the_owner_creates_renames_fills_and_deletes_a_collection(alice_client, user) -> None:
    harbour, lighthouse = _document(user, "harbour.md"), _document(user, "lighthouse.md")
    response = alice_client.post("/documents/collections/", {"name": "  Port   history "})
    collection = Collection.objects.get(owner=user)
    assert collection.name == "Port history"
    assert response.url == f"/documents/collections/{collection.pk}/"

    renamed = alice_client.post(
        f"/documents/collections/{collection.pk}/rename", {"name": "Harbours"}, follow=True
    )
    assert "Renamed to “Harbours”." in renamed.content.decode()  # each change says so
    filled = alice_client.post(
        f"/documents/collections/{collection.pk}/documents",
        {"documents": [harbour.pk]},
        follow=True,
    )
    assert "Saved: “Harbours” holds 1 document." in filled.content.decode()
    collection.refresh_from_db()
    assert collection.name == "Harbours"
    assert list(collection.documents.all()) == [harbour]
    page = alice_client.get("/documents/").content.decode()
    assert f'href="/documents/collections/{collection.pk}/">Harbours</a>' in page  # a chip

    alice_client.post(
        f"/documents/collections/{collection.pk}/documents", {"documents": [lighthouse.pk]}
    )
    assert list(collection.documents.all()) == [lighthouse]
    alice_client.post(f"/documents/collections/{collection.pk}/delete")
    assert not Collection.objects.filter(pk=collection.pk).exists()
    assert Document.objects.filter(owner=user).count() == 2  # the documents stay


def test_names_are_required_and_unique_per_owner(alice_client, user, bob) -> None:
    services.collection_create(owner=user, name="Notes")
    with pytest.raises(services.CollectionError, match="already have"):
        services.collection_create(owner=user, name="Notes")
    with pytest.raises(services.CollectionError, match="a name"):
        services.collection_create(owner=user, name="   ")
    assert services.collection_create(owner=bob, name="Notes").owner == bob  # another's: fine
    response = alice_client.post("/documents/collections/", {"name": "Notes"}, follow=True)
    assert "You already have a collection named “Notes”." in response.content.decode()


def test_only_the_owners_documents_can_be_put_in(user, mallory, handbook) -> None:
    theirs = _document(mallory, "mallory.md")
    mine = _document(user, "mine.md")
    services.collection_set_documents(collection=handbook, document_ids=[theirs.pk, mine.pk])
    assert list(handbook.documents.all()) == [mine]


def test_someone_else_gets_404_everywhere_and_changes_nothing(
    client, user, mallory, handbook
) -> None:
    client.force_login(mallory)
    base = f"/documents/collections/{handbook.pk}"
    assert client.get(f"{base}/").status_code == 404
    for action in ("rename", "documents", "share", "delete"):
        response = client.post(f"{base}/{action}", {"name": "x", "usernames": "mallory"})
        assert response.status_code == 404, action
    handbook.refresh_from_db()
    assert handbook.name == "Handbook" and handbook.documents.count() == 1
    assert not handbook.shared_with.exists()
    assert "Handbook" not in client.get("/documents/collections/").content.decode()


def test_a_shared_user_reads_but_cannot_change(client, user, bob, handbook) -> None:
    assert services.collection_share(collection=handbook, usernames=["bob", "alice", " "]) == [
        "bob"
    ]  # the owner is never in the list
    client.force_login(bob)
    listing = client.get("/documents/collections/").content.decode()
    assert "Handbook" in listing and "by alice · read-only" in listing
    page = client.get(f"/documents/collections/{handbook.pk}/").content.decode()
    assert "harbour.md" in page and 'id="shared-notice"' in page
    assert 'id="collection-rename"' not in page and 'id="collection-delete"' not in page
    base = f"/documents/collections/{handbook.pk}"
    for action in ("rename", "documents", "share", "delete"):
        response = client.post(f"{base}/{action}", {"name": "x", "usernames": "bob mallory"})
        assert response.status_code == 403, action
    handbook.refresh_from_db()
    assert handbook.name == "Handbook" and handbook.documents.count() == 1
    assert list(handbook.shared_with.values_list("username", flat=True)) == ["bob"]
    # The documents themselves stay the owner's: bob reads their page, and may not delete them
    # (tests/webapp/documents/test_shared_document.py).
    document = handbook.documents.get()
    assert client.get(f"/documents/{document.pk}/").status_code == 200
    assert client.post(f"/documents/{document.pk}/delete").status_code == 403
    assert Document.objects.filter(pk=document.pk).exists()


def test_sharing_names_only_existing_users(alice_client, bob, handbook) -> None:
    with pytest.raises(services.CollectionError, match="No such user: nobody"):
        services.collection_share(collection=handbook, usernames=["nobody"])
    with pytest.raises(services.CollectionError, match="No such user"):  # not a DataError
        services.collection_share(collection=handbook, usernames=["bob\x00"])
    response = alice_client.post(
        f"/documents/collections/{handbook.pk}/share", {"usernames": "ghost"}, follow=True
    )
    assert "No such user: ghost." in response.content.decode()
    assert not handbook.shared_with.exists()


def test_a_documents_page_puts_it_in_the_owners_collections_only(
    client, alice_client, user, mallory
) -> None:
    document = _document(user, "harbour.md")
    notes = services.collection_create(owner=user, name="Notes")
    services.collection_create(owner=user, name="Archive")
    theirs = services.collection_create(owner=mallory, name="Mallory's")
    page = alice_client.get(f"/documents/{document.pk}/").content.decode()
    assert 'id="document-collections"' in page and "Archive" in page
    assert "Mallory&#x27;s" not in page
    alice_client.post(
        f"/documents/{document.pk}/collections", {"collections": [notes.pk, theirs.pk]}
    )
    assert list(document.collections.all()) == [notes]
    alice_client.post(f"/documents/{document.pk}/collections", {})
    assert not document.collections.exists()

    client.force_login(mallory)
    response = client.post(f"/documents/{document.pk}/collections", {"collections": [theirs.pk]})
    assert response.status_code == 404 and not theirs.documents.exists()


def test_a_forged_id_is_dropped_not_a_server_error(alice_client, user, handbook) -> None:
    forged = ["9" * 30, "²", "-1", "x"]
    response = alice_client.post(
        f"/documents/collections/{handbook.pk}/documents", {"documents": forged}
    )
    assert response.status_code == 302 and not handbook.documents.exists()
    conversation = user.conversations.create()
    response = alice_client.post(f"/chat/{conversation.pk}/scope", {"collections": forged})
    assert response.status_code == 302 and conversation.scope.is_everything
