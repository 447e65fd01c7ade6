"""What names a chunk on both sides: the content hash of its tokens. The web app computes it
when it chunks a document (and for knowledge-delivery texts); the engine and the store key
chunk KV by it (``kvservice.chunk``, ``kvservice.store.keys``)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def token_ids_sha256(token_ids: Sequence[int]) -> str:
    """Content hash of a token sequence (little-endian int32), the chunk's identity."""
    data = b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids)
    return hashlib.sha256(data).hexdigest()
