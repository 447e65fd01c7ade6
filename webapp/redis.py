"""The web app's Redis clients (token streams, stop flags, heartbeats), created lazily, with
the deadlines of ``kvservice.protocol.deadlines`` (2 s to connect, 5 s a command, no retry of a
timeout): a frozen valkey costs a request one command timeout, then a 503."""

from __future__ import annotations

from functools import cache

import redis
import redis.asyncio
from django.conf import settings

from kvservice.protocol.deadlines import (
    REDIS_COMMAND_TIMEOUT_S,
    async_redis_from_url,
    redis_from_url,
)

# An answer's readers block in XREAD at most this long per call, then check their deadline.
STREAM_BLOCK_MS = 5000
# The socket of a client that blocks in XREAD must wait longer than the block, or the read
# ends as a ``TimeoutError`` before Redis answers: the block, then a command's own deadline.
# A frozen valkey then ends an answer's stream 10 s into its read (it took 15 s with 10 s
# over the block), with an error event for the client (webapp.api, webapp.chat.views).
STREAM_SOCKET_TIMEOUT_S = STREAM_BLOCK_MS / 1000 + REDIS_COMMAND_TIMEOUT_S


@cache
def redis_client() -> redis.Redis:
    """The shared sync client, for short commands (no blocking reads)."""
    return redis_from_url(settings.REDIS_URL, REDIS_COMMAND_TIMEOUT_S)


def async_redis_client() -> redis.asyncio.Redis:
    """A new asyncio client for reading an answer's stream (one per streaming response:
    asyncio clients are loop-bound); its reads may block up to ``STREAM_BLOCK_MS``."""
    return async_redis_from_url(settings.REDIS_URL, STREAM_SOCKET_TIMEOUT_S)
