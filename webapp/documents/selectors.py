"""Reads for documents and chunks."""

from __future__ import annotations

from typing import BinaryIO

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
from django.db.models import QuerySet
from minio.error import S3Error

from webapp.documents.models import Chunk, Document
from webapp.storage import object_store

# S3 error codes meaning "no such object" (the S3 gateway and MinIO name it differently).
S3_MISSING = {"NoSuchKey", "NoSuchObject", "ResourceNotFound"}


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
