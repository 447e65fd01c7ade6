"""The browser journey on the real ASGI server (uvicorn, as `make dev` runs it) with the
real workers: log in, upload, wait for `ready`, ask, and watch the answer stream in.
A screenshot is kept in artifacts/. Needs Debian's chromium + chromium-driver."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import services
from tests.browser import needs_chromium, screenshot, start_chromium
from tests.conftest import (
    LIVE_HEARTBEAT_KEY,
    LIVE_INFERENCE_QUEUE,
    ROOT,
    _test_database_url,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    needs_chromium,
]


@contextlib.contextmanager
def running_asgi_server(django_db_blocker, log: Path, **env: str) -> Iterator[str]:
    """The app under uvicorn (as `make dev` runs it) on the test database, with ``env`` on top
    of this process's environment; yields its base URL. Django's live server is WSGI, which
    cannot stream an answer as it is written."""
    with django_db_blocker.unblock():
        database_url = _test_database_url()
    port = services.free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "webapp.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database_url, **env},
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: not services.port_is_free(port), timeout=60, what="uvicorn")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(20)


@pytest.fixture
def asgi_server(django_db_blocker, tmp_path):
    with running_asgi_server(
        django_db_blocker,
        tmp_path / "uvicorn.log",
        INFERENCE_QUEUE=LIVE_INFERENCE_QUEUE,
        HEARTBEAT_KEY=LIVE_HEARTBEAT_KEY,
    ) as url:
        yield url


@pytest.fixture
def browser():
    driver = start_chromium("--disable-background-networking", "--window-size=1300,1000")
    yield driver
    driver.quit()


def test_log_in_upload_ask_and_watch_the_answer_stream(
    celery_worker_process,
    inference_worker_process,
    asgi_server,
    browser,
    django_user_model,
    tmp_path,
) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    django_user_model.objects.create_user(username="carol", password="carol-passphrase")
    browser.get(f"{asgi_server}/accounts/login/")
    browser.find_element(By.ID, "id_username").send_keys("carol")
    browser.find_element(By.ID, "id_password").send_keys("carol-passphrase")
    browser.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    wait_for(lambda: "/chat/" in browser.current_url, timeout=30, what="the chat page")

    source = tmp_path / "harbour.md"
    source.write_text(
        "# Port Vellin\n\nThe harbour of Port Vellin was dug in 1712 by the shipwright Tomas Orle. "
        "Its breakwater is two kilometres long and shelters forty fishing boats.\n"
    )
    browser.get(f"{asgi_server}/documents/")
    browser.find_element(By.ID, "upload-files").send_keys(str(source))  # uploads it at once

    def ready() -> bool:
        rows = browser.find_elements(By.CSS_SELECTOR, "#document-list tr.status-ready")
        failed = browser.find_elements(By.CSS_SELECTOR, "#document-list tr.status-failed")
        assert not failed, failed[0].text
        return bool(rows)

    wait_for(ready, timeout=240, interval=1, what="the document to be ready in the list")

    browser.get(f"{asgi_server}/chat/")
    browser.find_element(By.CSS_SELECTOR, "form[action='/chat/new'] button").click()
    wait_for(lambda: browser.find_elements(By.ID, "ask-form"), timeout=30, what="a conversation")
    from selenium.webdriver.common.keys import Keys

    # Enter sends the question (Shift+Enter would add a line).
    question = browser.find_element(By.NAME, "question")
    question.send_keys("Who dug the harbour of Port Vellin?")
    question.send_keys(Keys.ENTER)
    ask = browser.find_element(By.CSS_SELECTOR, "#ask-form button[type=submit]")
    wait_for(
        lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"),
        timeout=30,
        what="the question to be sent by Enter",
    )
    assert ask.get_attribute("disabled") is not None  # no second question while it streams

    # While the answer is open, its text grows token by token.
    seen_lengths: list[int] = []

    def finished() -> bool:
        streaming = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .bubble.streaming")
        if streaming:
            try:
                seen_lengths.append(len(streaming[0].text))
            except StaleElementReferenceException:  # htmx swapped the finished message in
                pass
            return False
        return bool(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-status=done]"))

    wait_for(finished, timeout=240, interval=0.05, what="the streamed answer")
    partial = [n for n in seen_lengths if n > 0]
    assert len(set(partial)) >= 2, f"no partial text was seen while streaming: {seen_lengths[-20:]}"

    answer = browser.find_element(By.CSS_SELECTOR, ".msg.assistant[data-status=done]")
    assert answer.find_element(By.CSS_SELECTOR, ".bubble").text.strip()
    wait_for(lambda: ask.get_attribute("disabled") is None, timeout=10, what="Ask enabled again")
    assert "harbour.md" in answer.find_element(By.CSS_SELECTOR, ".citations").text
    assert "First words after" in answer.find_element(By.CSS_SELECTOR, ".metrics").text
    assert screenshot(browser, "chat-answer.png").stat().st_size > 10_000
