"""What names a chunk on both sides: the content hash of its tokens, and the content address
of its KV (``ChunkKey``). The web app computes the hash when it chunks a document (and for
knowledge-delivery texts) and parses keys to show and delete objects; the engine and the
store key chunk KV by them.

The key: identical token sequences under the same model and prompt head share one object,
whatever document, position or order they come from. A ``scope`` (e.g. ``u42``, one user)
partitions that sharing: the same text uploaded by two users in different scopes has two
objects, so neither can tell from the speed or the tier of an answer that the other uploaded
it (``KV_CACHE_SCOPE`` in the web settings)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote, unquote

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_SCOPE = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")


def token_ids_sha256(token_ids: Sequence[int]) -> str:
    """Content hash of a token sequence (little-endian int32), the chunk's identity."""
    data = b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids)
    return hashlib.sha256(data).hexdigest()


class Addressed(Protocol):
    """What a key is made of (a ``kvservice.chunk.ChunkKV`` is one; this module has no torch)."""

    model_fingerprint: str
    head_hash: str
    tokens_sha256: str


@dataclass(frozen=True)
class ChunkKey:
    model_fingerprint: str
    head_hash: str
    tokens_sha256: str  # hex sha256 of the token ids (token_ids_sha256)
    scope: str = ""  # "" shared by everyone; otherwise whose (see the module doc)

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")
        if not _SHA256_HEX.fullmatch(self.tokens_sha256):
            raise ValueError(
                f"tokens_sha256 must be 64 lowercase hex digits: {self.tokens_sha256!r}"
            )
        if self.scope and not _SCOPE.fullmatch(self.scope):
            raise ValueError(f"a scope is 1-64 of [a-z0-9-]: {self.scope!r}")

    @classmethod
    def for_tokens(
        cls, model_fingerprint: str, head_hash: str, token_ids: Sequence[int], scope: str = ""
    ) -> ChunkKey:
        return cls(model_fingerprint, head_hash, token_ids_sha256(token_ids), scope)

    @classmethod
    def of(cls, chunk: Addressed, scope: str = "") -> ChunkKey:
        return cls(chunk.model_fingerprint, chunk.head_hash, chunk.tokens_sha256, scope)

    def unscoped(self) -> ChunkKey:
        """The same content's key without a scope: what a chunk's own fields say."""
        return ChunkKey(self.model_fingerprint, self.head_hash, self.tokens_sha256)

    def to_string(self) -> str:
        """``<fingerprint>/<head hash>[/<scope>]/<tokens sha256>``, each part percent-encoded,
        so the string is a safe S3 object name and relative file path ("" head hash -> "_")."""
        head = quote(self.head_hash, safe="") if self.head_hash else "_"
        scope = f"{self.scope}/" if self.scope else ""
        return f"{quote(self.model_fingerprint, safe='')}/{head}/{scope}{self.tokens_sha256}"

    @classmethod
    def from_string(cls, text: str) -> ChunkKey:
        parts = text.split("/")
        if len(parts) not in (3, 4):
            raise ValueError(f"not a chunk key: {text!r}")
        fingerprint, head, *scope, sha = parts
        head = "" if head == "_" else unquote(head)
        return cls(unquote(fingerprint), head, sha, scope[0] if scope else "")

    def __str__(self) -> str:
        return self.to_string()
