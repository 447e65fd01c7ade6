"""Collections, scopes and conversation management in a real browser (headless Chromium):
alice groups a document into a collection and shares it with bob; bob scopes a conversation
to it; alice renames, searches for and deletes a conversation; the pages fit a phone.
Screenshots are kept in artifacts/.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import pytest

from tests.browser import click_and_wait_for_next_page, needs_chromium, screenshot
from tests.webapp.chat.test_chat import PASSAGES, make_document
from tests.webapp.dashboard.test_browser import _log_in, browser  # noqa: F401 - a fixture
from tests.webapp.ui.test_mobile import _overflow, phone  # noqa: F401 - phone is a fixture
from webapp.chat.models import Conversation, Message
from webapp.documents.models import Collection

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]


def _text(driver, selector: str) -> list[str]:
    """The text of each element matching ``selector``, read at once (htmx may swap them)."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent.trim())",
        selector,
    )


def _submit(driver, selector: str) -> None:
    """Click a form's button and wait for the page it loads."""
    from selenium.webdriver.common.by import By

    click_and_wait_for_next_page(driver, driver.find_element(By.CSS_SELECTOR, selector))


def _wait(driver, condition, timeout: float = 15):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(condition)


def test_a_collection_shared_with_bob_scopes_his_conversation(
    browser,  # noqa: F811
    live_server,
    alice,
    bob,  # noqa: F811
) -> None:
    from selenium.webdriver.common.by import By

    make_document(alice, "space.md", [PASSAGES["space"]])
    make_document(alice, "rivers.md", [PASSAGES["rivers"]])
    _log_in(browser, live_server, alice)
    browser.get(f"{live_server.url}/documents/")
    browser.find_element(By.ID, "collections-link").click()
    browser.find_element(By.ID, "collection-name").send_keys("Science")
    _submit(browser, "#collection-create button")
    assert browser.find_element(By.TAG_NAME, "h1").text == "Science"
    browser.find_element(By.XPATH, "//label[contains(., 'space.md')]/input").click()
    _submit(browser, "#collection-documents button")
    browser.find_element(By.ID, "share-usernames").send_keys("bob")
    _submit(browser, "#collection-share button")
    screenshot(browser, "collection-owner.png")
    science = Collection.objects.get(owner=alice, name="Science")
    assert [d.title for d in science.documents.all()] == ["space.md"]
    assert [u.username for u in science.shared_with.all()] == ["bob"]

    browser.delete_all_cookies()
    _log_in(browser, live_server, bob)
    browser.get(f"{live_server.url}/chat/")
    _submit(browser, "form[action='/chat/new'] button")
    browser.find_element(By.CSS_SELECTOR, "#scope summary").click()
    browser.find_element(By.XPATH, "//label[contains(., 'shared by alice')]/input").click()
    browser.find_element(By.CSS_SELECTOR, "#scope-form button").click()
    _wait(browser, lambda b: _text(b, "#scope-names") == ["Science"])
    screenshot(browser, "conversation-scope.png")
    conversation = Conversation.objects.get(owner=bob)
    assert conversation.scope.collection_ids == {science.pk}


def test_rename_search_and_delete_a_conversation(browser, live_server, alice) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    for title, said in (("Harbours", "Who dug the Velmont harbour?"), ("Risotto", "Rice?")):
        conversation = Conversation.objects.create(owner=alice, title=title)
        Message.objects.create(conversation=conversation, role="user", content=said)
    harbours = Conversation.objects.get(title="Harbours")
    _log_in(browser, live_server, alice)
    browser.get(f"{live_server.url}/chat/{harbours.id}/")

    browser.find_element(By.CSS_SELECTOR, ".conversation-menu summary").click()
    title = browser.find_element(By.ID, "rename-title")
    title.clear()
    title.send_keys("Velmont harbour")
    _submit(browser, "#rename-form button")
    assert browser.find_element(By.ID, "conversation-title").text == "Velmont harbour"

    browser.find_element(By.ID, "search-q").send_keys("velmont")  # in a question, not a title
    _wait(browser, lambda b: _text(b, "#conversation-list li") == ["Velmont harbour"])
    screenshot(browser, "conversation-search.png")

    browser.find_element(By.CSS_SELECTOR, ".conversation-menu summary").click()
    browser.find_element(By.CSS_SELECTOR, "#delete-form button").click()
    alert = _wait(browser, lambda b: b.switch_to.alert)
    assert "cannot be undone" in alert.text
    alert.accept()
    _wait(browser, lambda b: b.current_url.endswith("/chat/"))
    assert not Conversation.objects.filter(pk=harbours.pk).exists()
    assert "Deleted “Velmont harbour”." in browser.find_element(By.CSS_SELECTOR, ".messages").text


def test_collections_and_the_scope_panel_fit_a_phone(phone, live_server, alice, bob) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    document = make_document(
        alice, "A rather long title of a handbook about harbours.md", [PASSAGES["rivers"]]
    )
    collection = Collection.objects.create(owner=alice, name="Harbours and lighthouses north")
    collection.documents.add(document)
    conversation = Conversation.objects.create(owner=alice, title="A long conversation title " * 4)
    _log_in(phone, live_server, alice)
    for name, path in (
        ("collections", "/documents/collections/"),
        ("collection", f"/documents/collections/{collection.pk}/"),
        ("conversation", f"/chat/{conversation.id}/"),
    ):
        phone.get(f"{live_server.url}{path}")
        if name == "conversation":  # with its menus open
            phone.find_element(By.CSS_SELECTOR, "#scope summary").click()
            phone.find_element(By.CSS_SELECTOR, ".conversation-menu summary").click()
        width, inner = _overflow(phone)
        screenshot(phone, f"phone-{name}.png")
        assert width <= inner, (name, width, inner)
