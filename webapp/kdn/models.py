"""What a user stored through the knowledge delivery API (``PUT /kdn/v1/kv``).

One row per (user, text's tokens, prompt head): the chunk key its KV is stored under (in the
user's KV scope), its tokens and the bytes stored. A fetch finds a text's object only through
its caller's rows, so one user never reads another's KV, and the rows count against the
user's token quota as documents' chunks do."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class StoredText(models.Model):
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="kdn_texts"
    )
    tokens_sha256 = models.CharField(max_length=64)  # kvservice.chunk.token_ids_sha256
    head_hash = models.CharField(max_length=64)  # the prompt head's, as in the chunk key
    kv_key = models.CharField(max_length=400)
    token_count = models.PositiveIntegerField()
    kv_bytes = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "tokens_sha256", "head_hash"], name="kdn_text_once_per_owner"
            )
        ]

    def __str__(self) -> str:
        return f"{self.owner_id}:{self.kv_key}"
