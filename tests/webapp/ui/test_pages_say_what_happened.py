"""The documents and collection pages say what happened, in a real browser (headless
Chromium): choosing files uploads them at once and says so, with no Upload button left to
press (it answered "Choose one or more files"); a collection's Save documents and Share each
confirm what was saved.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.browser import click_and_wait_for_next_page, needs_chromium, screenshot
from tests.webapp.chat.test_chat import PASSAGES, make_document
from tests.webapp.dashboard.test_browser import _log_in, browser  # noqa: F401 - a fixture
from webapp.documents.models import Collection
from webapp.documents.services import collection_create

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]


def test_choosing_files_uploads_them_and_says_so(browser, live_server, alice, tmp_path) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    paths = [tmp_path / "harbour.txt", tmp_path / "canals.md"]
    paths[0].write_text("The harbour of Velmont was dug in 1764.\n")
    paths[1].write_text("# Canals\n\nThe canal to Orsk opened in 1802.\n")
    _log_in(browser, live_server, alice)
    browser.get(f"{live_server.url}{reverse('documents:list')}")
    # No Upload button to press after choosing (it only said "Choose one or more files").
    assert not browser.find_element(By.ID, "upload-button").is_displayed()
    hint = browser.find_element(By.ID, "upload-hint")
    assert hint.is_displayed() and hint.text == "Files upload as soon as they are chosen."
    browser.find_element(By.ID, "upload-files").send_keys("\n".join(map(str, paths)))
    notice = WebDriverWait(browser, 15).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, "#upload-notices .uploaded")
    )[0]
    assert notice.text.startswith("Uploaded harbour.txt, canals.md: they are being prepared")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#document-list tbody tr")) == 2
    assert "Choose one or more files" not in browser.find_element(By.TAG_NAME, "body").text
    screenshot(browser, "documents-uploaded.png")


def test_save_documents_and_share_say_what_was_saved(browser, live_server, alice, bob) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    make_document(alice, "space.md", [PASSAGES["space"]])
    make_document(alice, "rivers.md", [PASSAGES["rivers"]])
    collection = collection_create(owner=alice, name="Science")
    _log_in(browser, live_server, alice)
    browser.get(f"{live_server.url}{reverse('documents:collection', args=[collection.id])}")

    def saved_and_said(selector: str) -> str:
        click_and_wait_for_next_page(browser, browser.find_element(By.CSS_SELECTOR, selector))
        return browser.find_element(By.CSS_SELECTOR, ".messages .success").text

    for title in ("space.md", "rivers.md"):
        browser.find_element(By.XPATH, f"//label[contains(., '{title}')]/input").click()
    said = saved_and_said("#collection-documents button")
    assert said == "Saved: “Science” holds 2 documents."
    browser.find_element(By.ID, "share-usernames").send_keys("bob")
    said = saved_and_said("#collection-share button")
    assert said == "Saved: shared read-only with bob."
    screenshot(browser, "collection-saved.png")
    browser.find_element(By.ID, "share-usernames").clear()
    said = saved_and_said("#collection-share button")
    assert said == "Saved: shared with nobody, only you can see this collection."
    science = Collection.objects.get(pk=collection.pk)
    assert science.documents.count() == 2 and not science.shared_with.exists()
