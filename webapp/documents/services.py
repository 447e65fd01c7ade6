"""Writes for documents and chunks (keyword-only, typed). Views and Celery tasks call these;
nothing here knows about HTTP or Celery beyond enqueueing on commit.

Pipeline: ``document_upload`` (web) -> ``document_ingest`` (``ingest`` queue: parse, chunk,
embed, write chunks) -> ``document_precompute_kv`` (``kv`` queue, batches of chunks) -> the
document is ``ready`` once every chunk's KV is in the store.
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import islice
from pathlib import PurePath
from typing import Any

import urllib3.exceptions
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.postgres.search import SearchVector
from django.core.files.uploadedfile import UploadedFile
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone
from minio.error import S3Error

from kvservice.protocol.errors import StoreUnavailable
from webapp import dispatch
from webapp.documents import parsing, quotas
from webapp.documents.kv import ChunkProducer, ChunkStore, delete_kv_object, kv_scope_for
from webapp.documents.models import SEARCH_CONFIG, Chunk, Collection, Document, OrphanObject
from webapp.documents.sandbox import SandboxLimits, parse_isolated
from webapp.documents.selectors import S3_MISSING
from webapp.storage import object_store

log = logging.getLogger(__name__)

Status, Stage = Document.Status, Document.Stage

# Progress milestones: the ingest stages share 0..70 %, the KV step fills 70..100 %.
PROGRESS = {Stage.PARSING: 5, Stage.CHUNKING: 25, Stage.EMBEDDING: 40, Stage.KV: 70}
# Task retries (transient errors) count too, so this sits above the task's max_retries.
MAX_INGEST_ATTEMPTS = 8


class TransientError(RuntimeError):
    """A failure worth retrying (storage or database briefly unreachable)."""


class RetryNotPossible(ValueError):
    """The document cannot be retried (e.g. it was refused at upload, nothing is stored)."""


def _on_commit(fn: Callable[[], object]) -> None:
    transaction.on_commit(fn, robust=True)


# --------------------------------------------------------------------------------------------
# Upload


ORIGINALS_PREFIX = "originals/"
# An original that no document names is removed (``purge_unreferenced_originals``) once it
# is older than this. An upload names what it stored within milliseconds, under the key's lock
# besides; the margin is for what does not take that lock.
UNREFERENCED_ORIGINAL_GRACE = timedelta(minutes=15)


def original_object_key(*, owner_id: int, content_sha256: str) -> str:
    return f"{ORIGINALS_PREFIX}{owner_id}/{content_sha256}"


def _title_from(name: str) -> str:
    stem = PurePath(name).name.strip() or "Untitled"
    return stem[:255]


def _read_upload(uploaded_file: UploadedFile, limit: int) -> tuple[str, int, bytes | None]:
    """sha256, size and (when within the limit) the bytes of an uploaded file."""
    digest = hashlib.sha256()
    size = 0
    buffer = io.BytesIO()
    uploaded_file.seek(0)
    for part in uploaded_file.chunks():
        digest.update(part)
        size += len(part)
        if size <= limit:
            buffer.write(part)
    return digest.hexdigest(), size, (buffer.getvalue() if size <= limit else None)


@dataclass(frozen=True)
class UploadResult:
    document: Document
    # The owner already had this content stored: nothing changed, ``document`` is theirs.
    duplicate: bool = False


class UploadRefused(ValueError):
    """A file refused before anything is stored (empty, too large, of a type we do not read,
    over the quota): no document, no object; the message is for the person uploading."""


def document_upload(*, owner: AbstractBaseUser, uploaded_file: UploadedFile) -> Document:
    """``document_upload_result``'s document (for callers that need not tell a duplicate)."""
    return document_upload_result(owner=owner, uploaded_file=uploaded_file).document


