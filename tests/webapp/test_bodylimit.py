"""Bodies over the limit are refused as they arrive: the real ASGI application, no server."""

from __future__ import annotations

import asyncio

import pytest

from webapp.asgi import application, django_application
from webapp.bodylimit import BodySizeLimit


def _scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), *headers],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
    }


async def _call(app, scope: dict, chunks: list[bytes]) -> tuple[int, bytes, int]:
    """Run one request whose body comes in ``chunks``; returns (status, body, chunks read)."""
    sent: list[dict] = []
    read = 0

    async def receive() -> dict:
        nonlocal read
        if read < len(chunks):
            read += 1
            return {
                "type": "http.request",
                "body": chunks[read - 1],
                "more_body": read < len(chunks),
            }
        await asyncio.sleep(3600)  # the client would keep sending: never reached when refused

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 30)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, read


def test_a_declared_length_over_the_limit_is_refused_before_any_byte_is_read() -> None:
    huge = str(200 * 1024 * 1024).encode()
    scope = _scope("/api/v1/documents", [(b"content-length", huge)])
    status, body, read = asyncio.run(_call(application, scope, [b"x" * 1024] * 3))
    assert status == 413 and read == 0
    assert b'"code": "too_large"' in body


@pytest.mark.django_db
def test_a_body_without_a_length_is_cut_off_once_past_the_limit() -> None:
    app = BodySizeLimit(django_application, limit=1000)
    scope = _scope("/documents/", [(b"content-type", b"application/octet-stream")])
    status, body, read = asyncio.run(_call(app, scope, [b"x" * 600] * 5))
    assert status == 413 and read == 2  # the third chunk was never asked for
    assert b"larger than" in body


@pytest.mark.django_db
def test_a_body_under_the_limit_reaches_django() -> None:
    app = BodySizeLimit(django_application, limit=1000)
    scope = _scope("/accounts/login/", [(b"content-length", b"10")])
    status, _, read = asyncio.run(_call(app, scope, [b"username=x"]))
    assert status == 403 and read == 1  # Django's CSRF refusal: the request got through
