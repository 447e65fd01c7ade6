"""What the web side knows of chunk KV, without the engine (no torch): whose scope a chunk's KV
is in, what the inference worker is sent for a chunk, the prompt head chunks are computed
after, and the stored objects as bytes (deleted when nothing names them any more, streamed by
the knowledge delivery API).

Computing and storing KV is the KV worker's (``worker/kv.py``: the LLM and the store's S3
tier); the services that need it take its producer and store as arguments
(``ChunkProducer``, ``ChunkStore``), so this package never loads them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import urllib3.exceptions
from django.conf import settings
from minio.error import MinioException, S3Error

from kvservice.protocol import ChunkRef
from kvservice.protocol.errors import StoreUnavailable
from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.objects import Readable
from kvservice.protocol.prompt import PromptFormat
from webapp.storage import object_store

_MISSING_CODES = {"NoSuchKey", "NoSuchObject", "ResourceNotFound", "NoSuchBucket"}


class ChunkProducer(Protocol):
    """Token ids to chunk KV after the deployment's head (``kvservice.model.producer``)."""

    def key(self, token_ids: Sequence[int], scope: str = "") -> ChunkKey: ...

    def compute(self, token_ids: Sequence[Sequence[int]]) -> list[Any]: ...

    def after(self, head_ids: Sequence[int]) -> ChunkProducer: ...


class ChunkStore(Protocol):
    """Key-level access to the durable KV store (``worker.kv.KVStoreClient``)."""

    def contains(self, key: str) -> bool: ...

    def put(self, chunk: Any, scope: str = "") -> str: ...

    def object_bytes(self, key: str) -> int | None: ...

    def reencode(self, key: str, codec: str, *, write: bool = True) -> Any: ...


def kv_scope_for(owner_id: int) -> str:
    """The KV scope of a user's chunks: their own (``KV_CACHE_SCOPE=user``, the default), or
    "" (``shared``: identical text of different users shares one object; faster, but an
    upload's speed then tells whether someone else uploaded the same text)."""
    return f"u{owner_id}" if settings.KV_CACHE_SCOPE == "user" else ""


def chunk_ref(chunk: Any) -> ChunkRef:
    """A ``Chunk`` as the inference worker reads it (``kvservice.protocol.ChunkRef``): its
    token ids in its owner's KV scope. A passage of a collection shared with the asker was
    cached under its owner's scope, so the asker's own scope would miss it."""
    return ChunkRef(
        chunk_id=chunk.pk,
        token_ids=list(chunk.token_ids),
        kv_scope=kv_scope_for(chunk.document.owner_id),
    )


def prompt_head_ids(tokenizer: Any) -> list[int]:
    """What the deployment computes every chunk after, as the inference worker builds it
    (``kvservice.protocol.prompt.PromptFormat.storage_ids``: the fixed prompt head, and the
    retrieval preamble with ``KV_PREAMBLE=on``); its hash is part of the chunk key, so the
    worker's lookups hit what ingest stores."""
    return list(PromptFormat.for_tokenizer(tokenizer).storage_ids)


# --------------------------------------------------------------------------------------------
# The stored objects, as bytes: the web app's S3 client (webapp.storage, its deadlines) on the
# bucket and prefix the KV store writes to (``KV_S3_BUCKET``, ``KV_S3_PREFIX``)


def kv_object_name(key: str | ChunkKey) -> str:
    """The S3 object name of a chunk key, as the store's S3 tier names it."""
    chunk_key = key if isinstance(key, ChunkKey) else ChunkKey.from_string(key)
    return settings.S3_KV_PREFIX + chunk_key.to_string()


def _unreachable(err: BaseException, what: str) -> StoreUnavailable:
    return StoreUnavailable(f"S3 at {settings.S3_ENDPOINT} unreachable during {what}: {err}")


def delete_kv_object(key: str) -> None:
    """Remove a chunk's KV object (absent already: nothing to do); ``StoreUnavailable`` when
    S3 does not answer within its deadlines, and nothing was deleted."""
    try:
        object_store().remove_object(settings.S3_KV_BUCKET, kv_object_name(key))
    except S3Error as err:
        if err.code not in _MISSING_CODES:
            raise
    except (MinioException, urllib3.exceptions.HTTPError, OSError) as err:
        raise _unreachable(err, "delete") from err


class KVObjectReader:
    """Stored objects read as byte streams (``open_stream``, what
    ``kvservice.protocol.kdn_stream.ObjectStreams`` reads a tier with)."""

    @contextmanager
    def open_stream(self, key: ChunkKey, start: int) -> Iterator[Readable | None]:
        """One GET from ``start`` to the object's end, read by the caller in pieces as the
        body arrives; None where the object is not stored."""
        try:
            response = object_store().get_object(
                settings.S3_KV_BUCKET, kv_object_name(key), offset=start
            )
        except S3Error as err:
            if err.code in _MISSING_CODES:
                yield None
                return
            raise
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as err:
            raise _unreachable(err, "get") from err
        try:
            yield response
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise _unreachable(err, "get body") from err
        finally:
            response.close()
            response.release_conn()
