from __future__ import annotations

import pytest
import redis
from django.conf import settings

from kvservice.protocol import INFERENCE_QUEUE


@pytest.fixture
def queue():
    """The shared inference queue, emptied before and after (no inference worker runs)."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(INFERENCE_QUEUE)
    yield client
    client.delete(INFERENCE_QUEUE)