def _detect_or_refuse(*, owner: AbstractBaseUser, name: str, size: int, data: bytes | None) -> str:
    """The detected type of an upload, or ``UploadRefused`` saying why it is not taken."""
    if size == 0 or data is not None and not data.strip():
        raise UploadRefused("The file is empty.")
    if data is None:
        limit = settings.MAX_UPLOAD_BYTES
        raise UploadRefused(
            f"The file is too large ({size / 1048576:.1f} MB); the limit is "
            f"{limit / 1048576:.0f} MB."
        )
    try:
        detected = parsing.detect_type(data, name)
    except parsing.ParseError as err:
        raise UploadRefused(str(err)) from err
    if over_quota := quotas.upload_refusal(owner):
        raise UploadRefused(over_quota)
    return detected


def _store_original(*, key: str, data: bytes, name: str) -> None:
    try:
        object_store().put_object(
            settings.S3_DOCUMENTS_BUCKET,
            key,
            io.BytesIO(data),
            length=len(data),
            content_type="application/octet-stream",
        )
    except (S3Error, urllib3.exceptions.HTTPError, OSError) as err:
        log.exception("could not store the original of %s", name)
        raise TransientError("Storage is unavailable right now; try again shortly.") from err


def document_upload_result(*, owner: AbstractBaseUser, uploaded_file: UploadedFile) -> UploadResult:
    """Store one uploaded file and queue its ingest; ``UploadRefused`` (nothing kept) when
    it is empty, too large, of a type we do not read, or over the owner's quota.

    The same content uploaded twice by one user is one document: the existing one is
    returned, marked ``duplicate`` so the user can be told. (A ``failed`` row without an
    original, left by a refusal from before refusals stored nothing, is taken over.)

    The quota is checked before anything is stored, and again under ``quotas.hold_quota``
    with the row's insert: an upload that a concurrent one took the room of is refused then,
    and its original removed. The original is written under its key's lock
    (``lock_original_key``), so the purges never remove it from under an upload."""
    name = uploaded_file.name or "Untitled"
    sha, size, data = _read_upload(uploaded_file, settings.MAX_UPLOAD_BYTES)
    existing = Document.objects.filter(owner=owner, content_sha256=sha).first()
    if existing is not None and existing.object_key:
        return UploadResult(existing, duplicate=True)
    detected = _detect_or_refuse(owner=owner, name=name, size=size, data=data)
    key = original_object_key(owner_id=owner.pk, content_sha256=sha)
    fields = {
        "title": _title_from(name),
        "original_name": name[:255],
        "detected_type": detected,
        "size_bytes": size,
        "status": Status.QUEUED,
        "stage": Stage.UPLOADED,
        "progress": 0,
        "error_message": "",
        "object_key": key,
        "ingest_attempts": 0,
    }
    try:
        with transaction.atomic():
            lock_original_key(key)
            existing = Document.objects.filter(owner=owner, content_sha256=sha).first()
            if existing is not None and existing.object_key:
                return UploadResult(existing, duplicate=True)  # the same file, sent at once
            _store_original(key=key, data=data, name=name)
            return UploadResult(_insert_within_quota(owner, sha, existing, fields))
    except TransientError:
        # The gateway may still write what it was sent (a frozen one does once it runs
        # again, after this request gave up): recorded, the purge removes it.
        _forget_objects(originals=[key])
        raise


def _insert_within_quota(
    owner: AbstractBaseUser, sha: str, existing: Document | None, fields: dict[str, Any]
) -> Document:
    """The document's row, if the owner's quota still has room once it is held; otherwise
    its original (just stored, named by no row) is removed and the upload refused."""
    quotas.hold_quota(owner.pk)
    if over_quota := quotas.upload_refusal(owner):
        _remove_refused_original(fields["object_key"])
        raise UploadRefused(over_quota)
    if existing is not None:
        Document.objects.filter(pk=existing.pk).update(**fields, updated_at=timezone.now())
        document = Document.objects.get(pk=existing.pk)
    else:
        document = Document.objects.create(owner=owner, content_sha256=sha, **fields)
    _enqueue_ingest(document.pk)
    return document


