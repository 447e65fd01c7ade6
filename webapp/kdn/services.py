"""The knowledge delivery API's work: a text to its chunk tokens and key, storing its KV
through the KV workers, and finding what a user stored.

A text maps to chunk tokens exactly as ingest's chunks do (the LLM's tokenizer, no special
tokens: ``kvservice.protocol.prompt.chunk_token_ids``) and its KV is computed after a prompt
head, the deployment's unless the caller names one (``head``, its text): the key is then
``ChunkKey.for_tokens(model fingerprint, head hash, tokens, the caller's KV scope)``. The web
process has the tokenizer but not the model, so the key (which holds the model's fingerprint)
is made by the KV worker that computes or finds the object, and recorded here
(``StoredText``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery.exceptions import TimeoutError as CeleryTimeout
from django.conf import settings
from django.db import transaction
from django.db.models import Case, When

from kvservice.protocol import token_ids_sha256
from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.prompt import chunk_token_ids
from webapp import dispatch
from webapp.documents import quotas
from webapp.documents.chunking import llm_tokenizer
from webapp.documents.embeddings import embedder
from webapp.documents.kv import (
    ChunkProducer,
    ChunkStore,
    delete_kv_object,
    kv_scope_for,
    prompt_head_ids,
)
from webapp.documents.models import Chunk
from webapp.documents.selectors import documents_readable
from webapp.kdn.models import StoredText


class KdnRefused(ValueError):
    """The request is over a limit (``code`` says which; a 400) or the quota (413)."""

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code, self.status = code, status


class StillComputing(RuntimeError):
    """The KV worker has not finished within ``KDN_PUT_WAIT_S``; the PUT may be repeated."""


class NotStored(LookupError):
    def __init__(self, index: int) -> None:
        super().__init__(
            f"texts[{index}] is not stored in your KV scope: store it with PUT /kdn/v1/kv first"
        )
        self.index = index


class NotYours(LookupError):
    """A DELETE of a text the caller did not store (another user's is not theirs)."""


@dataclass(frozen=True)
class Tokenized:
    token_ids: list[int]
    head_ids: list[int]

    @property
    def head_hash(self) -> str:
        return token_ids_sha256(self.head_ids)


def _tokenizer() -> Any:
    """The LLM's tokenizer, once the embedder is loaded: the web server loads that in a
    thread at start (webapp/asgi.py), and transformers imported from two threads at once
    fails ("cannot import name 'AutoTokenizer'", seen on a PUT just after a start)."""
    embedder()
    return llm_tokenizer()


def _tokenize(text: str, what: str) -> list[int]:
    if len(text) > settings.KDN_MAX_TEXT_CHARS:
        raise KdnRefused(
            "text_too_long",
            f"{what} has {len(text):,} characters; the limit is {settings.KDN_MAX_TEXT_CHARS:,}.",
        )
    ids = chunk_token_ids(_tokenizer(), text)
    if len(ids) > settings.KDN_MAX_TEXT_TOKENS:
        raise KdnRefused(
            "text_too_long",
            f"{what} has {len(ids):,} tokens; the limit is {settings.KDN_MAX_TEXT_TOKENS:,}.",
        )
    if not ids:
        raise KdnRefused("empty_text", f"{what} has no tokens.")
    return ids


def _head_ids(head: str | None) -> list[int]:
    """What the deployment computes chunks after (its prompt head, and the retrieval preamble
    with ``KV_PREAMBLE=on``), or the head named (its text, tokenized as a whole)."""
    if head is None:
        return prompt_head_ids(_tokenizer())
    return _tokenize(head, "head")


def tokenize(texts: Sequence[str], head: str | None) -> list[Tokenized]:
    """Each text's chunk tokens after the head; a clear 400 (``KdnRefused``) over a limit."""
    if len(texts) > settings.KDN_MAX_TEXTS:
        raise KdnRefused(
            "too_many_texts", f"{len(texts)} texts; at most {settings.KDN_MAX_TEXTS} per request."
        )
    head_ids = _head_ids(head)
    return [Tokenized(_tokenize(t, f"texts[{i}]"), head_ids) for i, t in enumerate(texts)]


def tokens_used(owner) -> int:
    """Tokens of text the user holds: documents' chunks and texts stored here
    (``quotas.usage_of`` counts both)."""
    return quotas.usage_of(owner).tokens


def _check_quota(owner, tokenized: Tokenized) -> None:
    limit = settings.QUOTA_TOKENS
    known = StoredText.objects.filter(
        owner=owner,
        tokens_sha256=token_ids_sha256(tokenized.token_ids),
        head_hash=tokenized.head_hash,
    ).exists()
    if limit and not known and tokens_used(owner) + len(tokenized.token_ids) > limit:
        raise KdnRefused(
            "quota_exceeded",
            f"This text's {len(tokenized.token_ids):,} tokens "
            f"are over your quota of {limit:,} tokens of text.",
            413,
        )


def kdn_put(*, owner, text: str, head: str | None = None) -> dict[str, Any]:
    """Store ``text``'s KV in ``owner``'s scope: a KV worker finds or computes it
    (``precompute_kdn_text``, the ``kv`` queue); waits up to ``KDN_PUT_WAIT_S``, then
    raises :class:`StillComputing` (the task goes on; a PUT again finds it stored)."""
    (tokenized,) = tokenize([text], head)
    _check_quota(owner, tokenized)
    result = dispatch.precompute_text(
        tokenized.token_ids, tokenized.head_ids, kv_scope_for(owner.pk)
    )
    try:
        stored = result.get(timeout=settings.KDN_PUT_WAIT_S)
    except CeleryTimeout as err:
        raise StillComputing("The KV is still being computed; PUT the text again.") from err
    with transaction.atomic():  # checked again where it counts: the quota held to the write
        quotas.hold_quota(owner.pk)
        _check_quota(owner, tokenized)
        StoredText.objects.update_or_create(
            owner=owner,
            tokens_sha256=token_ids_sha256(tokenized.token_ids),
            head_hash=tokenized.head_hash,
            defaults={
                "kv_key": stored["key"],
                "token_count": stored["tokens"],
                "kv_bytes": stored["stored_bytes"],
            },
        )
    return stored


def kdn_compute(
    *,
    token_ids: list[int],
    head_ids: list[int],
    scope: str,
    producer: ChunkProducer,
    store: ChunkStore,
) -> dict[str, Any]:
    """In a KV worker (its ``producer`` and ``store``, ``worker/kv.py``): the object of these
    tokens after this head, in ``scope``, computed and stored unless S3 holds it already.
    Idempotent."""
    producer = producer.after(head_ids)
    key = producer.key(token_ids, scope)
    stored_bytes = store.object_bytes(key.to_string())
    computed = stored_bytes is None
    if computed:
        (chunk,) = producer.compute([token_ids])
        store.put(chunk, scope=scope)
        stored_bytes = store.object_bytes(key.to_string()) or 0
    return {
        "key": key.to_string(),
        "tokens": len(token_ids),
        "stored_bytes": stored_bytes,
        "computed": computed,
    }


def stored_keys(*, owner, texts: Sequence[str], head: str | None = None) -> list[str]:
    """The chunk key of each text in ``owner``'s reach, in order: a text they stored, or a
    chunk of a document they may read (their own, or of a collection shared with them: a
    question of theirs reads those passages, stored in their owner's scope) whose KV is
    stored after this head. :class:`NotStored` names the first text out of reach (another
    user's text is not theirs: the same 404 as a text nobody stored)."""
    tokenized = tokenize(texts, head)
    shas = [token_ids_sha256(t.token_ids) for t in tokenized]
    head_hash = tokenized[0].head_hash if tokenized else ""
    keys = dict(
        StoredText.objects.filter(
            owner=owner, head_hash=head_hash, tokens_sha256__in=shas
        ).values_list("tokens_sha256", "kv_key")
    )
    missing = set(shas) - set(keys)
    if missing:
        keys.update(_document_chunk_keys(owner, missing, head_hash))
    for index, sha in enumerate(shas):
        if sha not in keys:
            raise NotStored(index)
    return [keys[sha] for sha in shas]


def _document_chunk_keys(owner, shas: set[str], head_hash: str) -> dict[str, str]:
    """Token sha256 -> KV key of the readable documents' chunks with these tokens whose KV
    ingest stored (``Chunk.kv_key``: the model's fingerprint, the deployment's head, the
    document owner's scope), after ``head_hash``; the asker's own chunk first."""
    rows = (
        Chunk.objects.filter(document__in=documents_readable(user=owner), token_ids_sha256__in=shas)
        .exclude(kv_key="")
        .annotate(own=Case(When(document__owner=owner, then=0), default=1))
        .order_by("own", "pk")
        .values_list("token_ids_sha256", "kv_key")
    )
    found: dict[str, str] = {}
    for sha, key in rows:
        if ChunkKey.from_string(key).head_hash == head_hash:
            found.setdefault(sha, key)
    return found


def kdn_delete(*, owner, text: str, head: str | None = None) -> dict[str, Any]:
    """Remove the text ``owner`` stored (their record) and its KV object, unless a document
    chunk or another record still uses that object (identical text in the same scope shares
    it). :class:`NotYours` when they stored no such text (another user's is not theirs).
    Under the key's advisory lock, as every decision on a KV object's fate
    (``webapp.documents.services``): a precompute storing the same key waits."""
    from webapp.documents.services import kv_key_in_use, lock_kv_key

    (tokenized,) = tokenize([text], head)
    sha = token_ids_sha256(tokenized.token_ids)
    with transaction.atomic():
        row = StoredText.objects.filter(
            owner=owner, tokens_sha256=sha, head_hash=tokenized.head_hash
        ).first()
        if row is None:
            raise NotYours("You stored no such text (after this head): nothing to delete.")
        lock_kv_key(row.kv_key)
        row.delete()
        in_use = kv_key_in_use(row.kv_key)
        if not in_use:  # S3 down: the error rolls the record's delete back, to be retried
            delete_kv_object(row.kv_key)
    return {"key": row.kv_key, "tokens": row.token_count, "kv_deleted": not in_use}
