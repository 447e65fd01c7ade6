"""Reads for documents and chunks."""

from __future__ import annotations

from django.contrib.auth.base_user import AbstractBaseUser
from django.db.models import QuerySet

from webapp.documents.models import Chunk, Document


def document_list(*, owner: AbstractBaseUser) -> QuerySet[Document]:
    return Document.objects.filter(owner=owner).order_by("-created_at", "-id")


def document_get(*, owner: AbstractBaseUser, document_id: int) -> Document | None:
    return Document.objects.filter(owner=owner, pk=document_id).first()


def documents_active(documents: QuerySet[Document] | list[Document]) -> bool:
    """Whether any of these documents is still queued or processing (the page polls)."""
    return any(document.is_active for document in documents)


def document_chunks(*, document: Document, limit: int = 200) -> QuerySet[Chunk]:
    return (
        Chunk.objects.filter(document=document)
        .only("id", "document_id", "index", "text", "token_count", "kv_status", "kv_key")
        .order_by("index")[:limit]
    )
