"""Per-user quotas: how many documents, and how many tokens of text (hence how much KV
cache: every token's KV is stored). Checked when a file is uploaded and again once its
tokens are known (after chunking); shown on the documents page and at
``GET /api/v1/documents/usage``. A limit of 0 means unlimited.

KV bytes are the bytes actually stored: each distinct object of the user's chunks once, as
its codec wrote it (``Chunk.kv_bytes``), so ``kv_bytes_per_token`` and the compression
ratio to 16 bits (``KV_BYTES_PER_TOKEN``, the model's fp16 bytes a token) are measured, not
assumed. The KV the token quota allows is priced at the measured bytes a token (at fp16's
until anything is stored).

A check and the write it allows are one step: ``hold_quota`` takes the owner's lock in the
caller's transaction, and the check under it sees every write committed before it (30 uploads
at once with room for 20 stored 27 to 30 without it)."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db import connection
from django.db.models import Sum

from webapp.documents.models import Chunk, Document


@dataclass(frozen=True)
class Usage:
    documents: int
    tokens: int
    max_documents: int
    max_tokens: int
    kv_bytes: int = 0  # stored, each object once
    kv_tokens: int = 0  # the tokens those objects hold
    kdn_tokens: int = 0  # of ``tokens``: texts stored through the knowledge delivery API

    @property
    def kv_bytes_per_token(self) -> float | None:
        return self.kv_bytes / self.kv_tokens if self.kv_tokens and self.kv_bytes else None

    @property
    def compression_ratio(self) -> float | None:
        """fp16's bytes for the stored tokens over the bytes stored."""
        per_token = self.kv_bytes_per_token
        return settings.KV_BYTES_PER_TOKEN / per_token if per_token else None

    @property
    def max_kv_bytes(self) -> int:
        per_token = self.kv_bytes_per_token or settings.KV_BYTES_PER_TOKEN
        return round(self.max_tokens * per_token)

    def to_dict(self) -> dict[str, int | float | None]:
        per_token, ratio = self.kv_bytes_per_token, self.compression_ratio
        return {
            "documents": self.documents,
            "max_documents": self.max_documents,
            "tokens": self.tokens,
            "max_tokens": self.max_tokens,
            "kdn_tokens": self.kdn_tokens,
            "kv_bytes": self.kv_bytes,
            "max_kv_bytes": self.max_kv_bytes,
            "kv_bytes_per_token": None if per_token is None else round(per_token, 1),
            "compression_ratio": None if ratio is None else round(ratio, 2),
        }


def stored_kv(chunks) -> tuple[int, int]:
    """(bytes, tokens) of the distinct stored KV objects of ``chunks`` (a Chunk queryset)."""
    objects = {
        key: (nbytes, tokens)
        for key, nbytes, tokens in chunks.exclude(kv_key="")
        .filter(kv_bytes__gt=0)
        .values_list("kv_key", "kv_bytes", "token_count")
    }
    return sum(b for b, _ in objects.values()), sum(t for _, t in objects.values())


def usage_of(owner, *, excluding_document: int | None = None) -> Usage:
    """What ``owner`` uses: documents not refused or failed, the tokens of their chunks, and
    the KV stored for them."""
    documents = Document.objects.filter(owner=owner).exclude(status=Document.Status.FAILED)
    chunks = Chunk.objects.filter(document__owner=owner)
    if excluding_document is not None:
        documents = documents.exclude(pk=excluding_document)
        chunks = chunks.exclude(document_id=excluding_document)
    tokens = chunks.aggregate(total=Sum("token_count"))["total"] or 0
    kv_bytes, kv_tokens = stored_kv(chunks)
    kdn_tokens, kdn_bytes = _kdn_stored(owner, chunks)
    return Usage(
        documents.count(),
        tokens + kdn_tokens,
        settings.QUOTA_DOCUMENTS,
        settings.QUOTA_TOKENS,
        kv_bytes=kv_bytes + kdn_bytes,
        kv_tokens=kv_tokens + kdn_tokens,
        kdn_tokens=kdn_tokens,
    )


def _kdn_stored(owner, chunks) -> tuple[int, int]:
    """(tokens, KV bytes) of the texts ``owner`` stored through the knowledge delivery API
    (``kdn.StoredText``): they hold text and KV as documents do. An object a chunk of theirs
    uses too is counted once, with the chunks."""
    from webapp.kdn.models import StoredText

    rows = StoredText.objects.filter(owner=owner).exclude(
        kv_key__in=chunks.exclude(kv_key="").values("kv_key")
    )
    totals = rows.aggregate(tokens=Sum("token_count"), nbytes=Sum("kv_bytes"))
    return totals["tokens"] or 0, totals["nbytes"] or 0


def hold_quota(owner_id: int) -> None:
    """Hold ``owner_id``'s quota until the caller's transaction ends: who checks it under this
    lock and then writes (a document, a document's chunks) is not overtaken by another who
    checked before that write. A transaction-scoped advisory lock rather than a row lock on
    the user: nothing else that touches the user (a login, a row pointing at them) waits."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [f"quota:{owner_id}"]
        )


def upload_refusal(owner) -> str:
    """Why ``owner`` may not add a document now ("" when they may); final under
    ``hold_quota``."""
    usage = usage_of(owner)
    if usage.max_documents and usage.documents >= usage.max_documents:
        return (
            f"You have reached your quota of {usage.max_documents} documents; delete some to "
            "upload more."
        )
    if usage.max_tokens and usage.tokens >= usage.max_tokens:
        return _token_message(usage)
    return ""


def tokens_refusal(owner, *, document_id: int, new_tokens: int) -> str:
    """Why a document of ``new_tokens`` tokens does not fit ``owner``'s quota ("" if it does);
    final under ``hold_quota``."""
    usage = usage_of(owner, excluding_document=document_id)
    if usage.max_tokens and usage.tokens + new_tokens > usage.max_tokens:
        return (
            f"This document has {new_tokens:,} tokens of text, more than the "
            f"{max(0, usage.max_tokens - usage.tokens):,} left in your quota. "
            + _token_message(usage)
        )
    return ""


def _token_message(usage: Usage) -> str:
    return (
        f"Your quota is {usage.max_tokens:,} tokens of text and you use {usage.tokens:,}; "
        "delete documents to make room."
    )