def _remove_refused_original(key: str) -> None:
    try:
        object_store().remove_object(settings.S3_DOCUMENTS_BUCKET, key)
    except (S3Error, urllib3.exceptions.HTTPError, OSError) as err:
        # Left to the purge of unreferenced originals.
        log.warning("could not remove the refused original %s: %s", key, err)


def _enqueue_ingest(document_id: int) -> None:
    dispatch.ingest_on_commit(document_id)


# --------------------------------------------------------------------------------------------
# Status


def _update(document_id: int, **fields: object) -> int:
    return Document.objects.filter(pk=document_id).update(**fields, updated_at=timezone.now())


def document_fail(*, document_id: int, message: str, stage: str | None = None) -> None:
    """Mark a document failed with a message for its owner (chunks already written stay)."""
    fields: dict[str, object] = {"status": Status.FAILED, "error_message": message[:2000]}
    if stage:
        fields["stage"] = stage
    _update(document_id, **fields)


def document_retry(*, document: Document) -> Document:
    """Queue a failed document again from its stored original, if the owner's quota has
    room for it (a failed document does not count; retried, it does again)."""
    if document.status != Status.FAILED:
        return document
    if not document.object_key:
        raise RetryNotPossible("This file was refused at upload; upload a corrected file instead.")
    with transaction.atomic():
        quotas.hold_quota(document.owner_id)
        if over_quota := quotas.upload_refusal(document.owner_id):
            raise RetryNotPossible(over_quota)
        _update(
            document.pk,
            status=Status.QUEUED,
            stage=Stage.UPLOADED,
            progress=0,
            error_message="",
            ingest_attempts=0,
        )
        Chunk.objects.filter(document=document, kv_status=Chunk.KVStatus.FAILED).update(
            kv_status=Chunk.KVStatus.PENDING, kv_error=""
        )
        _enqueue_ingest(document.pk)
    document.refresh_from_db()
    return document


# --------------------------------------------------------------------------------------------
# Ingest


def _read_original(key: str) -> bytes:
    try:
        response = object_store().get_object(settings.S3_DOCUMENTS_BUCKET, key)
        try:
            return response.read()
        finally:
            response.close()
            response.release_conn()
    except S3Error as err:
        if err.code in S3_MISSING:
            raise parsing.ParseError(
                "The uploaded file is missing from storage; upload it again."
            ) from err
        raise TransientError(f"object store error reading {key}: {err.code}") from err
    except (urllib3.exceptions.HTTPError, OSError) as err:
        raise TransientError(f"object store unreachable reading {key}: {err}") from err


def _claim(document_id: int) -> Document | None:
    """Move a queued/processing document to processing; None when there is nothing to do
    (deleted, already ready, or failed and not retried): a redelivered task is a no-op."""
    with transaction.atomic():
        document = Document.objects.select_for_update().filter(pk=document_id).first()
        if document is None or document.status not in (Status.QUEUED, Status.PROCESSING):
            return None
        document.ingest_attempts += 1
        if document.ingest_attempts > MAX_INGEST_ATTEMPTS:
            document.status = Status.FAILED
            document.error_message = (
                "Processing this file stopped the worker several times; it may be too large "
                "or malformed."
            )
            document.save(
                update_fields=["status", "error_message", "ingest_attempts", "updated_at"]
            )
            return None
        document.status = Status.PROCESSING
        document.stage = Stage.PARSING
        document.progress = PROGRESS[Stage.PARSING]
        document.error_message = ""
        document.save(
            update_fields=[
                "status",
                "stage",
                "progress",
                "error_message",
                "ingest_attempts",
                "updated_at",
            ]
        )
        return document


