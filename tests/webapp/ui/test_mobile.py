"""The pages at a phone's width (390x844, headless Chromium): nothing wider than the screen,
the nav behind a Menu button, the citation panel an overlay over the conversation.
Screenshots are kept in artifacts/.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.browser import log_in, needs_chromium, screenshot, start_phone
from tests.webapp.dashboard.factories import make_answers, make_document
from webapp.chat.models import Conversation
from webapp.documents.services import collection_create, collection_set_documents

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]


@pytest.fixture
def phone():
    driver = start_phone()
    yield driver
    driver.quit()


def _overflow(driver) -> tuple[int, int]:
    return driver.execute_script(
        "return [document.scrollingElement.scrollWidth, window.innerWidth]"
    )


def _width_of(driver, url: str, name: str) -> tuple[int, int]:
    driver.get(url)
    screenshot(driver, f"mobile-{name}.png")
    return _overflow(driver)


def test_no_page_is_wider_than_a_phone(phone, live_server, staff) -> None:
    document = make_document(staff, "A rather long title of a handbook about harbours", chunks=3)
    conversation = make_answers(staff, document)[0].conversation
    collection = collection_create(owner=staff, name="Harbour and canal handbooks of the region")
    collection_set_documents(collection=collection, document_ids=[document.id])
    widths = {"login": _width_of(phone, f"{live_server.url}{reverse('login')}", "login")}
    log_in(phone, live_server.url, staff)
    pages = {
        "password": reverse("password_change"),
        "not-found": "/documents/999999/",
        "collections": reverse("documents:collections"),
        "collection": reverse("documents:collection", args=[collection.id]),
        "chat": reverse("chat:conversation", args=[conversation.id]),
        "chat-index": reverse("chat:index"),
        "documents": reverse("documents:list"),
        "document": reverse("documents:detail", args=[document.id]),
        "dashboard": reverse("dashboard:index"),
        "api-keys": reverse("api_keys"),
        "users": reverse("users"),
    }
    for name, url in pages.items():
        widths[name] = _width_of(phone, f"{live_server.url}{url}", name)
    wide = {name: w for name, w in widths.items() if w[0] > w[1]}
    assert not wide, f"wider than the screen (scrollWidth, innerWidth): {wide}"


def test_the_menu_opens_the_nav_on_a_phone(phone, live_server, staff) -> None:
    from selenium.webdriver.common.by import By

    log_in(phone, live_server.url, staff)
    phone.get(f"{live_server.url}{reverse('documents:list')}")
    log_out = phone.find_element(By.CSS_SELECTOR, "#site-nav button")
    assert not log_out.is_displayed()
    menu = phone.find_element(By.CLASS_NAME, "nav-toggle")
    menu.click()
    assert menu.get_attribute("aria-expanded") == "true"
    assert log_out.is_displayed() and log_out.text == "Log out"
    assert log_out.rect["x"] + log_out.rect["width"] <= 390
    screenshot(phone, "mobile-menu.png")
    assert _overflow(phone)[0] <= 390


def test_a_citation_opens_over_the_conversation_on_a_phone(phone, live_server, alice) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    document = make_document(alice, "Harbour handbook", chunks=2)
    conversation = make_answers(alice, document)[0].conversation
    log_in(phone, live_server.url, alice)
    phone.get(f"{live_server.url}{reverse('chat:conversation', args=[conversation.id])}")
    overlay = phone.find_element(By.ID, "citation-overlay")
    assert not overlay.is_displayed()  # not a panel below the whole conversation
    phone.find_element(By.CSS_SELECTOR, ".also-retrieved summary").click()
    phone.find_element(By.CSS_SELECTOR, ".also-retrieved a").click()
    WebDriverWait(phone, 10).until(lambda b: overlay.is_displayed())
    WebDriverWait(phone, 10).until(lambda b: "chunk 0" in overlay.text)
    top, bottom = phone.execute_script(
        "const r = arguments[0].getBoundingClientRect(); return [r.top, r.bottom]", overlay
    )
    assert 0 <= top < bottom <= 844  # on screen, wherever the reader had scrolled to
    assert phone.switch_to.active_element == overlay  # focus follows, for the keyboard
    screenshot(phone, "mobile-citation.png")
    phone.switch_to.active_element.send_keys(Keys.ESCAPE)
    WebDriverWait(phone, 10).until(lambda b: not overlay.is_displayed())
    phone.find_element(By.CSS_SELECTOR, ".also-retrieved a").click()
    WebDriverWait(phone, 10).until(lambda b: overlay.is_displayed())
    phone.find_element(By.CSS_SELECTOR, "#citation-overlay .panel-close").click()
    assert not overlay.is_displayed()


def test_searching_conversations_shows_the_results_on_a_phone(phone, live_server, alice) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    harbour = make_answers(alice)[0].conversation
    other = make_answers(alice)[0].conversation
    Conversation.objects.filter(pk=harbour.pk).update(title="Harbour dues")
    log_in(phone, live_server.url, alice)
    phone.get(f"{live_server.url}{reverse('chat:conversation', args=[other.id])}")
    listed = phone.find_element(By.ID, "conversation-list")
    assert not listed.is_displayed()  # folded on a phone
    phone.find_element(By.ID, "search-q").send_keys("harbour")
    WebDriverWait(phone, 10).until(
        lambda b: (
            [a.text for a in b.find_elements(By.CSS_SELECTOR, "#conversation-list a")]
            == ["Harbour dues"]
        )
    )
    assert phone.find_element(By.LINK_TEXT, "Harbour dues").is_displayed()
