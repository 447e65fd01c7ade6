"""In a real browser (headless Chromium on the ASGI server, a stand-in worker giving the real
worker's verdict): a cited sentence is highlighted whole, with its decimal ("48.2") and its
e-mail address, and the passage panel scrolls to it; an answer no passage supports shows
"not found" alone, the model's words folded away and marked, never both as the answer.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.browser import (
    ask,
    log_in,
    needs_chromium,
    open_citation,
    screenshot,
    start_chromium,
    start_phone,
)
from tests.webapp.api.fake_worker import FakeInferenceWorker
from tests.webapp.chat.test_chat import make_document
from webapp.chat.models import Conversation
from webapp.redis import redis_client

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]

QUEUE = "inference-verdict-test"  # the stand-in's own: a real worker of the session never takes it
REVENUE = "The cooperative reported revenue of 48.2 million euros in 2024."
HELPDESK = "Questions about the annual report go to helpdesk@brightwater.coop by e-mail."
TIMETABLES = "Timetables are at https://brightwater.coop/timetables/summer-winter-2025 in March."
# A file's name as its title, longer than the desktop panel is wide, as a new user's often is.
TITLE = "brightwater_ferry_cooperative_annual_report_2025.pdf"
# One passage, taller than the panel: the cited sentences come after a screenful of others.
PASSAGE = " ".join(
    [
        f"The ferry {name} sails from the harbour of Brightwater every morning, on Sundays too."
        for name in (
            "Gannet",
            "Osprey",
            "Skua",
            "Tern",
            "Fulmar",
            "Petrel",
            "Puffin",
            "Eider",
            "Shag",
            "Gull",
            "Heron",
            "Kittiwake",
        )
    ]
    + [REVENUE, HELPDESK, "The cooperative has members in every harbour town.", TIMETABLES]
)


@pytest.fixture
def worker():
    with FakeInferenceWorker(redis_client(), queue=QUEUE, judged=True, record=True) as fake:
        yield fake


@pytest.fixture
def browser():
    driver = start_chromium("--window-size=1280,560")
    yield driver
    driver.quit()


def test_highlights_whole_sentences_and_one_verdict_per_answer(
    browser, chat_server, worker, alice
) -> None:
    from selenium.webdriver.common.by import By

    make_document(alice, TITLE, [PASSAGE])
    conversation = Conversation.objects.create(owner=alice, title="Annual report")
    log_in(browser, chat_server, alice)
    browser.get(f"{chat_server}{reverse('chat:conversation', args=[conversation.id])}")
    scroller = browser.execute_script("return document.getElementById('citation-overlay')")

    worker.words = ("Revenue", " was", " 48.2", " million", " euros.")
    answer = ask(browser, "What revenue did the cooperative report in 2024?")
    assert open_citation(browser, answer) == REVENUE  # not "... revenue of 48."
    assert browser.execute_script("return arguments[0].scrollTop", scroller) > 0
    # the file name and the URL break inside the panel (they ran past its right edge)
    widths = "return [arguments[0].scrollWidth, arguments[0].clientWidth]"
    scroll_width, client_width = browser.execute_script(widths, scroller)
    assert scroll_width <= client_width, (scroll_width, client_width)
    screenshot(browser, "highlight-decimal.png")

    worker.words = ("Write", " to", " helpdesk@brightwater.coop.")
    answer = ask(browser, "Which e-mail address takes questions about the annual report?")
    assert open_citation(browser, answer) == HELPDESK  # not "... helpdesk@brightwater."

    worker.words = ("The", " answer", " is:", " 4")
    answer = ask(browser, "How many ferries sail from Brightwater on Sundays?")
    bubble = answer.find_element(By.CSS_SELECTOR, ".bubble")
    assert "could not find this in your documents" in bubble.text
    assert "The answer is: 4" not in bubble.text  # folded away, not beside the verdict
    assert not answer.find_elements(By.CSS_SELECTOR, "a.cite, .sources-label")
    bubble.find_element(By.CSS_SELECTOR, "details.withheld summary").click()
    withheld = bubble.find_element(By.CSS_SELECTOR, ".withheld-text")
    assert withheld.text == "The answer is: 4"
    assert "not an answer" in bubble.find_element(By.CSS_SELECTOR, "details.withheld").text
    screenshot(browser, "verdict-not-found.png")


@pytest.fixture
def phone():
    driver = start_phone()
    yield driver
    driver.quit()


def test_on_a_phone_the_panel_scrolls_to_the_highlight_and_close_stays_in_sight(
    phone, chat_server, worker, alice
) -> None:
    """The panel, an overlay over the bottom of the screen, scrolls to the cited sentence;
    its Close button stays at its top rather than scroll away with the passage's start."""
    from selenium.webdriver.common.by import By

    make_document(alice, TITLE, [PASSAGE])
    conversation = Conversation.objects.create(owner=alice, title="Annual report")
    log_in(phone, chat_server, alice)
    phone.get(f"{chat_server}{reverse('chat:conversation', args=[conversation.id])}")
    overlay = phone.find_element(By.ID, "citation-overlay")

    worker.words = ("Write", " to", " helpdesk@brightwater.coop.")
    answer = ask(phone, "Which e-mail address takes questions about the annual report?")
    assert open_citation(phone, answer) == HELPDESK
    assert phone.execute_script("return arguments[0].scrollTop", overlay) > 0  # scrolled
    close = overlay.find_element(By.CSS_SELECTOR, ".panel-close")
    in_sight = phone.execute_script(
        "const c = arguments[0].getBoundingClientRect(), p = arguments[1].getBoundingClientRect();"
        "return c.top >= p.top - 1 && c.bottom <= p.bottom + 1",
        close,
        overlay,
    )
    screenshot(phone, "highlight-phone.png")
    assert in_sight
    assert phone.execute_script(
        "return arguments[0].scrollWidth <= arguments[0].clientWidth", overlay
    )
    close.click()
    assert not overlay.is_displayed()
