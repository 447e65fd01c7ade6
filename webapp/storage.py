"""The web app's one S3 client (documents bucket), created lazily from settings."""

from __future__ import annotations

from functools import cache

from django.conf import settings
from minio import Minio
from urllib3 import PoolManager, Retry, Timeout


@cache
def object_store() -> Minio:
    http = PoolManager(
        timeout=Timeout(connect=3, read=30),
        retries=Retry(total=2, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
        maxsize=16,
    )
    return Minio(
        settings.S3_ENDPOINT,
        access_key=settings.S3_ACCESS_KEY,
        secret_key=settings.S3_SECRET_KEY,
        secure=settings.S3_SECURE,
        http_client=http,
    )