def document_ingest(*, document_id: int) -> None:
    """Parse, chunk, embed and write a document's chunks, then queue their KV precompute.

    Idempotent: a rerun replaces the document's chunks (never duplicates them); chunks whose
    tokens did not change keep their KV key, so their stored KV is found, not recomputed.
    Bad input ends the document in ``failed`` with a message; transient storage errors raise
    ``TransientError`` for the task to retry."""
    from webapp.documents.embeddings import embed_texts

    document = _claim(document_id)
    if document is None:
        return
    try:
        chunks = _parse_and_chunk(document)
    except parsing.ParseError as err:
        document_fail(document_id=document_id, message=str(err))
        return
    _update(document_id, stage=Stage.EMBEDDING, progress=PROGRESS[Stage.EMBEDDING])
    vectors = embed_texts([c.text for c in chunks])
    _write_chunks(document_id, chunks, vectors, owner_id=document.owner_id)


def _parse_and_chunk(document: Document) -> list[Any]:
    """The document's text in a sandboxed parser, cut into chunks within the owner's
    quota; ``ParseError`` for what it cannot read or hold."""
    from webapp.documents.chunking import chunk_text, llm_tokenizer

    limits = parsing.DocxLimits(
        max_uncompressed_bytes=settings.DOCX_MAX_UNCOMPRESSED_BYTES,
        max_compression_ratio=settings.DOCX_MAX_COMPRESSION_RATIO,
    )
    parsed = parse_isolated(
        _read_original(document.object_key),
        document.detected_type,
        docx_limits=limits,
        limits=SandboxLimits(
            memory_bytes=settings.PARSE_MAX_MEMORY_MB * 1024**2,
            cpu_seconds=settings.PARSE_TIMEOUT_S,
        ),
    )
    _update(document.pk, stage=Stage.CHUNKING, progress=PROGRESS[Stage.CHUNKING])
    chunks = chunk_text(parsed.text, tokenizer=llm_tokenizer(), max_tokens=settings.CHUNK_TOKENS)
    if not chunks:
        raise parsing.ParseError("No text found in this file.")
    tokens = sum(c.token_count for c in chunks)
    over = quotas.tokens_refusal(document.owner_id, document_id=document.pk, new_tokens=tokens)
    if over:
        raise parsing.ParseError(over)
    return chunks


def _write_chunks(
    document_id: int, chunks: list[Any], vectors: list[Any], *, owner_id: int
) -> None:
    """Replace the document's chunks with these, keeping the KV keys of chunks whose tokens
    are unchanged (a retry, a re-ingest), and queue the KV step; objects no chunk names any
    more are forgotten and purged. The owner's token quota is checked again with the write
    (documents ingested at once each found room for themselves alone)."""
    with transaction.atomic():
        quotas.hold_quota(owner_id)  # before the row's lock: every writer takes them so
        locked = Document.objects.select_for_update().filter(pk=document_id).first()
        if locked is None or locked.status != Status.PROCESSING:
            return  # deleted (or reset) while we worked
        tokens = sum(chunk.token_count for chunk in chunks)
        if over := quotas.tokens_refusal(owner_id, document_id=document_id, new_tokens=tokens):
            document_fail(document_id=document_id, message=over)
            return
        previous = {
            sha: key
            for sha, key in Chunk.objects.select_for_update()
            .filter(document_id=document_id)
            .values_list("token_ids_sha256", "kv_key")
            if key
        }
        Chunk.objects.filter(document_id=document_id).delete()
        rows = Chunk.objects.bulk_create(
            Chunk(
                document_id=document_id,
                index=chunk.index,
                text=chunk.text,
                token_ids=chunk.token_ids,
                token_count=chunk.token_count,
                token_ids_sha256=chunk.token_ids_sha256,
                embedding=vector,
                kv_key=previous.get(chunk.token_ids_sha256, ""),
                kv_status=Chunk.KVStatus.PENDING,
            )
            for chunk, vector in zip(chunks, vectors, strict=True)
        )
        Chunk.objects.filter(document_id=document_id).update(
            search_vector=SearchVector("text", config=SEARCH_CONFIG)
        )
        _update(document_id, stage=Stage.KV, progress=PROGRESS[Stage.KV])
        dropped = set(previous.values()) - {row.kv_key for row in rows}
        _enqueue_precompute([row.pk for row in rows])
        forgotten = _forget_objects(kv_keys=dropped)
        if forgotten:
            _on_commit(lambda: purge_orphan_objects(keys=forgotten))


