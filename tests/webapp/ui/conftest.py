"""The browser tests' web server: questions go to the test module's own ``QUEUE``, which its
stand-in worker serves (a real inference worker of the session never takes it)."""

from __future__ import annotations

import pytest

from tests.e2e.test_browser_chat import running_asgi_server


@pytest.fixture
def chat_server(request, django_db_blocker, tmp_path):
    queue = request.module.QUEUE
    with running_asgi_server(
        django_db_blocker,
        tmp_path / "uvicorn.log",
        INFERENCE_QUEUE=queue,
        HEARTBEAT_KEY=f"ragblend:test:{queue}",
    ) as url:
        yield url
