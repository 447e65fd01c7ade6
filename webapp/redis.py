"""The web app's Redis clients (token streams, stop flags, heartbeats), created lazily."""

from __future__ import annotations

from functools import cache

import redis
import redis.asyncio
from django.conf import settings


@cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=3)


def async_redis_client() -> redis.asyncio.Redis:
    """A new asyncio client (one per streaming response: asyncio clients are loop-bound)."""
    return redis.asyncio.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=3)
