"""The web app's Redis clients (token streams, stop flags, heartbeats), created lazily."""

from __future__ import annotations

from functools import cache

import redis
import redis.asyncio
from django.conf import settings

# An answer's readers block in XREAD at most this long per call, then check their deadline.
STREAM_BLOCK_MS = 5000
# The socket of a client that blocks in XREAD must wait longer than the block, or the read
# ends as a ``TimeoutError`` before Redis answers (redis-py's default socket timeout is 5 s).
STREAM_SOCKET_TIMEOUT_S = STREAM_BLOCK_MS / 1000 + 10


@cache
def redis_client() -> redis.Redis:
    """The shared sync client, for short commands (no blocking reads)."""
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=3)


def async_redis_client() -> redis.asyncio.Redis:
    """A new asyncio client for reading an answer's stream (one per streaming response:
    asyncio clients are loop-bound); its reads may block up to ``STREAM_BLOCK_MS``."""
    return redis.asyncio.Redis.from_url(
        settings.REDIS_URL, socket_connect_timeout=3, socket_timeout=STREAM_SOCKET_TIMEOUT_S
    )
