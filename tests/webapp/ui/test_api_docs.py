"""The API's docs page (/api/v1/docs, Swagger UI, vendored) in a real browser: it renders every
operation of the schema and logs no error to the console (it refused the schema once, for two
"200" keys under one operation).

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import wait_for
from tests.webapp.dashboard.test_browser import ARTIFACTS, CHROMIUM

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not CHROMIUM.exists() or not shutil.which("chromedriver"),
        reason="headless Chromium is not installed: apt-get install -y chromium chromium-driver",
    ),
]


@pytest.fixture
def logging_browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install -e '.[dev]'")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1280,1000"):  # fmt: skip
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    driver.set_page_load_timeout(60)
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
    ARTIFACTS.mkdir(exist_ok=True)
    assert logging_browser.save_screenshot(str(ARTIFACTS / "api-docs.png"))
