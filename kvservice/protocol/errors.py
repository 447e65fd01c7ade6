"""Typed faults of the KV store. Callers catch :class:`ChunkUnavailable` to fall back to
recomputing a chunk from its tokens; the subclasses say why. In the protocol (no torch): the
web app reads stored objects too (deletes, the knowledge delivery stream) and says the same."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every store fault."""


class ChunkUnavailable(StoreError):
    """The chunk cannot be served from the store; recompute it from its tokens."""


class ChunkMissing(ChunkUnavailable):
    """No tier holds the chunk."""


class ChunkCorrupt(ChunkUnavailable):
    """The object exists but its bytes fail a check (magic, header or layer checksum)."""


class ChunkTruncated(ChunkCorrupt):
    """The object is shorter than its header says."""


class FingerprintMismatch(ChunkCorrupt):
    """The object was written for another model, prompt head or token sequence."""


class StoreUnavailable(ChunkUnavailable):
    """A backend (S3) could not be reached within its timeouts."""
