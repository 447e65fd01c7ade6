"""The knowledge delivery API, /kdn/v1: any engine stores KV with its text, fetches KV by
text and deletes what it stored (docs/kdn.md). API keys (``Authorization: Bearer``), under
the same per-user rate limit as /api/v1; a fetch also takes a request token, the inference
worker's (``webapp.kdn.tokens``), for the texts it names only and under a limit of its own.
Errors are ``{"code", "message"}``; a malformed body (not the call's JSON, a lone surrogate,
a blank text) is a 400, one over ``KDN_MAX_BODY_BYTES`` a 413 (``webapp.bodylimit``). The
schema is at /kdn/v1/openapi.json."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, StreamingHttpResponse
from django_ratelimit.core import get_usage
from ninja import Field, NinjaAPI, Schema
from ninja.errors import ValidationError
from ninja.security import HttpBearer
from pydantic import AfterValidator, BeforeValidator
from pydantic_core import PydanticCustomError

from kvservice.protocol.errors import StoreUnavailable
from kvservice.protocol.kdn_stream import ObjectStreams, StreamMissing
from kvservice.protocol.keys import ChunkKey
from webapp.api.auth import ApiKeyAuth
from webapp.api.errors import (
    ApiError,
    error_responses,
    install_error_handlers,
    unavailable,
    validation_message,
)
from webapp.documents.kv import KVObjectReader
from webapp.kdn import services
from webapp.kdn.tokens import RequestToken, token_claims, token_user


def check_token_rate_limit(request: HttpRequest, user) -> None:
    """Count a fetch with a request token against ``user``'s token limit: the API keys' rate
    (``API_RATE_LIMIT_REQUESTS`` per ``API_RATE_LIMIT_WINDOW_S``) in a bucket of its own.
    Not the keys' bucket: a question's worker fetches each passage, and counting those there
    would cut a user's questions to a seventh of their limit; over this one the worker
    recomputes (``kvservice.kdn.client.KdnTier``). 429 with ``Retry-After``, as a key's."""
    rate = f"{settings.API_RATE_LIMIT_REQUESTS}/{settings.API_RATE_LIMIT_WINDOW_S}s"
    usage = get_usage(
        request,
        group="kdn-token",
        key=lambda _group, _request: str(user.pk),
        rate=rate,
        increment=True,
    )
    if usage is not None and usage["should_limit"]:
        retry_after = max(1, usage["time_left"])
        message = f"This user's request tokens are over their rate limit; retry in {retry_after} s."
        raise ApiError(429, "rate_limited", message, {"Retry-After": str(retry_after)})


class RequestTokenAuth(HttpBearer):
    """A request token the web app signed for an inference worker (``webapp.kdn.tokens``):
    the request's user, until the token expires, for the texts it names. ``request.auth`` is
    the token's claims, which the fetch checks its texts against."""

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        claims = token_claims(token)
        user = None if claims is None else token_user(claims)
        if user is None:
            return None
        check_token_rate_limit(request, user)
        request.user = user
        return claims


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
    body = {"code": "bad_request", "message": validation_message(exc.errors)}
    return kdn_api.create_response(request, body, status=400)


HEAD_DOC = "The prompt head the KV is computed after (its text); default the deployment's."


def _unicode(value: Any) -> Any:
    """A lone surrogate (JSON's "\\ud800") is no text: the tokenizer cannot read it. Before
    pydantic's own check, which refuses it too but says only "unable to parse raw data"."""
    try:
        if isinstance(value, str):
            value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise PydanticCustomError(
            "unicode",
            "is not valid Unicode: a lone surrogate at character {at}",
            {"at": err.start},
        ) from None
    return value


def _not_blank(text: str) -> str:
    if not text.strip():
        raise PydanticCustomError("blank", "is only whitespace, no text")
    return text


# A text or head is Unicode; a text to store or fetch has more than whitespace (a DELETE
# takes any, so that a blank text stored before this rule can be removed).
Head = Annotated[str, Field(min_length=1, description=HEAD_DOC), BeforeValidator(_unicode)]
AnyText = Annotated[str, Field(min_length=1), BeforeValidator(_unicode)]
Text = Annotated[AnyText, AfterValidator(_not_blank)]


class PutIn(Schema):
    text: Text = Field(..., description="The chunk's text, tokenized on its own.")
    head: Head | None = None


class PutOut(Schema):
    key: str
    tokens: int
    stored_bytes: int
    computed: bool


class DeleteIn(Schema):
    text: AnyText = Field(..., description="A text you stored with PUT.")
    head: Head | None = None


class DeleteOut(Schema):
    key: str
    tokens: int
    kv_deleted: bool  # False: a document chunk or another record still uses the object


class FetchIn(Schema):
    texts: list[Text] = Field(
        ...,
        min_length=1,
        description="Texts stored with PUT, or passages of documents you may read, in order.",
    )
    head: Head | None = None


class ComputingOut(Schema):
    code: str
    message: str


_STREAM_DOC = {
    "responses": {
        200: {
            "description": "The texts' KV as one binary stream (docs/kdn.md, "
            "kvservice/protocol/kdn_stream.py): a preamble, every chunk's header, layer 0 of every "
            "chunk, layer 1 ..., then the token ids. Header X-KV-Tokens: total tokens.",
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        }
    }
}


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


@kdn_api.delete("/kv", response={200: DeleteOut, **error_responses(404, 413)}, tags=["kdn"])
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
    except StoreUnavailable as err:  # nothing deleted: DELETE again
        raise unavailable(f"The KV store is unavailable: {err}") from err


@kdn_api.post(
    "/fetch",
    response={200: None, **error_responses(403, 404, 413)},
    openapi_extra=_STREAM_DOC,
    auth=[ApiKeyAuth(), RequestTokenAuth()],
    tags=["kdn"],
)
def fetch_kv(request: HttpRequest, payload: FetchIn):
    """Stream the stored KV of each text, layer by layer: texts you stored, and passages of
    documents you may read (your own, and those of collections shared with you) as ingest
    stored them. Takes an API key, or a request token (the inference worker's): that fetches
    the texts it names only, after the deployment's head (any other is a 403)."""
    if isinstance(request.auth, RequestToken):
        _check_token_scope(request.auth, payload)
    try:
        keys = services.stored_keys(owner=request.user, texts=payload.texts, head=payload.head)
    except services.KdnRefused as err:
        raise _refused(err) from err
    except services.NotStored as err:
        raise ApiError(404, "not_stored", str(err)) from err
    streams = ObjectStreams(KVObjectReader(), [ChunkKey.from_string(k) for k in keys])
    try:
        streams.open()
    except StreamMissing as err:
        raise ApiError(
            404,
            "not_stored",
            f"texts[{err.index}] is recorded but its KV is gone from the store: PUT it again.",
        ) from err
    return _stream_response(streams)


def _check_token_scope(claims: RequestToken, payload: FetchIn) -> None:
    """A 403 for a text the token does not name, decided from the token alone: it says
    nothing of whether the text is stored, or whose it is."""
    if payload.head is not None:
        raise ApiError(
            403,
            "out_of_scope",
            "A request token fetches after the deployment's prompt head only: send no head.",
        )
    index = claims.first_outside(payload.texts)
    if index is not None:
        message = f"texts[{index}] is not a text this request token was issued for."
        raise ApiError(403, "out_of_scope", message)


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
