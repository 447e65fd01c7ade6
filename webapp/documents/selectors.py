"""Reads for documents and chunks."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
from django.db.models import Q, QuerySet
from minio.error import S3Error

from webapp.documents.models import Chunk, Collection, Document
from webapp.storage import object_store

# S3 error codes meaning "no such object" (the S3 gateway and MinIO name it differently).
S3_MISSING = {"NoSuchKey", "NoSuchObject", "ResourceNotFound"}


def document_list(*, owner: AbstractBaseUser) -> QuerySet[Document]:
    return Document.objects.filter(owner=owner).order_by("-created_at", "-id")


def documents_active(documents: QuerySet[Document] | list[Document]) -> bool:
    """Whether any of these documents is still queued or processing (the page polls)."""
    return any(document.is_active for document in documents)


def document_chunks(*, document: Document, limit: int = 200) -> QuerySet[Chunk]:
    return (
        Chunk.objects.filter(document=document)
        .only("id", "document_id", "index", "text", "token_count", "kv_status", "kv_key")
        .order_by("index")[:limit]
    )


def document_original(*, document: Document) -> BinaryIO | None:
    """The stored original file as a stream to read (and close), or None when nothing is
    stored (refused at upload, or the object is gone). Storage being down raises."""
    if not document.object_key:
        return None
    try:
        return object_store().get_object(settings.S3_DOCUMENTS_BUCKET, document.object_key)
    except S3Error as err:
        if err.code in S3_MISSING:
            return None
        raise


# --- collections and what a question may read ------------------------------------------------


@dataclass(frozen=True)
class Scope:
    """What a conversation searches: these collections and documents, or, with none chosen,
    all of the user's own documents (never a shared one unless chosen).

    A scope the user chose stays ``chosen`` when what it named is gone (a collection or
    document deleted drops out of the ids): it then reads nothing, and never widens to
    everything behind the user's back."""

    collection_ids: frozenset[int] = frozenset()
    document_ids: frozenset[int] = frozenset()
    chosen: bool = False

    @classmethod
    def of(
        cls,
        collection_ids: Iterable[int] = (),
        document_ids: Iterable[int] = (),
        *,
        chosen: bool = False,
    ) -> Scope:
        collections, documents = frozenset(collection_ids), frozenset(document_ids)
        return cls(collections, documents, chosen or bool(collections or documents))

    @property
    def is_everything(self) -> bool:
        return not (self.chosen or self.collection_ids or self.document_ids)


EVERYTHING = Scope()


def collections_readable(*, user: AbstractBaseUser) -> QuerySet[Collection]:
    """The user's own collections and those shared with them."""
    readable = Collection.objects.filter(Q(owner=user) | Q(shared_with=user)).values("id")
    return Collection.objects.filter(id__in=readable).select_related("owner")


def collection_get_readable(*, user: AbstractBaseUser, collection_id: int) -> Collection | None:
    return collections_readable(user=user).filter(pk=collection_id).first()


def documents_readable(*, user: AbstractBaseUser) -> QuerySet[Document]:
    """The user's own documents and those of collections shared with them."""
    shared = Document.objects.filter(collections__shared_with=user).values("id")
    return Document.objects.filter(Q(owner=user) | Q(id__in=shared))


def document_get_readable(*, user: AbstractBaseUser, document_id: int) -> Document | None:
    """The document if ``user`` may read it (theirs, or in a collection shared with them), else
    None: the one access rule of a document's own pages. Reading it is not changing it: only
    its owner may (``Document.owner``)."""
    return documents_readable(user=user).select_related("owner").filter(pk=document_id).first()


def collections_sharing(*, document: Document, user: AbstractBaseUser) -> QuerySet[Collection]:
    """The collections through which ``document`` is shared with ``user`` (not its owner)."""
    return document.collections.filter(shared_with=user).order_by("name")


def documents_searchable(
    *, user: AbstractBaseUser, scope: Scope = EVERYTHING
) -> QuerySet[Document]:
    """The documents a question of ``user`` reads within ``scope``. Access is checked here, at
    each question, not only when the scope was chosen: a collection unshared since then, or a
    document taken out of it, is no longer read."""
    if scope.is_everything:
        return Document.objects.filter(owner=user)
    if not scope.collection_ids and not scope.document_ids:  # chosen, and all of it is gone
        return Document.objects.none()
    in_scope = Document.objects.filter(
        Q(collections__in=scope.collection_ids) | Q(id__in=scope.document_ids)
    ).values("id")
    return documents_readable(user=user).filter(id__in=in_scope)


def scope_is_gone(*, user: AbstractBaseUser, scope: Scope) -> bool:
    """Whether ``scope`` was chosen and none of its collections and documents is there for
    ``user`` to read any more (deleted, or no longer shared): its questions read nothing, and
    the user is told to choose another scope."""
    if scope.is_everything:
        return False
    collections = collections_readable(user=user).filter(pk__in=scope.collection_ids)
    documents = documents_readable(user=user).filter(pk__in=scope.document_ids)
    return not collections.exists() and not documents.exists()
