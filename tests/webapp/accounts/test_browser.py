"""Accounts, documents and error pages in a real browser (headless Chromium): the nav's
Password link changes the password, a non-staff user sees the styled 403, a re-upload says
the file is already there. Screenshots are kept as test artifacts.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import time

import pytest
from django.urls import reverse

from tests.browser import click_and_wait_for_next_page, needs_chromium, screenshot
from tests.webapp.dashboard.test_browser import _log_in, browser  # noqa: F401 - a fixture

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]


def test_password_change_from_the_nav(browser, live_server, alice) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    _log_in(browser, live_server, alice)
    browser.get(f"{live_server.url}{reverse('documents:list')}")
    click_and_wait_for_next_page(browser, browser.find_element(By.LINK_TEXT, "Password"))
    assert browser.find_element(By.TAG_NAME, "h1").text == "Change password"
    browser.find_element(By.ID, "id_old_password").send_keys("pw-alice-123")
    browser.find_element(By.ID, "id_new_password1").send_keys("Harbour-lights-77")
    browser.find_element(By.ID, "id_new_password2").send_keys("Harbour-lights-77")
    screenshot(browser, "password-change.png")
    submit = browser.find_element(By.CSS_SELECTOR, "#password-change-form button")
    click_and_wait_for_next_page(browser, submit)  # not the old page's heading (under load)
    assert browser.find_element(By.TAG_NAME, "h1").text == "Password changed"
    alice.refresh_from_db()
    assert alice.check_password("Harbour-lights-77")


def test_non_staff_dashboard_is_a_styled_403(browser, live_server, alice) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    _log_in(browser, live_server, alice)
    browser.get(f"{live_server.url}{reverse('dashboard:index')}")
    card = browser.find_element(By.ID, "error-403")
    assert browser.find_element(By.TAG_NAME, "h1").text == "Not allowed"
    # app.css applied: the card has its border radius, the nav its links.
    assert card.value_of_css_property("border-top-left-radius") == "10px"
    assert browser.find_element(By.LINK_TEXT, "Documents").is_displayed()
    screenshot(browser, "error-403.png")


def test_reupload_says_it_is_already_there(browser, live_server, alice, tmp_path) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    path = tmp_path / "handbook.txt"
    path.write_text("The harbour of Velmont was dug in 1764.\n")
    _log_in(browser, live_server, alice)
    browser.get(f"{live_server.url}{reverse('documents:list')}")
    for _ in range(2):  # choosing a file uploads it through htmx (documents.js)
        browser.find_element(By.ID, "upload-files").send_keys(str(path))
        WebDriverWait(browser, 15).until(
            lambda b: (
                b.find_elements(By.CSS_SELECTOR, "#document-list table.documents")
                and not b.find_element(By.ID, "upload-files").get_attribute("value")
            )
        )
    notice = WebDriverWait(browser, 15).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, "#upload-notices .duplicate")
    )[0]
    assert "“handbook.txt” is already here" in notice.text
    assert len(browser.find_elements(By.CSS_SELECTOR, "#document-list tbody tr")) == 1
    assert browser.find_element(By.CSS_SELECTOR, "#document-list td.uploaded").text
    assert browser.find_element(By.CSS_SELECTOR, "#document-list a.download").is_displayed()
    time.sleep(2.5)  # the list's poll (the document waits for a worker) keeps the notice
    assert browser.find_element(By.CSS_SELECTOR, "#upload-notices .duplicate").is_displayed()
    screenshot(browser, "documents-duplicate.png")
