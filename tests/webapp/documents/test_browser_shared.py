"""A document shared with bob, in a real browser (headless Chromium, #18): from the shared
collection he opens its page and reads it, with nothing to change; the original downloads;
at a phone's width (390 px) the page is no wider than the screen. Screenshots are kept in
artifacts/.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import hashlib
import io

import pytest
from django.conf import settings

from tests.browser import log_in, needs_chromium, screenshot
from tests.webapp.dashboard.test_browser import browser  # noqa: F401 - a fixture
from tests.webapp.ui.test_mobile import _overflow, phone  # noqa: F401 - phone is a fixture
from webapp.documents import services
from webapp.documents.models import Chunk, Collection, Document
from webapp.documents.services import original_object_key
from webapp.storage import object_store

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]

TITLE = "The harbours, canals and lighthouses of the northern coast, a handbook.md"
PASSAGES = [
    "The harbour of Velmont was dug in 1764 by the guild of rope makers, who also kept its "
    "lighthouse lit through the winter storms.",
    "Canal locks on the northern coast open two hours either side of high water; "
    "a_very_long_unbroken_identifier_that_must_wrap_on_a_phone_screen_0123456789.",
]
ORIGINAL = "\n\n".join(PASSAGES).encode()


def _shared_document(alice, bob) -> tuple[Document, Collection]:
    """Alice's ready document, its original in the real object store, in a collection she
    shares with bob."""
    sha = hashlib.sha256(ORIGINAL).hexdigest()
    key = original_object_key(owner_id=alice.pk, content_sha256=sha)
    object_store().put_object(
        settings.S3_DOCUMENTS_BUCKET, key, io.BytesIO(ORIGINAL), length=len(ORIGINAL)
    )
    document = Document.objects.create(
        owner=alice,
        title=TITLE,
        original_name="handbook.md",
        content_sha256=sha,
        object_key=key,
        size_bytes=len(ORIGINAL),
        detected_type=Document.Type.MARKDOWN,
        status=Document.Status.READY,
        stage=Document.Stage.DONE,
        progress=100,
    )
    for index, text in enumerate(PASSAGES):
        Chunk.objects.create(
            document=document,
            index=index,
            text=text,
            token_ids=[index],
            token_count=30,
            token_ids_sha256=hashlib.sha256(text.encode()).hexdigest(),
            kv_status=Chunk.KVStatus.READY,
        )
    collection = services.collection_create(owner=alice, name="Northern coast")
    collection.documents.add(document)
    services.collection_share(collection=collection, usernames=["bob"])
    return document, collection


def _fetch_status(driver, url: str) -> list:
    """The status and body length of a GET of ``url`` from the page (with its cookie)."""
    return driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0]).then(r => r.arrayBuffer().then(b => done([r.status, b.byteLength])))",
        url,
    )


def test_bob_opens_a_shared_document_read_only(browser, live_server, alice, bob, mallory) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    document, collection = _shared_document(alice, bob)
    log_in(browser, live_server.url, bob)
    browser.get(f"{live_server.url}/documents/collections/{collection.pk}/")
    browser.find_element(By.LINK_TEXT, TITLE).click()
    assert browser.find_element(By.TAG_NAME, "h1").text == TITLE
    notice = browser.find_element(By.ID, "shared-notice").text
    assert "Shared with you by alice in Northern coast, read-only" in notice
    passages = [p.text for p in browser.find_elements(By.CSS_SELECTOR, ".chunk .passage")]
    assert passages == PASSAGES
    assert browser.find_element(By.CSS_SELECTOR, ".badge.ready").text == "Ready"
    details = browser.find_element(By.CSS_SELECTOR, "#shared-notice + p").text
    assert details.startswith(f"Markdown · {len(ORIGINAL)} B ·")  # webapp.units, as the dashboard
    assert not browser.find_elements(By.ID, "document-collections")
    assert not browser.find_elements(By.CSS_SELECTOR, "form[action*='/delete']")
    assert not browser.find_elements(By.CSS_SELECTOR, "form[action*='/retry']")
    download = browser.find_element(By.CSS_SELECTOR, "a.download")
    assert _fetch_status(browser, download.get_attribute("href")) == [200, len(ORIGINAL)]
    screenshot(browser, "shared-document.png")

    browser.delete_all_cookies()  # someone it is not shared with: the styled 404
    log_in(browser, live_server.url, mallory)
    browser.get(f"{live_server.url}/documents/{document.pk}/")
    assert browser.find_element(By.ID, "error-404").is_displayed()


def test_the_shared_document_page_fits_a_phone(phone, live_server, alice, bob) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    document, _ = _shared_document(alice, bob)
    log_in(phone, live_server.url, bob)
    phone.get(f"{live_server.url}/documents/{document.pk}/")
    assert phone.find_element(By.ID, "shared-notice").is_displayed()
    width, inner = _overflow(phone)
    screenshot(phone, "phone-shared-document.png")
    assert width <= inner, (width, inner)
