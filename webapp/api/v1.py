"""The REST API for programs, /api/v1: documents, query, conversations, cache statistics.

Every operation needs an API key (``Authorization: Bearer``) or a browser session; errors are
``{"code", "message"}``. The schema is at /api/v1/openapi.json, the docs at /api/v1/docs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from asgiref.sync import sync_to_async
from django.db import transaction
from django.db.models import Avg, Count
from django.http import HttpRequest, StreamingHttpResponse
from ninja import Field as SchemaField
from ninja import File, NinjaAPI, Query, Router, Schema, UploadedFile
from ninja.responses import Status

from kvservice.protocol import AnswerOutcome, Queue, Token, outcome_of
from kvservice.protocol.heartbeat import read_heartbeat
from webapp.answer_stream import AnswerTimeout, sse
from webapp.api import answers
from webapp.api.auth import API_AUTH
from webapp.api.errors import (
    ApiError,
    error_responses,
    install_error_handlers,
    stream_error,
    unavailable,
)
from webapp.api.schemas import (
    CacheStatsOut,
    CollectionIn,
    CollectionListOut,
    CollectionOut,
    CollectionPatch,
    ConversationDetailOut,
    ConversationListOut,
    DocumentCreatedOut,
    DocumentListOut,
    DocumentOut,
    QueryIn,
    QueryOut,
    Text,
    UsageOut,
)
from webapp.chat import services as chat
from webapp.chat.models import Conversation, Message
from webapp.chat.requests import mode_allowed
from webapp.chat.selectors import conversations_of
from webapp.documents import quotas
from webapp.documents import selectors as documents
from webapp.documents import services as document_services
from webapp.documents.models import Chunk, Collection, Document
from webapp.documents.selectors import Scope
from webapp.redis import redis_client

api = NinjaAPI(
    title="Ragblend API",
    version="1",
    description="Documents, questions over them (blended KV caches), conversations.",
    auth=API_AUTH,
    urls_namespace="api_v1",
)
install_error_handlers(api, lambda error: {"code": error.code, "message": error.message})


class Page(Schema):
    limit: int = SchemaField(50, ge=1, le=200)
    offset: int = SchemaField(0, ge=0, le=1_000_000)


# --- documents -------------------------------------------------------------------------------

documents_router = Router(tags=["documents"])


def _get_document_for_user(
    request: HttpRequest, document_id: int, *, change: bool = False
) -> Document:
    """The pages' access rule (``document_get_readable``): a document the caller may not read
    is a 404; one shared with them reads, and a ``change`` by them is a 403."""
    document = documents.document_get_readable(user=request.user, document_id=document_id)
    if document is None:
        raise ApiError(404, "not_found", "No such document.")
    if change and document.owner_id != request.user.pk:
        raise ApiError(403, "forbidden", "This document is shared with you read-only.")
    return document


def _document_out(document: Document, user) -> dict:
    return {
        "id": document.pk,
        "title": document.title,
        "status": document.status,
        "progress": document.progress,
        "error": document.error_message,
        "stage": document.stage,
        "size_bytes": document.size_bytes,
        "created_at": document.created_at,
        "updated_at": document.updated_at,
        "read_only": document.owner_id != user.pk,
    }


@documents_router.post("", response={201: DocumentCreatedOut, **error_responses(413)})
def document_upload(request: HttpRequest, file: File[UploadedFile]):
    """Upload one file (multipart field ``file``); it is parsed, chunked, embedded and its KV
    cache precomputed in the background: poll the document until ``ready`` or ``failed``."""
    try:
        document = document_services.document_upload(owner=request.user, uploaded_file=file)
    except document_services.UploadRefused as err:
        raise ApiError(422, "upload_refused", str(err)) from err
    return Status(201, {"id": document.pk, "status": document.status})


@documents_router.get("", response={200: DocumentListOut, **error_responses()})
def document_list(request: HttpRequest, page: Query[Page]):
    found = documents.document_list(owner=request.user)
    items = found[page.offset : page.offset + page.limit]
    return {"count": found.count(), "items": [_document_out(d, request.user) for d in items]}


@documents_router.get("/usage", response={200: UsageOut, **error_responses()})
def document_usage(request: HttpRequest):
    """Your documents and tokens of text (and the KV cache they take) against your quotas."""
    return quotas.usage_of(request.user).to_dict()


@documents_router.get("/{document_id}", response={200: DocumentOut, **error_responses(404)})
def document_detail(request: HttpRequest, document_id: int):
    """One of your documents, or one in a collection shared with you (``read_only``)."""
    return _document_out(_get_document_for_user(request, document_id), request.user)


class DocumentPatch(Schema):
    title: Text  # its new name; runs of spaces become one


@documents_router.patch(
    "/{document_id}", response={200: DocumentOut, **error_responses(400, 403, 404)}
)
def document_update(request: HttpRequest, document_id: int, payload: DocumentPatch):
    """Rename one of your documents (``title``: not empty, at most 255 characters)."""
    document = _get_document_for_user(request, document_id, change=True)
    try:
        document_services.document_rename(document=document, title=payload.title)
    except document_services.RenameRefused as err:
        raise ApiError(400, "invalid_request", str(err)) from err
    return _document_out(document, request.user)


@documents_router.delete("/{document_id}", response={204: None, **error_responses(403, 404)})
def document_delete(request: HttpRequest, document_id: int):
    document = _get_document_for_user(request, document_id, change=True)
    document_services.document_delete(document=document)
    return Status(204, None)


# --- query -----------------------------------------------------------------------------------

query_router = Router(tags=["query"])

# One server-sent event; its ``data`` is JSON text.
_SSE_EVENT = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"type": "string", "enum": ["start", "queue", "token", "done", "error"]},
        "data": {"type": "string"},
    },
}
_STREAM_DOC = {  # merged into ninja's own responses: the same (int) key, or JSON gets two "200"
    "responses": {
        200: {
            "description": "The answer as JSON, or with ``stream``: server-sent events "
            "``start`` (citations: every passage retrieved), while the question waits for the "
            "model ``queue`` ({ahead: the questions ahead of yours, 0: yours is next; null once "
            "it is being answered}), ``token`` ({text}) ..., then "
            "``done`` (the JSON answer: the passages it cites, the rest under also_retrieved) "
            "or ``error`` ({code, message}).",
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/QueryOut"}},
                "text/event-stream": {"schema": _SSE_EVENT},
            },
        }
    }
}


def _get_conversation_for_user(request: HttpRequest, conversation_id: int) -> Conversation:
    conversation = conversations_of(request.user).filter(pk=conversation_id).first()
    if conversation is None:
        raise ApiError(404, "not_found", "No such conversation.")
    return conversation


def scope_of(payload: Any) -> Scope | None:
    """The scope a request names (``collection_ids``, ``document_ids``), None when neither."""
    if payload.collection_ids is None and payload.document_ids is None:
        return None
    return Scope.of(payload.collection_ids or (), payload.document_ids or ())


def set_scope(request: HttpRequest, conversation: Conversation, scope: Scope | None) -> None:
    if scope is None:
        return
    try:
        chat.conversation_set_scope(
            user=request.user,
            conversation=conversation,
            collection_ids=scope.collection_ids,
            document_ids=scope.document_ids,
        )
    except chat.ScopeNotFound as err:
        raise ApiError(404, "not_found", str(err)) from err


@transaction.atomic
def _conversation_for(request: HttpRequest, conversation_id: int | None, scope: Scope | None):
    """The caller's conversation, or a new API one, searching ``scope`` when one is named."""
    if conversation_id is not None:
        conversation = _get_conversation_for_user(request, conversation_id)
    else:
        conversation = chat.conversation_create(owner=request.user, source=Conversation.Source.API)
    set_scope(request, conversation, scope)
    return conversation


