"""Refuse request bodies over ``MAX_REQUEST_BYTES`` while they arrive, not after.

Django's ASGI handler reads a whole body (to a temporary file) before any view or middleware
runs, so a view can only refuse a 200 MB upload once all of it has been received. This ASGI
wrapper answers 413 as soon as the declared ``Content-Length`` is over the limit, or as soon
as the bytes received pass it (a body sent without a length), and reads no further.

A path may have a limit of its own (``path_limits``, by prefix): the knowledge delivery API's
JSON bodies are a few MB at most (``KDN_MAX_BODY_BYTES``), not a form of uploads.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class _TooLarge(Exception):
    pass


def _size_words(nbytes: int) -> str:
    if nbytes < 1024 * 1024:
        return f"{nbytes / 1024:.0f} KB"
    return f"{nbytes / (1024 * 1024):.0f} MB"


def _too_large_response(path: str, limit: int) -> tuple[bytes, bytes]:
    advice = (
        "send fewer or shorter texts at a time"
        if path.startswith("/kdn/")
        else "upload fewer or smaller files at a time"
    )
    message = f"The request is larger than {_size_words(limit)}: {advice}."
    if path.startswith(("/api/", "/v1/", "/kdn/")):
        return b"application/json", json.dumps({"code": "too_large", "message": message}).encode()
    return b"text/plain; charset=utf-8", message.encode()


class BodySizeLimit:
    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        limit: int,
        *,
        path_limits: Mapping[str, int] | None = None,
    ) -> None:
        self.app, self.limit = app, limit
        self.path_limits = dict(path_limits or {})

    def limit_for(self, path: str) -> int:
        """The limit of the first prefix in ``path_limits`` that ``path`` starts with, else
        the default."""
        prefixed = (n for prefix, n in self.path_limits.items() if path.startswith(prefix))
        return next(prefixed, self.limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope.get("path", ""))
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, send, limit)
            return
        received, started = 0, False

        async def counted_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _TooLarge
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            if not started:
                await self._refuse(scope, send, limit)

    async def _refuse(self, scope: Scope, send: Send, limit: int) -> None:
        content_type, body = _too_large_response(scope.get("path", ""), limit)
        headers = [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