def _enqueue_precompute(chunk_ids: Sequence[int]) -> None:
    dispatch.precompute_on_commit(chunk_ids)


# --------------------------------------------------------------------------------------------
# KV precompute


def _lock_object(key: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [key])


def lock_kv_key(key: str) -> None:
    """Serialize everything that decides a KV object's fate (store it and point a chunk at
    it, or find it unreferenced and delete it) on one transaction-scoped advisory lock."""
    _lock_object(key)


def lock_original_key(key: str) -> None:
    """The same for an original: an upload holds it from storing the object to committing
    the row that names it, a purge while it finds the object unreferenced and removes it."""
    _lock_object(key)


def document_precompute_kv(
    *,
    chunk_ids: Sequence[int] | None = None,
    document_id: int | None = None,
    producer: ChunkProducer,
    store: ChunkStore,
) -> None:
    """Compute and store the KV of these chunks (or of all of a document's chunks), skipping
    any the store already holds; mark them ready and finish their documents. Store outages
    raise ``TransientError``. ``producer`` and ``store``: the KV worker's (``worker/kv.py``)."""
    if (chunk_ids is None) == (document_id is None):
        raise ValueError("pass exactly one of chunk_ids and document_id")
    if chunk_ids is None:
        chunk_ids = list(
            Chunk.objects.filter(document_id=document_id)
            .order_by("index")
            .values_list("pk", flat=True)
        )
    chunks = list(
        Chunk.objects.filter(pk__in=chunk_ids, document__status=Status.PROCESSING)
        .exclude(kv_status=Chunk.KVStatus.READY)
        .only("id", "document_id", "token_ids", "kv_key")
    )
    if not chunks:
        _finish_documents(
            set(Chunk.objects.filter(pk__in=chunk_ids).values_list("document_id", flat=True))
        )
        return
    owners = dict(
        Document.objects.filter(pk__in={c.document_id for c in chunks}).values_list(
            "pk", "owner_id"
        )
    )
    scopes = {chunk.pk: kv_scope_for(owners[chunk.document_id]) for chunk in chunks}
    keys = {c.pk: producer.key(c.token_ids, scopes[c.pk]).to_string() for c in chunks}
    try:
        _store_chunks_kv(chunks, keys, scopes, producer, store)
    except TransientError:
        raise
    except Exception as err:
        if _is_store_unavailable(err):
            raise TransientError(f"KV store unavailable: {err}") from err
        raise
    _finish_documents({chunk.document_id for chunk in chunks})


def _store_chunks_kv(
    chunks, keys: dict, scopes: dict, producer: ChunkProducer, store: ChunkStore
) -> None:
    """Compute what the store lacks, in one batch, then store and mark each chunk under the
    lock of its key (``lock_kv_key``), skipping a chunk deleted or re-ingested meanwhile."""
    missing = [chunk for chunk in chunks if not store.contains(keys[chunk.pk])]
    computed = dict(
        zip((c.pk for c in missing), producer.compute([c.token_ids for c in missing]), strict=True)
    )
    for chunk in chunks:
        key = keys[chunk.pk]
        with transaction.atomic():
            lock_kv_key(key)
            # The row lock orders this against a delete or re-ingest of the document.
            if not list(Chunk.objects.select_for_update().filter(pk=chunk.pk).values_list("pk")):
                continue  # its document was deleted or re-ingested meanwhile
            kv = computed.get(chunk.pk)
            if kv is None and not store.contains(key):  # deleted since we looked
                kv = producer.compute([chunk.token_ids])[0]
            if kv is not None:
                stored_key = store.put(kv, scopes[chunk.pk])
                assert stored_key == key, (stored_key, key)
            Chunk.objects.filter(pk=chunk.pk).update(
                kv_key=key,
                kv_status=Chunk.KVStatus.READY,
                kv_error="",
                kv_bytes=store.object_bytes(key) or 0,
            )


