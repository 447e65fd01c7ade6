"""Deadlines on every call to Redis/valkey, for both sides (the web app, its Celery workers,
the inference worker), so that a broker that stops answering without closing its connections
(a frozen process, a lost network path) costs a caller seconds, not minutes.

Measured with valkey stopped by SIGSTOP (docs/reliability.md, "Frozen services"): a Celery
send (kombu sets no socket timeout) was still waiting when valkey came back 120 s later, and
so was /healthz, whose Celery ping sends one (40-147 s in issue #48's probe); Celery's result
backend waits 120 s a try by default, 20 tries. Now:

| client | connect | each command | retries |
|---|---|---|---|
| ``redis_from_url`` (web, workers), Django's cache | 2 s | 5 s | 1, on a dropped connection |
| Celery's broker (kombu) and result backend | 2 s | 5 s | none |

A command that times out is not retried: the server got it and did not answer, and a second
wait would only double the caller's. A dropped connection (valkey restarted, a stale pooled
socket) is retried once, since the next connection usually works at once. Blocking reads
(``XREAD BLOCK``) take a command timeout longer than their block (webapp/redis.py).
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry
from redis.backoff import ExponentialBackoff

REDIS_CONNECT_TIMEOUT_S = 2.0
REDIS_COMMAND_TIMEOUT_S = 5.0
REDIS_RETRIES = 1
# Celery's publish (and result-backend) retry policy: no retry. Measured on a frozen valkey
# with the 5 s socket timeout, a send failed after 5.0 s so, 15.2 s with one retry (kombu
# reconnects before it, another wait) and 25.6 s with Celery's default of three; redis-py's
# pool already replaces a connection that dropped (valkey restarted) before using it.
CELERY_RETRY_POLICY = {
    "max_retries": 0,
    "interval_start": 0.2,
    "interval_step": 0.2,
    "interval_max": 0.2,
}
# kombu's Redis transport: without these it waits forever on a broker that does not answer.
BROKER_TRANSPORT_OPTIONS = {
    "socket_timeout": REDIS_COMMAND_TIMEOUT_S,
    "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
}


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=0.5, base=0.05)


def redis_options(command_timeout_s: float = REDIS_COMMAND_TIMEOUT_S) -> dict[str, Any]:
    """Keyword arguments for a sync client or connection pool (Django's cache takes them as
    ``OPTIONS``): the timeouts and the bounded retry of the table above."""
    retry = redis.retry.Retry(_backoff(), REDIS_RETRIES, supported_errors=(redis.ConnectionError,))
    return {
        "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
        "socket_timeout": command_timeout_s,
        "retry": retry,
    }


def redis_from_url(url: str, command_timeout_s: float = REDIS_COMMAND_TIMEOUT_S) -> redis.Redis:
    return redis.Redis.from_url(url, **redis_options(command_timeout_s))


def async_redis_from_url(
    url: str, command_timeout_s: float = REDIS_COMMAND_TIMEOUT_S
) -> redis.asyncio.Redis:
    retry = redis.asyncio.retry.Retry(
        _backoff(), REDIS_RETRIES, supported_errors=(redis.ConnectionError,)
    )
    return redis.asyncio.Redis.from_url(
        url,
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        socket_timeout=command_timeout_s,
        retry=retry,
    )


def celery_options() -> dict[str, Any]:
    """Celery settings (lowercase names) putting the deadlines on its broker connection, its
    result backend and its publishing; the web app's settings name the same values."""
    return {
        "broker_transport_options": dict(BROKER_TRANSPORT_OPTIONS),
        "redis_socket_timeout": REDIS_COMMAND_TIMEOUT_S,
        "redis_socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
        "result_backend_transport_options": {"retry_policy": dict(CELERY_RETRY_POLICY)},
        "task_publish_retry_policy": dict(CELERY_RETRY_POLICY),
    }
