"""The inference worker's heartbeat in Redis: it proves the worker is alive and says which
model it has loaded. The worker writes it every few seconds with a TTL, so a dead worker's
entry disappears on its own; /healthz and the dashboard read it."""

from __future__ import annotations

import json
import time
from typing import Any

from kvservice.protocol import environment

HEARTBEAT_KEY = environment.variable("HEARTBEAT_KEY").default  # ragblend:inference:heartbeat
HEARTBEAT_INTERVAL_S = 5.0
HEARTBEAT_TTL_S = 20


def heartbeat_key() -> str:
    """The Redis key; ``HEARTBEAT_KEY`` in the environment names another (two workers on
    one Redis that must not be confused, as in the test suite)."""
    return environment.read("HEARTBEAT_KEY")


def write_heartbeat(client: Any, key: str | None = None, **status: Any) -> None:
    """``key``: the worker's (``WorkerConfig.heartbeat_key``), else ``heartbeat_key()``."""
    payload = {"ts": time.time(), **status}
    client.set(key or heartbeat_key(), json.dumps(payload), ex=HEARTBEAT_TTL_S)


def read_heartbeat(client: Any) -> dict[str, Any] | None:
    """The last heartbeat, or None when the worker has not written one within the TTL."""
    raw = client.get(heartbeat_key())
    return json.loads(raw) if raw else None