def kv_object_reencode(*, key: str, codec: str, store: ChunkStore, write: bool = True):
    """Store one KV object again in ``codec`` (``KVStoreClient.reencode``) and record its new
    size on the chunks that use it. Under the key's advisory lock, so a delete or a fresh
    precompute of the same key waits; an object no chunk uses any more is left to the purge.
    Returns the ``Reencoded`` outcome, or None when nothing is stored under ``key``."""
    with transaction.atomic():
        lock_kv_key(key)
        if not Chunk.objects.filter(kv_key=key).exists():
            return None
        outcome = store.reencode(key, codec, write=write)
        if outcome is not None and write:
            Chunk.objects.filter(kv_key=key).update(kv_bytes=outcome.bytes_after)
    return outcome


def _is_store_unavailable(err: BaseException) -> bool:
    return isinstance(err, StoreUnavailable | urllib3.exceptions.HTTPError | ConnectionError)


def document_fail_kv(*, chunk_ids: Sequence[int], message: str) -> None:
    """The KV step gave up on these chunks: mark them, and fail their documents."""
    Chunk.objects.filter(pk__in=chunk_ids).exclude(kv_status=Chunk.KVStatus.READY).update(
        kv_status=Chunk.KVStatus.FAILED, kv_error=message[:2000]
    )
    for document_id in set(
        Chunk.objects.filter(pk__in=chunk_ids).values_list("document_id", flat=True)
    ):
        document_fail(
            document_id=document_id, message=f"Could not precompute the KV cache: {message}"
        )