def ask(
    request: HttpRequest,
    *,
    question: str,
    mode: str,
    conversation_id: int | None,
    scope: Scope | None = None,
):
    """Check the mode, ownership and scope, then ask (the pending answer's stream is then
    read)."""
    if not mode_allowed(request.user, mode):
        raise ApiError(403, "forbidden", "Only staff can choose another mode than blend.")
    conversation = _conversation_for(request, conversation_id, scope)
    try:
        return chat.chat_ask(
            user=request.user, conversation=conversation, question=question, mode=mode
        )
    except chat.AnswerServiceUnavailable as err:
        raise unavailable(str(err)) from err
    except chat.ChatError as err:
        raise ApiError(422, "invalid_request", str(err)) from err


def _query_out(answer: Message, result: AnswerOutcome) -> dict:
    return {
        "answer": result.text,
        "withheld": result.withheld,
        "parts_not_found": answer.parts_not_found,
        **answers.sources_of(answer, result),
        "metrics": answers.metrics_of(answer, result.metrics),
        "conversation_id": answer.conversation_id,
        "message_id": answer.pk,
    }


async def _query_events(answer: Message, citations: list[dict]) -> AsyncIterator[str]:
    yield sse(
        "start",
        {
            "conversation_id": answer.conversation_id,
            "message_id": answer.pk,
            "citations": citations,
        },
    )
    try:
        async for event in answers.answer_events(str(answer.request_id)):
            if isinstance(event, Token):
                yield sse("token", {"text": event.text})
            elif isinstance(event, Queue):
                yield sse("queue", {"ahead": event.ahead})
            else:  # the end, Done or Error; the answer is recorded by then
                result = outcome_of(event)
                if result.ok:
                    out = await sync_to_async(_query_out)(answer, result)  # reads citations
                    yield sse("done", out)
                else:
                    yield sse("error", {"code": "generation_failed", "message": result.error})
    except AnswerTimeout as err:
        yield sse("error", {"code": "timeout", "message": str(err)})
    except Exception as err:  # a service lost mid-stream: the client gets an end, not a cut
        error = stream_error(err, conversation_id=answer.conversation_id)
        yield sse("error", {"code": error.code, "message": error.message})


