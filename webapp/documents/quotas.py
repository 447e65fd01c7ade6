"""Per-user quotas: how many documents, and how many tokens of text (hence how much KV
cache: every token's KV is stored, ``KV_BYTES_PER_TOKEN`` each). Checked when a file is
uploaded and again once its tokens are known (after chunking); shown on the documents page
and at ``GET /api/v1/usage``. A limit of 0 means unlimited."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db.models import Sum

from webapp.documents.models import Chunk, Document


@dataclass(frozen=True)
class Usage:
    documents: int
    tokens: int
    max_documents: int
    max_tokens: int

    @property
    def kv_bytes(self) -> int:
        return self.tokens * settings.KV_BYTES_PER_TOKEN

    @property
    def max_kv_bytes(self) -> int:
        return self.max_tokens * settings.KV_BYTES_PER_TOKEN

    def to_dict(self) -> dict[str, int]:
        return {"documents": self.documents, "max_documents": self.max_documents,
                "tokens": self.tokens, "max_tokens": self.max_tokens,
                "kv_bytes": self.kv_bytes, "max_kv_bytes": self.max_kv_bytes}  # fmt: skip


def usage_of(owner, *, excluding_document: int | None = None) -> Usage:
    """What ``owner`` uses: documents not refused or failed, and the tokens of their chunks."""
    documents = Document.objects.filter(owner=owner).exclude(status=Document.Status.FAILED)
    chunks = Chunk.objects.filter(document__owner=owner)
    if excluding_document is not None:
        documents = documents.exclude(pk=excluding_document)
        chunks = chunks.exclude(document_id=excluding_document)
    tokens = chunks.aggregate(total=Sum("token_count"))["total"] or 0
    return Usage(documents.count(), tokens, settings.QUOTA_DOCUMENTS, settings.QUOTA_TOKENS)


def upload_refusal(owner) -> str:
    """Why ``owner`` may not add a document now ("" when they may)."""
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
    """Why a document of ``new_tokens`` tokens does not fit ``owner``'s quota ("" if it does)."""
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
        f"Your quota is {usage.max_tokens:,} tokens of text ({usage.max_kv_bytes / 1024**3:.1f} GB "
        f"of KV cache) and you use {usage.tokens:,}; delete documents to make room."
    )
