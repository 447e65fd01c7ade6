"""The web app's one S3 client (documents bucket), created lazily from settings.

Its deadlines keep a web request that needs S3 to a few seconds when the gateway stops
answering (a frozen process still accepts connections, and never replies): an upload or a
delete then answers in about ``S3_READ_TIMEOUT_S`` (5 s), where three tries of 30 s each
took 90.5 s (docs/reliability.md, "Frozen services").

- connect, 2 s: a local gateway connects in milliseconds, a dead one refuses at once.
  urllib3 keeps this timeout on the socket while it sends a body, so a send blocked for
  2 s (the gateway stopped reading) fails too; a 25 MB upload is sent in pieces, each well
  within it.
- read, 5 s: the wait for each read of the reply, not for the whole body.
- retries, one, after a failed connection or a 5xx (0.2 s later). A read that timed out is
  not retried: the gateway has the request and did not answer, and a second wait would
  double the caller's.
"""

from __future__ import annotations

from functools import cache

from django.conf import settings
from minio import Minio
from urllib3 import PoolManager, Retry, Timeout

S3_CONNECT_TIMEOUT_S = 2.0
S3_READ_TIMEOUT_S = 5.0


def s3_retry() -> Retry:
    return Retry(
        total=1,
        connect=1,
        read=0,
        status=1,
        backoff_factor=0.2,
        status_forcelist=[500, 502, 503, 504],
    )


@cache
def object_store() -> Minio:
    http = PoolManager(
        timeout=Timeout(connect=S3_CONNECT_TIMEOUT_S, read=S3_READ_TIMEOUT_S),
        retries=s3_retry(),
        maxsize=16,
    )
    return Minio(
        settings.S3_ENDPOINT,
        access_key=settings.S3_ACCESS_KEY,
        secret_key=settings.S3_SECRET_KEY,
        secure=settings.S3_SECURE,
        http_client=http,
    )
