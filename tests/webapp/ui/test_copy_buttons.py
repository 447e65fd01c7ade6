"""What is shown once is copied with one click (headless Chromium): a new API key, beside the
settings an OpenAI client needs (base URL and model), and a new invite link.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import pytest

from tests.browser import click_and_wait_for_next_page, log_in, needs_chromium, screenshot
from tests.conftest import wait_for
from tests.webapp.dashboard.test_browser import browser  # noqa: F401 - a fixture
from webapp.accounts.models import ApiKey

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]


def _copied(driver, base_url: str, selector: str) -> str:
    """Click the Copy button at ``selector``; what the clipboard then holds."""
    from selenium.webdriver.common.by import By

    permissions = ["clipboardReadWrite", "clipboardSanitizedWrite"]
    driver.execute_cdp_cmd(
        "Browser.grantPermissions", {"origin": base_url, "permissions": permissions}
    )
    button = driver.find_element(By.CSS_SELECTOR, selector)
    button.click()
    wait_for(lambda: button.text == "Copied", timeout=5, what="the copy to be confirmed")
    wait_for(lambda: button.text == "Copy", timeout=5, what="the button's label back")
    return driver.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0], e => arguments[0]('! ' + e))"
    )


def test_a_new_api_key_is_copied_and_the_page_says_how_to_connect(
    browser,  # noqa: F811 - the fixture imported above
    live_server,
    alice,  # noqa: F811
) -> None:
    from selenium.webdriver.common.by import By

    log_in(browser, live_server.url, alice)
    browser.get(f"{live_server.url}/accounts/api-keys/")
    settings = browser.find_element(By.ID, "openai-settings").text
    assert f"base URL {live_server.url}/v1" in settings and "model ragblend" in settings
    assert _copied(browser, live_server.url, "#openai-settings button.copy") == (
        f"{live_server.url}/v1"
    )
    browser.find_element(By.ID, "id_name").send_keys("report script")
    click_and_wait_for_next_page(
        browser, browser.find_element(By.CSS_SELECTOR, "form[action$='/api-keys/'] button")
    )
    shown = browser.find_element(By.ID, "new-key").text
    assert ApiKey.objects.get(user=alice).prefix in shown
    assert _copied(browser, live_server.url, ".notice button.copy") == shown
    screenshot(browser, "api-keys-copy.png")


def test_a_new_invite_link_is_copied(browser, live_server, staff) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    log_in(browser, live_server.url, staff)
    browser.get(f"{live_server.url}/accounts/invites/")
    click_and_wait_for_next_page(
        browser, browser.find_element(By.CSS_SELECTOR, "#invite-form button")
    )
    link = browser.find_element(By.ID, "invite-link").get_attribute("value")
    assert link.startswith(f"{live_server.url}/accounts/invite/")
    assert _copied(browser, live_server.url, "#new-invite button.copy") == link
