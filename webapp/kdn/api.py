"""The knowledge delivery API, /kdn/v1: any engine stores KV with its text, fetches KV by
text and deletes what it stored (docs/kdn.md). API keys (``Authorization: Bearer``), under
the same per-user rate limit as /api/v1; a fetch also takes a request token, the inference
worker's (``webapp.kdn.tokens``). Errors are ``{"code", "message"}``, a malformed body a
400. The schema is at /kdn/v1/openapi.json."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, StreamingHttpResponse
from ninja import Field, NinjaAPI, Schema
from ninja.errors import ValidationError
from ninja.security import HttpBearer

from kvservice.kdn_stream import ObjectStreams, StreamMissing
from kvservice.store.errors import StoreUnavailable
from kvservice.store.keys import ChunkKey
from webapp.api.auth import ApiKeyAuth
from webapp.api.errors import (
    ApiError,
    _validation_message,
    error_responses,
    install_error_handlers,
    unavailable,
)
from webapp.documents.kv import KVUnavailable
from webapp.kdn import services
from webapp.kdn.tokens import token_user


class RequestTokenAuth(HttpBearer):
    """A request token the web app signed for an inference worker (``webapp.kdn.tokens``):
    the request's user, until its timeout. Not under the per-user rate limit: the question
    it serves passed the limit when it was asked, and its worker fetches each passage, so a
    limit per call would slow or fail answers of a user who is within theirs."""

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        user = token_user(token)
        if user is not None:
            request.user = user
        return user


kdn_api = NinjaAPI(
    title="Ragblend knowledge delivery API",
    version="1",
    description="Store KV caches with their text; fetch them by text, streamed layer by layer.",
    auth=[ApiKeyAuth()],
    urls_namespace="kdn_v1",
)
install_error_handlers(kdn_api, lambda error: {"code": error.code, "message": error.message})


@kdn_api.exception_handler(ValidationError)
def _malformed(request: HttpRequest, exc: ValidationError):
    """A body that is not the call's JSON is the caller's mistake: 400, saying what."""
    body = {"code": "bad_request", "message": _validation_message(exc.errors)}
    return kdn_api.create_response(request, body, status=400)


HEAD_DOC = "The prompt head the KV is computed after (its text); default the deployment's."


class PutIn(Schema):
    text: str = Field(..., min_length=1, description="The chunk's text, tokenized on its own.")
    head: str | None = Field(None, min_length=1, description=HEAD_DOC)


class PutOut(Schema):
    key: str
    tokens: int
    stored_bytes: int
    computed: bool


class DeleteIn(Schema):
    text: str = Field(..., min_length=1, description="A text you stored with PUT.")
    head: str | None = Field(None, min_length=1, description=HEAD_DOC)


class DeleteOut(Schema):
    key: str
    tokens: int
    kv_deleted: bool  # False: a document chunk or another record still uses the object


class FetchIn(Schema):
    texts: list[str] = Field(
        ...,
        min_length=1,
        description="Texts stored with PUT, or passages of documents you may read, in order.",
    )
    head: str | None = Field(None, min_length=1, description=HEAD_DOC)


class ComputingOut(Schema):
    code: str
    message: str


_STREAM_DOC = {
    "responses": {
        200: {
            "description": "The texts' KV as one binary stream (docs/kdn.md, "
            "kvservice/kdn_stream.py): a preamble, every chunk's header, layer 0 of every "
            "chunk, layer 1 ..., then the token ids. Header X-KV-Tokens: total tokens.",
            "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                "format": "binary"}}},
        }
    }
}  # fmt: skip


def _refused(err: services.KdnRefused) -> ApiError:
    return ApiError(err.status, err.code, str(err))


@kdn_api.put("/kv", response={200: PutOut, 202: ComputingOut, **error_responses(413)}, tags=["kdn"])
def put_kv(request: HttpRequest, payload: PutIn):
    """Store the text's chunk KV in your KV scope, computed by the KV workers unless stored
    already (idempotent). 202 with Retry-After while it is still being computed: PUT again."""
    try:
        return services.kdn_put(owner=request.user, text=payload.text, head=payload.head)
    except services.KdnRefused as err:
        raise _refused(err) from err
    except services.StillComputing as err:
        response = kdn_api.create_response(
            request, {"code": "computing", "message": str(err)}, status=202
        )
        response["Retry-After"] = "2"
        return response


@kdn_api.delete("/kv", response={200: DeleteOut, **error_responses(404)}, tags=["kdn"])
def delete_kv(request: HttpRequest, payload: DeleteIn):
    """Delete a text you stored: its record (its tokens leave your quota) and its KV object,
    unless a document chunk or another record in the same scope uses it too. 404 when you
    stored no such text."""
    try:
        return services.kdn_delete(owner=request.user, text=payload.text, head=payload.head)
    except services.KdnRefused as err:
        raise _refused(err) from err
    except services.NotYours as err:
        raise ApiError(404, "not_stored", str(err)) from err
    except (StoreUnavailable, KVUnavailable) as err:  # nothing deleted: DELETE again
        raise unavailable(f"The KV store is unavailable: {err}") from err


@kdn_api.post(
    "/fetch", response={200: None, **error_responses(404)}, openapi_extra=_STREAM_DOC,
    auth=[ApiKeyAuth(), RequestTokenAuth()], tags=["kdn"],
)  # fmt: skip
def fetch_kv(request: HttpRequest, payload: FetchIn):
    """Stream the stored KV of each text, layer by layer: texts you stored, and passages of
    documents you may read (your own, and those of collections shared with you) as ingest
    stored them. Takes an API key, or a request token (the inference worker's)."""
    try:
        keys = services.stored_keys(owner=request.user, texts=payload.texts, head=payload.head)
    except services.KdnRefused as err:
        raise _refused(err) from err
    except services.NotStored as err:
        raise ApiError(404, "not_stored", str(err)) from err
    streams = ObjectStreams(_s3_tier(), [ChunkKey.from_string(k) for k in keys])
    try:
        streams.open()
    except StreamMissing as err:
        raise ApiError(404, "not_stored", f"texts[{err.index}] is recorded but its KV is gone "
                       "from the store: PUT it again.") from err  # fmt: skip
    return _stream_response(streams)


def _s3_tier():
    from webapp.documents.kv import KVUnavailable, kv_store

    try:
        return kv_store().store.durable
    except KVUnavailable as err:
        raise unavailable(str(err)) from err


class _Body:
    """The response body: the streams' parts, each step read in a worker thread, sent as it
    comes (an async iterator: under ASGI Django would buffer a sync one whole). Django calls
    ``close`` when the response ends, sent or not."""

    def __init__(self, streams: ObjectStreams) -> None:
        self.streams = streams

    async def __aiter__(self) -> AsyncIterator[memoryview]:
        steps = self.streams.parts()
        read_step = sync_to_async(next, thread_sensitive=False)
        while (parts := await read_step(steps, None)) is not None:
            for part in parts:
                yield memoryview(part)  # Django's make_bytes turns a bytearray into its repr

    def close(self) -> None:
        self.streams.close()


def _stream_response(streams: ObjectStreams) -> StreamingHttpResponse:
    response = StreamingHttpResponse(_Body(streams), content_type="application/octet-stream")
    response["Content-Length"] = str(streams.content_length)
    response["X-KV-Tokens"] = str(streams.num_tokens)
    response["X-KV-Layers"] = str(streams.num_layers)
    response["X-Accel-Buffering"] = "no"
    return response