def _finish_documents(document_ids: Iterable[int]) -> None:
    """Update the KV progress of documents; ``ready`` once every chunk's KV is stored."""
    for document_id in document_ids:
        with transaction.atomic():
            document = Document.objects.select_for_update().filter(pk=document_id).first()
            if document is None or document.status != Status.PROCESSING:
                continue
            total = document.chunks.count()
            ready = document.chunks.filter(kv_status=Chunk.KVStatus.READY).count()
            if total and ready == total:
                _update(
                    document_id,
                    status=Status.READY,
                    stage=Stage.DONE,
                    progress=100,
                    ready_at=timezone.now(),
                )
            else:
                base = PROGRESS[Stage.KV]
                _update(document_id, progress=base + (100 - base) * ready // max(total, 1))


# --------------------------------------------------------------------------------------------
# Delete


def _forget_objects(*, originals: Iterable[str] = (), kv_keys: Iterable[str] = ()) -> list[str]:
    """Record S3 objects no longer needed, in the caller's transaction; returns their keys,
    for the caller to purge once its change is committed (``purge_orphan_objects`` also runs
    periodically for what S3 did not take: nothing leaks while S3 is down)."""
    rows = [OrphanObject(kind=OrphanObject.Kind.ORIGINAL, key=k) for k in originals if k]
    rows += [OrphanObject(kind=OrphanObject.Kind.KV, key=k) for k in sorted(set(kv_keys)) if k]
    OrphanObject.objects.bulk_create(rows, ignore_conflicts=True)
    return [row.key for row in rows]


def kv_key_in_use(key: str) -> bool:
    """Whether a chunk or a text stored through the knowledge delivery API names ``key``."""
    from webapp.kdn.models import StoredText  # the KDN app builds on this one

    return (
        Chunk.objects.filter(kv_key=key).exists() or StoredText.objects.filter(kv_key=key).exists()
    )


def _remove_object(orphan: OrphanObject) -> None:
    if orphan.kind == OrphanObject.Kind.KV:
        delete_kv_object(orphan.key)
    else:
        object_store().remove_object(settings.S3_DOCUMENTS_BUCKET, orphan.key)


def purge_orphan_objects(*, keys: Iterable[str] | None = None, limit: int = 500) -> int:
    """Delete recorded orphan objects from S3, unless a chunk or document references them
    again (content-addressed objects are shared: each KV key is decided under its advisory
    lock, see ``document_precompute_kv``). Returns how many were settled; stops at the first
    failure (S3 down: the rest waits for the next run)."""
    orphans = OrphanObject.objects.order_by("id")
    if keys is not None:
        orphans = orphans.filter(key__in=list(keys))
    settled = 0
    for orphan in orphans[:limit]:
        try:
            with transaction.atomic():
                if orphan.kind == OrphanObject.Kind.KV:
                    lock_kv_key(orphan.key)
                    in_use = kv_key_in_use(orphan.key)
                else:
                    lock_original_key(orphan.key)
                    in_use = Document.objects.filter(object_key=orphan.key).exists()
                if not in_use:
                    _remove_object(orphan)
                OrphanObject.objects.filter(pk=orphan.pk).delete()
            settled += 1
        except Exception as err:  # noqa: BLE001 - kept for the next run, with the reason
            log.warning("could not delete %s (kept for a later try): %s", orphan, err)
            OrphanObject.objects.filter(pk=orphan.pk).update(
                attempts=F("attempts") + 1, last_error=str(err)[:1000]
            )
            break
    return settled


def purge_unreferenced_originals(
    *, grace: timedelta = UNREFERENCED_ORIGINAL_GRACE, limit: int = 500
) -> int:
    """Remove the originals in the bucket that no document names, written more than
    ``grace`` ago: what an upload refused or failed after its object was written left (a
    gateway that stopped answering writes what it was sent once it runs again, after the
    upload gave up), whether or not an ``OrphanObject`` recorded it. Returns how many were
    removed; stops at the first failure (S3 down: the rest waits for the next run)."""
    removed = 0
    try:
        for keys in _batches(_originals_written_before(timezone.now() - grace), 500):
            named = set(
                Document.objects.filter(object_key__in=keys).values_list("object_key", flat=True)
            )
            for key in (key for key in keys if key not in named):
                if removed >= limit:
                    return removed
                removed += _remove_unreferenced_original(key)
    except (S3Error, urllib3.exceptions.HTTPError, OSError) as err:
        log.warning("the purge of unreferenced originals stopped (next run goes on): %s", err)
    return removed


def _originals_written_before(cutoff: datetime) -> Iterator[str]:
    listed = object_store().list_objects(
        settings.S3_DOCUMENTS_BUCKET, prefix=ORIGINALS_PREFIX, recursive=True
    )
    for item in listed:
        if item.last_modified is not None and item.last_modified < cutoff:
            yield item.object_name


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch


def _remove_unreferenced_original(key: str) -> int:
    """Remove ``key`` unless a document names it by now (an upload stores and names it under
    the same lock, so none is between the two here); 1 if removed."""
    with transaction.atomic():
        lock_original_key(key)
        if Document.objects.filter(object_key=key).exists():
            return 0
        object_store().remove_object(settings.S3_DOCUMENTS_BUCKET, key)
    return 1


def document_delete(*, document: Document) -> None:
    """Delete a document, its chunks, its original, and every KV object that no remaining
    chunk references (identical chunks of other documents keep theirs)."""
    document_id, object_key = document.pk, document.object_key
    with transaction.atomic():
        # Row locks: a KV task storing one of these chunks right now finishes first, so its
        # key is seen here (and one that comes later finds the chunk gone and stores nothing).
        kv_keys = {
            key
            for key in Chunk.objects.select_for_update()
            .filter(document_id=document_id)
            .values_list("kv_key", flat=True)
            if key
        }
        Document.objects.filter(pk=document_id).delete()  # cascades to the chunks
        shared = object_key and Document.objects.filter(object_key=object_key).exists()
        forgotten = _forget_objects(originals=[] if shared else [object_key], kv_keys=kv_keys)
    purge_orphan_objects(keys=forgotten)  # what S3 does not take now is retried later


# --------------------------------------------------------------------------------------------
# Rename (the caller checks that the user owns the document)

TITLE_MAX_CHARS = Document._meta.get_field("title").max_length


class RenameRefused(ValueError):
    """A name a document cannot take (shown to the user as is)."""


def document_rename(*, document: Document, title: str) -> Document:
    """Give the document a new name (its title; runs of spaces become one);
    ``RenameRefused`` for an empty or too long one."""
    title = " ".join(title.split())
    if not title:
        raise RenameRefused("Give the document a name.")
    if len(title) > TITLE_MAX_CHARS:
        raise RenameRefused(
            f"A document's name can be at most {TITLE_MAX_CHARS} characters; this one has "
            f"{len(title)}."
        )
    _update(document.pk, title=title)
    document.refresh_from_db(fields=["title", "updated_at"])
    return document


# --------------------------------------------------------------------------------------------
# Collections (the caller checks that the user owns the collection; these check the rest)


class CollectionError(ValueError):
    """A collection change the user can fix (shown to them as is)."""


def _collection_name(owner: AbstractBaseUser, name: str, *, renaming: int | None = None) -> str:
    name = " ".join(name.split())[:100]
    if not name:
        raise CollectionError("Give the collection a name.")
    taken = owner.collections.filter(name=name).exclude(pk=renaming)  # type: ignore[attr-defined]
    if taken.exists():
        raise CollectionError(f"You already have a collection named “{name}”.")
    return name


def collection_create(*, owner: AbstractBaseUser, name: str) -> Collection:
    return Collection.objects.create(owner=owner, name=_collection_name(owner, name))


def collection_rename(*, collection: Collection, name: str) -> Collection:
    collection.name = _collection_name(collection.owner, name, renaming=collection.pk)
    collection.save(update_fields=["name", "updated_at"])
    return collection


def collection_delete(*, collection: Collection) -> None:
    """The collection goes; its documents stay (conversations scoped to it lose it, and one
    scoped to it alone then searches nothing: chat.models.Conversation.scope_chosen)."""
    collection.delete()


def collection_set_documents(*, collection: Collection, document_ids: Iterable[int]) -> None:
    """The collection holds exactly these of its owner's documents (other ids are ignored)."""
    owned = Document.objects.filter(owner_id=collection.owner_id, pk__in=list(document_ids))
    collection.documents.set(owned)
    collection.save(update_fields=["updated_at"])


def document_set_collections(*, document: Document, collection_ids: Iterable[int]) -> None:
    """The document is in exactly these of its owner's collections (other ids are ignored)."""
    owned = Collection.objects.filter(owner_id=document.owner_id, pk__in=list(collection_ids))
    document.collections.set(owned)


def collection_share(*, collection: Collection, usernames: Iterable[str]) -> list[str]:
    """Share the collection read-only with exactly these users (by username; the owner and
    blanks are left out). Returns the usernames shared with; an unknown one is an error."""
    wanted = {name.strip() for name in usernames if name.strip()}
    wanted.discard(collection.owner.get_username())
    # A name with a NUL is nobody's (PostgreSQL's text cannot hold one): unknown, not a 500.
    possible = {name for name in wanted if "\x00" not in name}
    users = list(get_user_model().objects.filter(username__in=possible, is_active=True))
    unknown = wanted - {user.get_username() for user in users}
    if unknown:
        raise CollectionError(f"No such user: {', '.join(sorted(unknown))}.")
    collection.shared_with.set(users)
    return sorted(user.get_username() for user in users)
