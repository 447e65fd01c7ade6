"""Documents and their chunks.

A ``Document`` is one uploaded file (its original kept in the ``documents`` bucket); its
``Chunk`` rows carry the text, the exact LLM token ids the KV cache was computed for, the
MiniLM embedding (pgvector, HNSW cosine index) and a full-text vector (GIN index).
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import GinIndex
from django.contrib.postgres.search import SearchVectorField
from django.db import models
from pgvector.django import HnswIndex, VectorField

EMBEDDING_DIM = 384  # all-MiniLM-L6-v2; settings.EMBEDDING_DIM must agree (checked at embed)
# The text search configuration of Chunk.search_vector (written at ingest) and of the
# questions searched against it (webapp/chat/retrieval.py): both must stem alike.
SEARCH_CONFIG = "english"


class Document(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        PROCESSING = "processing", "Processing"
        READY = "ready", "Ready"
        FAILED = "failed", "Failed"

    class Stage(models.TextChoices):
        UPLOADED = "uploaded", "Uploaded"
        PARSING = "parsing", "Reading the file"
        CHUNKING = "chunking", "Splitting it into passages"
        EMBEDDING = "embedding", "Indexing it for search"
        KV = "kv", "Preparing it for fast answers"
        DONE = "done", "Done"

    class Type(models.TextChoices):
        PDF = "pdf", "PDF"
        DOCX = "docx", "Word"
        HTML = "html", "HTML"
        MARKDOWN = "markdown", "Markdown"
        TEXT = "text", "Text"
        UNKNOWN = "unknown", "Unknown"

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="documents"
    )
    title = models.CharField(max_length=255)
    original_name = models.CharField(max_length=255, blank=True)
    # Key of the original in settings.S3_DOCUMENTS_BUCKET; empty only on a row an upload refusal
    # left before refusals stored nothing (services.UploadRefused).
    object_key = models.CharField(max_length=512, blank=True)
    content_sha256 = models.CharField(max_length=64)
    detected_type = models.CharField(max_length=16, choices=Type.choices, default=Type.UNKNOWN)
    size_bytes = models.BigIntegerField(default=0)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    stage = models.CharField(max_length=16, choices=Stage.choices, default=Stage.UPLOADED)
    progress = models.PositiveSmallIntegerField(default=0)  # 0..100
    error_message = models.TextField(blank=True)
    # Ingest runs started since the last upload/retry: a file that kills the worker process
    # (redelivered each time) is given up on instead of looping forever.
    ingest_attempts = models.PositiveSmallIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    ready_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "content_sha256"], name="document_unique_owner_content"
            ),
            models.CheckConstraint(
                condition=models.Q(progress__gte=0, progress__lte=100),
                name="document_progress_0_100",
            ),
        ]
        indexes = [models.Index(fields=["owner", "status"])]

    def __str__(self) -> str:
        return self.title

    @property
    def is_active(self) -> bool:
        return self.status in (self.Status.QUEUED, self.Status.PROCESSING)

    @property
    def can_retry(self) -> bool:
        return self.status == self.Status.FAILED and bool(self.object_key)


class Chunk(models.Model):
    class KVStatus(models.TextChoices):
        PENDING = "pending", "Pending"
        READY = "ready", "Ready"
        FAILED = "failed", "Failed"

    document = models.ForeignKey(Document, on_delete=models.CASCADE, related_name="chunks")
    index = models.PositiveIntegerField()
    text = models.TextField()
    # The LLM token ids of ``text`` tokenized on its own (no special tokens): the KV cache is
    # computed for exactly these ids, and the prompt at query time must use exactly them.
    token_ids = ArrayField(models.IntegerField())
    token_count = models.PositiveIntegerField()
    token_ids_sha256 = models.CharField(max_length=64, db_index=True)
    embedding = VectorField(dimensions=EMBEDDING_DIM, null=True, blank=True)
    search_vector = SearchVectorField(null=True, blank=True)
    kv_status = models.CharField(max_length=16, choices=KVStatus.choices, default=KVStatus.PENDING)
    # kvservice.protocol.keys.ChunkKey.to_string(); content-addressed, so shared between chunks.
    kv_key = models.CharField(max_length=255, blank=True, db_index=True)
    # Bytes of that object as stored (its codec's, kvservice.store.codec; a HEAD of S3 after
    # it is written); 0 until then. Quotas, the usage API and the dashboard add these up.
    kv_bytes = models.PositiveBigIntegerField(default=0)
    kv_error = models.TextField(blank=True)

    class Meta:
        ordering = ["document", "index"]
        constraints = [
            models.UniqueConstraint(fields=["document", "index"], name="chunk_unique_index"),
        ]
        indexes = [
            HnswIndex(
                name="chunk_embedding_hnsw",
                fields=["embedding"],
                m=16,
                ef_construction=64,
                opclasses=["vector_cosine_ops"],
            ),
            GinIndex(fields=["search_vector"], name="chunk_search_gin"),
        ]

    def __str__(self) -> str:
        return f"{self.document_id}#{self.index}"


class Collection(models.Model):
    """A named group of one owner's documents (a document may be in several). The owner may
    share it read-only with named users: they retrieve from its documents and read their
    passages in citations, and never change or delete anything."""

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="collections"
    )
    name = models.CharField(max_length=100)
    documents = models.ManyToManyField(Document, related_name="collections", blank=True)
    shared_with = models.ManyToManyField(
        settings.AUTH_USER_MODEL, related_name="shared_collections", blank=True
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name", "id"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "name"], name="collection_unique_owner_name")
        ]

    def __str__(self) -> str:
        return self.name


class OrphanObject(models.Model):
    """An object in S3 that a deleted document (or a re-chunked one) no longer needs. Rows are
    written in the same transaction as the delete, so nothing is forgotten when S3 is down;
    ``services.purge_orphan_objects`` removes the object (at once, then periodically) unless
    something references it again, and deletes the row."""

    class Kind(models.TextChoices):
        ORIGINAL = "original", "uploaded original"
        KV = "kv", "chunk KV cache"

    kind = models.CharField(max_length=16, choices=Kind.choices)
    key = models.CharField(max_length=1024)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["kind", "key"], name="orphan_unique_key")]

    def __str__(self) -> str:
        return f"{self.kind}:{self.key}"
