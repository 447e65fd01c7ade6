"""A request body Django refuses to parse is the caller's error (400 in the API's shape),
not a server error: schemathesis found a multipart upload whose part headers passed Django's
limit answered with a 500."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.webapp.api.conftest import bearer

pytestmark = pytest.mark.django_db

BOUNDARY = "b0undary"


def _multipart(part_headers: str) -> bytes:
    return (f"--{BOUNDARY}\r\n{part_headers}\r\n\r\nhello\r\n--{BOUNDARY}--\r\n").encode()


def _post(alice, body: bytes):
    return Client().post(
        "/api/v1/documents",
        body,
        content_type=f"multipart/form-data; boundary={BOUNDARY}",
        **bearer(alice),
    )


def test_part_headers_over_djangos_limit_get_a_400(alice) -> None:
    huge = 'Content-Disposition: form-data; name="file"; filename="a.txt"\r\nX-Pad: ' + "x" * 20_000
    response = _post(alice, _multipart(huge))
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "bad_request"
    assert "could not be read" in response.json()["message"]


def test_too_many_fields_get_a_400(alice, settings) -> None:
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 3
    parts = "".join(
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="f{n}"\r\n\r\nv\r\n'
        for n in range(5)
    )
    response = _post(alice, f"{parts}--{BOUNDARY}--\r\n".encode())
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "bad_request"
