"""The content address of a chunk's KV: identical token sequences under the same model and
prompt head share one object, whatever document, position or order they come from."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote, unquote

from kvservice.chunk import ChunkKV, token_ids_sha256

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ChunkKey:
    model_fingerprint: str
    head_hash: str
    tokens_sha256: str  # hex sha256 of the token ids (kvservice.chunk.token_ids_sha256)

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")
        if not _SHA256_HEX.fullmatch(self.tokens_sha256):
            raise ValueError(
                f"tokens_sha256 must be 64 lowercase hex digits: {self.tokens_sha256!r}"
            )

    @classmethod
    def for_tokens(
        cls, model_fingerprint: str, head_hash: str, token_ids: Sequence[int]
    ) -> ChunkKey:
        return cls(model_fingerprint, head_hash, token_ids_sha256(token_ids))

    @classmethod
    def of(cls, chunk: ChunkKV) -> ChunkKey:
        return cls(chunk.model_fingerprint, chunk.head_hash, chunk.tokens_sha256)

    def to_string(self) -> str:
        """``<fingerprint>/<head hash>/<tokens sha256>``, each part percent-encoded, so the
        string is a safe S3 object name and relative file path ("" head hash -> "_")."""
        head = quote(self.head_hash, safe="") if self.head_hash else "_"
        return f"{quote(self.model_fingerprint, safe='')}/{head}/{self.tokens_sha256}"

    @classmethod
    def from_string(cls, text: str) -> ChunkKey:
        parts = text.split("/")
        if len(parts) != 3:
            raise ValueError(f"not a chunk key: {text!r}")
        fingerprint, head, sha = parts
        return cls(unquote(fingerprint), "" if head == "_" else unquote(head), sha)

    def __str__(self) -> str:
        return self.to_string()
