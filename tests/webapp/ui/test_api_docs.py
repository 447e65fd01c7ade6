"""The API's docs page (/api/v1/docs, Swagger UI, vendored) in a real browser: it renders every
operation of the schema and logs no error to the console (it refused the schema once, for two
"200" keys under one operation).

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import json

import pytest

from tests.browser import needs_chromium, screenshot, start_chromium
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]


@pytest.fixture
def logging_browser():
    driver = start_chromium(console_log=True)
    yield driver
    driver.quit()


def test_the_api_docs_render_every_operation_without_a_console_error(
    logging_browser, live_server, client
) -> None:
    from selenium.webdriver.common.by import By

    schema = json.loads(client.get("/api/v1/openapi.json").content)
    operations = sum(len(methods) for methods in schema["paths"].values())
    logging_browser.get(f"{live_server.url}/api/v1/docs")
    blocks = wait_for(
        lambda: logging_browser.find_elements(By.CSS_SELECTOR, ".opblock"), timeout=30,
        what="Swagger UI's operations",
    )  # fmt: skip
    assert len(blocks) == operations
    assert not logging_browser.find_elements(By.CSS_SELECTOR, ".errors-wrapper")
    errors = [e for e in logging_browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    screenshot(logging_browser, "api-docs.png")
