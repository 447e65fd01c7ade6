"""The API's docs page (/api/v1/docs, Swagger UI, vendored) in a real browser: it renders every
operation of the schema and logs no error to the console (it refused the schema once, for two
"200" keys under one operation), and fits a 390 px phone (django-ninja's page has no viewport
tag: a phone laid it out 980 px wide).

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import json

import pytest

from tests.browser import needs_chromium, screenshot, start_chromium, start_phone
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
        lambda: logging_browser.find_elements(By.CSS_SELECTOR, ".opblock"),
        timeout=30,
        what="Swagger UI's operations",
    )
    assert len(blocks) == operations
    assert not logging_browser.find_elements(By.CSS_SELECTOR, ".errors-wrapper")
    errors = [e for e in logging_browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    screenshot(logging_browser, "api-docs.png")


@pytest.fixture
def phone():
    # A phone's browser: a page without a viewport meta tag is laid out 980 px wide and
    # zoomed out, and one wider than the screen grows the layout viewport to fit it.
    driver = start_phone(scale=3, mobile=True)
    yield driver
    driver.quit()


def test_the_api_docs_fit_a_phone_with_every_operation_open(phone, live_server) -> None:
    from selenium.webdriver.common.by import By

    phone.get(f"{live_server.url}/api/v1/docs")
    blocks = wait_for(
        lambda: phone.find_elements(By.CSS_SELECTOR, ".opblock"),
        timeout=30,
        what="Swagger UI's operations",
    )
    for block in blocks:  # each with its parameters, body and responses
        phone.execute_script("arguments[0].scrollIntoView()", block)
        block.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
    wait_for(
        lambda: len(phone.find_elements(By.CSS_SELECTOR, ".responses-wrapper")) == len(blocks),
        timeout=20,
        what="every operation to open",
    )
    widths = phone.execute_script(
        "return [document.scrollingElement.scrollWidth, window.innerWidth]"
    )
    screenshot(phone, "mobile-api-docs.png")
    assert widths == [390, 390], f"laid out at {widths[1]} px, {widths[0]} px wide"


def test_the_api_docs_lead_back_to_the_product_and_follow_dark_mode(
    logging_browser, live_server
) -> None:
    from selenium.webdriver.common.by import By

    luminance = (  # of the body's background, 0 (black) to 1 (white)
        "const [r, g, b] = getComputedStyle(document.body).backgroundColor.match(/\\d+/g)"
        ".map(Number); return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255;"
    )
    logging_browser.get(f"{live_server.url}/api/v1/docs")
    back = logging_browser.find_element(By.CSS_SELECTOR, "#api-docs-bar a[href='/']")
    assert "Back to Ragblend" in back.text and back.is_displayed()
    assert logging_browser.find_element(By.CSS_SELECTOR, "#api-docs-bar a[href$='/api-keys/']")
    assert logging_browser.execute_script(luminance) > 0.9  # light while the system is

    logging_browser.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": "dark"}]},
    )
    logging_browser.get(f"{live_server.url}/api/v1/docs")
    wait_for(
        lambda: logging_browser.find_elements(By.CSS_SELECTOR, ".opblock"),
        timeout=30,
        what="Swagger UI's operations",
    )
    assert logging_browser.execute_script(luminance) < 0.15
    swagger = logging_browser.find_element(By.ID, "swagger-ui")
    assert "invert" in swagger.value_of_css_property("filter")  # its light page, inverted
    screenshot(logging_browser, "api-docs-dark.png")