def event_stream_response(events: AsyncIterator[str]) -> StreamingHttpResponse:
    """Server-sent events from an async iterator: under ASGI each event is sent as it comes
    (Django would buffer a sync iterator whole before sending anything)."""
    response = StreamingHttpResponse(events, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


@query_router.post(
    "",
    response={200: QueryOut, **error_responses(403, 404, 502, 504)},
    openapi_extra=_STREAM_DOC,
)
def query(request: HttpRequest, payload: QueryIn):
    """Ask a question over your ready documents (or the collections and documents named,
    which the conversation then keeps searching); the answer cites the chunks it was given."""
    answer = ask(
        request,
        question=payload.question,
        mode=payload.mode,
        conversation_id=payload.conversation_id,
        scope=scope_of(payload),
    )
    if payload.stream:
        return event_stream_response(_query_events(answer, answers.citations_of(answer)))
    try:
        result = answers.wait_for_answer(answer)
    except AnswerTimeout as err:
        raise ApiError(504, "timeout", str(err)) from err
    if not result.ok:
        raise ApiError(502, "generation_failed", result.error)
    return _query_out(answer, result)


# --- conversations ---------------------------------------------------------------------------

conversations_router = Router(tags=["conversations"])


def _message_out(message: Message) -> dict:
    has_metrics = message.role == Message.Role.ASSISTANT and not message.is_open
    return {
        "id": message.pk,
        "role": message.role,
        "content": message.content,
        "withheld": message.withheld_text,
        "parts_not_found": message.parts_not_found,
        "status": message.status,
        "error": message.error_message,
        "mode": message.mode,
        "created_at": message.created_at,
        **answers.sources_of(message),
        "metrics": {
            "ttft_s": message.ttft_s,
            "ttft_seen_s": message.ttft_seen_s,
            "total_s": message.total_s,
            "mode": message.mode,
            "recompute_ratio": answers.rounded_ratio(message.recompute_ratio),
            "from_prefix_cache": message.from_prefix_cache,
            "tiers": message.tiers or {},
            "prompt_tokens": message.prompt_tokens,
            "completion_tokens": message.completion_tokens,
            "retrieval": answers.retrieval_of(message),
        }
        if has_metrics
        else None,
    }


def _conversation_out(conversation: Conversation) -> dict:
    return {
        "id": conversation.pk,
        "title": conversation.title,
        "created_at": conversation.created_at,
        "updated_at": conversation.updated_at,
    }


@conversations_router.get("", response={200: ConversationListOut, **error_responses()})
def conversation_list(request: HttpRequest, page: Query[Page]):
    found = conversations_of(request.user)
    items = found[page.offset : page.offset + page.limit]
    return {"count": found.count(), "items": [_conversation_out(c) for c in items]}


@conversations_router.get(
    "/{conversation_id}", response={200: ConversationDetailOut, **error_responses(404)}
)
def conversation_detail(request: HttpRequest, conversation_id: int):
    conversation = _get_conversation_for_user(request, conversation_id)
    messages = conversation.messages.shown().prefetch_related("citations")
    scope = conversation.scope
    return _conversation_out(conversation) | {
        "scope": {
            "collection_ids": sorted(scope.collection_ids),
            "document_ids": sorted(scope.document_ids),
            "everything": scope.is_everything,
        },
        "messages": [_message_out(m) for m in messages],
    }


# --- collections -----------------------------------------------------------------------------

collections_router = Router(tags=["collections"])


def _collection_out(collection: Collection, user) -> dict:
    return {
        "id": collection.pk,
        "name": collection.name,
        "owner": collection.owner.get_username(),
        "read_only": collection.owner_id != user.pk,
        "document_ids": sorted(d.pk for d in collection.documents.all()),
        "created_at": collection.created_at,
        "updated_at": collection.updated_at,
    }


@collections_router.get("", response={200: CollectionListOut, **error_responses()})
def collection_list(request: HttpRequest, page: Query[Page]):
    """Your collections and those shared with you (read-only): their ids scope a query."""
    found = documents.collections_readable(user=request.user)
    items = found.prefetch_related("documents")[page.offset : page.offset + page.limit]
    return {"count": found.count(), "items": [_collection_out(c, request.user) for c in items]}


@collections_router.get("/{collection_id}", response={200: CollectionOut, **error_responses(404)})
def collection_detail(request: HttpRequest, collection_id: int):
    collection = documents.collection_get_readable(user=request.user, collection_id=collection_id)
    if collection is None:
        raise ApiError(404, "not_found", "No such collection.")
    return _collection_out(collection, request.user)


def _own_collection(request: HttpRequest, collection_id: int) -> Collection:
    """The caller's own collection: 404 when they cannot read it, 403 when it is only shared
    with them (read-only)."""
    collection = documents.collection_get_readable(user=request.user, collection_id=collection_id)
    if collection is None:
        raise ApiError(404, "not_found", "No such collection.")
    if collection.owner_id != request.user.pk:
        raise ApiError(403, "forbidden", "This collection is shared with you read-only.")
    return collection


@contextmanager
def _collection_change() -> Iterator[None]:
    """One atomic change of a collection; a taken name or an unknown username is a 400."""
    try:
        with transaction.atomic():
            yield
    except document_services.CollectionError as err:
        raise ApiError(400, "invalid_request", str(err)) from err


def _apply(collection: Collection, name=None, document_ids=None, shared_with=None) -> None:
    """Its name, its documents (the owner's; other ids ignored) and whom it is shared with
    read-only, each only when given."""
    if name is not None:
        document_services.collection_rename(collection=collection, name=name)
    if document_ids is not None:
        document_services.collection_set_documents(collection=collection, document_ids=document_ids)
    if shared_with is not None:
        document_services.collection_share(collection=collection, usernames=shared_with)


@collections_router.post("", response={201: CollectionOut, **error_responses(400)})
def collection_create(request: HttpRequest, payload: CollectionIn):
    """A new collection of your documents, optionally shared read-only by username."""
    with _collection_change():
        collection = document_services.collection_create(owner=request.user, name=payload.name)
        _apply(collection, document_ids=payload.document_ids, shared_with=payload.shared_with)
    return 201, _collection_out(collection, request.user)


@collections_router.patch(
    "/{collection_id}", response={200: CollectionOut, **error_responses(400, 403, 404)}
)
def collection_update(request: HttpRequest, collection_id: int, payload: CollectionPatch):
    """Rename it, set its documents, or set whom it is shared with (yours only)."""
    collection = _own_collection(request, collection_id)
    with _collection_change():
        _apply(collection, payload.name, payload.document_ids, payload.shared_with)
    return _collection_out(collection, request.user)


@collections_router.delete("/{collection_id}", response={204: None, **error_responses(403, 404)})
def collection_delete(request: HttpRequest, collection_id: int):
    """The collection goes; its documents stay (yours only)."""
    document_services.collection_delete(collection=_own_collection(request, collection_id))
    return 204, None


# --- cache statistics (staff) ----------------------------------------------------------------

stats_router = Router(tags=["cache"])


@stats_router.get("", response={200: CacheStatsOut, **error_responses(403)})
def cache_stats(request: HttpRequest):
    """KV cache statistics for the whole deployment (staff only)."""
    if not request.user.is_staff:
        raise ApiError(403, "forbidden", "Cache statistics are for staff.")
    chunks = {status: 0 for status in Chunk.KVStatus.values}
    for row in Chunk.objects.values("kv_status").annotate(n=Count("id")).order_by():
        chunks[row["kv_status"]] = row["n"]
    answered = Message.objects.filter(role=Message.Role.ASSISTANT, status=Message.Status.DONE)
    tiers: dict[str, int] = {}
    for served in answered.exclude(tiers={}).values_list("tiers", flat=True).iterator():
        for tier, count in (served or {}).items():
            tiers[tier] = tiers.get(tier, 0) + int(count)
    modes = (
        answered.exclude(mode="")
        .values("mode")
        .annotate(
            answers=Count("id"),
            mean_ttft_s=Avg("ttft_s"),
            mean_total_s=Avg("total_s"),
            mean_recompute_ratio=Avg("recompute_ratio"),
        )
        .order_by("mode")
    )
    kv_objects = Chunk.objects.exclude(kv_key="").values("kv_key").distinct().count()
    try:
        worker = read_heartbeat(redis_client())
    except Exception:  # noqa: BLE001 - statistics still answer when Redis does not
        worker = None
    modes = [
        {**row, "mean_recompute_ratio": answers.rounded_ratio(row["mean_recompute_ratio"])}
        for row in modes
    ]
    return {
        "chunks": chunks,
        "kv_objects": kv_objects,
        "tiers": tiers,
        "modes": modes,
        "worker": worker,
    }


api.add_router("/documents", documents_router)
api.add_router("/query", query_router)
api.add_router("/conversations", conversations_router)
api.add_router("/collections", collections_router)
api.add_router("/cache/stats", stats_router)
