"""One error type for the API and the JSON shapes it takes.

Views raise ``ApiError(status, code, message)``; each NinjaAPI installs handlers that render
it, and every error ninja or Django raise (validation, auth, 404, a bug), in its own shape:
``{"code", "message"}`` for /api/v1, ``{"error": {"message", "type", "code"}}`` for the
OpenAI-compatible /v1."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.http import Http404, HttpRequest, HttpResponse
from django.http.multipartparser import MultiPartParserError
from ninja import NinjaAPI, Schema
from ninja.errors import AuthenticationError, HttpError, ValidationError

from webapp import outages

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}


class ErrorOut(Schema):
    code: str
    message: str


def error_responses(*statuses: int) -> dict[int, type[ErrorOut]]:
    """The documented error responses of an operation (every one has 400, 401, 422, 429, and
    503 when a service it needs is down)."""
    return {status: ErrorOut for status in sorted({400, 401, 422, 429, 503, *statuses})}


_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    422: "invalid_request",
    429: "rate_limited",
    500: "internal_error",
    503: "service_unavailable",
}

AUTH_MESSAGE = "Send a valid API key as 'Authorization: Bearer <key>' (create one under API keys)."


def unavailable(message: str) -> ApiError:
    """503 with ``Retry-After``: a service the request needs is down."""
    return ApiError(
        503, "service_unavailable", message, {"Retry-After": str(outages.RETRY_AFTER_S)}
    )


def validation_message(errors: list[dict[str, Any]]) -> str:
    parts = []
    for error in errors[:5]:
        location = ".".join(str(p) for p in error.get("loc", ()) if p not in ("body", "payload"))
        parts.append(f"{location}: {error.get('msg', 'invalid')}" if location else error["msg"])
    return "; ".join(parts) or "The request is not valid."


def normalize(exc: Exception) -> ApiError:
    """Any exception as an ApiError (unexpected ones logged, with a generic message)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, AuthenticationError):
        return ApiError(401, "unauthorized", AUTH_MESSAGE, {"WWW-Authenticate": "Bearer"})
    if isinstance(exc, ValidationError):
        return ApiError(422, "invalid_request", validation_message(exc.errors))
    if isinstance(exc, Http404):
        return ApiError(404, "not_found", str(exc) or "Not found.")
    if isinstance(exc, HttpError):
        return ApiError(exc.status_code, _CODES.get(exc.status_code, "error"), str(exc))
    if isinstance(exc, RequestDataTooBig):  # Django will not read the body: the caller's size
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return ApiError(413, "too_large", f"The request body is over {limit:,} bytes.")
    if isinstance(exc, MultiPartParserError | SuspiciousOperation):  # a body Django won't read
        return ApiError(400, "bad_request", f"The request body could not be read: {exc}")
    if outages.is_outage(exc):
        log.warning("API request failed: service unavailable: %r", exc)
        return unavailable(outages.MESSAGE)
    log.exception("API request failed", exc_info=exc)
    return ApiError(500, "internal_error", "Something went wrong on our side.")


STREAM_LOST = (
    "Lost the connection to the answer's stream: a service Ragblend needs is not responding. "
    "The answer is still recorded as it ends: read it with GET /api/v1/conversations/"
    "{conversation_id} in a moment."
)


def stream_error(exc: Exception, *, conversation_id: int) -> ApiError:
    """The error that ends a stream which failed after its response began (its status is sent
    already; the error goes in the stream, in the API's own shape): a lost service says that
    the answer goes on, and where to read it; anything else as ``normalize`` has it."""
    error = normalize(exc)
    if error.code == "service_unavailable":
        return unavailable(STREAM_LOST.format(conversation_id=conversation_id))
    return error


def install_error_handlers(api: NinjaAPI, render: Callable[[ApiError], dict[str, Any]]) -> None:
    def handle(request: HttpRequest, exc: Exception) -> HttpResponse:
        error = normalize(exc)
        response = api.create_response(request, render(error), status=error.status)
        for name, value in error.headers.items():
            response[name] = value
        return response

    for kind in (Exception, ApiError, AuthenticationError, ValidationError, Http404, HttpError):
        api.add_exception_handler(kind, handle)
