"""The chat page with the keyboard and a streaming answer, in a real browser (headless
Chromium) on the ASGI server, a stand-in worker streaming a slow answer through Redis:
Shift+Enter is a new line and Enter sends, Ask waits while the answer streams, the page
follows it, every control is reached with Tab, Copy copies the answer as written, Regenerate
streams the new answer in the old one's place.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import time

import pytest
from django.urls import reverse

from tests.browser import log_in, needs_chromium, screenshot, start_chromium
from tests.conftest import wait_for
from tests.webapp.api.fake_worker import FakeInferenceWorker
from tests.webapp.chat.test_chat import make_document
from webapp.chat.models import Conversation, Message
from webapp.redis import redis_client

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]

QUEUE = "inference-ui-test"  # the stand-in's own: a real worker of the session never takes it
# A long answer, some tokens new lines, so that it grows taller than the window as it streams.
WORDS = tuple(f" word{i}" + ("\n" if i % 4 == 3 else "") for i in range(48)) + (" [1].",)


@pytest.fixture
def slow_worker():
    with FakeInferenceWorker(
        redis_client(), words=WORDS, queue=QUEUE, token_delay_s=0.08, record=True
    ) as worker:
        yield worker


@pytest.fixture
def browser():
    driver = start_chromium("--window-size=1280,700")
    yield driver
    driver.quit()


def _conversation_with_history(owner) -> Conversation:
    make_document(owner, "Kitchen notes", ["A risotto needs arborio rice and warm stock."])
    conversation = Conversation.objects.create(owner=owner, title="Risotto")
    for i in range(6):  # earlier turns: the page is taller than the window
        Message.objects.create(conversation=conversation, role="user", content=f"Question {i}?")
        earlier = "\n\n".join(["An earlier answer."] * 3)
        Message.objects.create(
            conversation=conversation,
            role="assistant",
            status="done",
            content=earlier,
            mode="blend",
        )
    return conversation


def _tab_through(browser, steps: int = 120) -> list[str]:
    """What Tab reaches from the top of the page, in order (each as its text or name)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    browser.execute_script("document.activeElement && document.activeElement.blur()")
    reached = []
    for _ in range(steps):
        ActionChains(browser).send_keys(Keys.TAB).perform()
        element = browser.switch_to.active_element
        reached.append(element.get_attribute("id") or element.text or element.get_attribute("name"))
    return reached


def _at_bottom(browser) -> bool:
    return browser.execute_script(
        "const s = document.scrollingElement;"
        "return s.scrollHeight - s.scrollTop - s.clientHeight < 40"
    )


def test_keyboard_and_a_streaming_answer(browser, chat_server, slow_worker, alice) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    conversation = _conversation_with_history(alice)
    log_in(browser, chat_server, alice)
    browser.get(f"{chat_server}{reverse('chat:conversation', args=[conversation.id])}")
    ask = browser.find_element(By.CSS_SELECTOR, "#ask-form button[type=submit]")
    question = browser.find_element(By.NAME, "question")
    question.send_keys("How is a risotto made?", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "Briefly.")
    assert question.get_attribute("value") == "How is a risotto made?\nBriefly."  # not sent
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 6
    question.send_keys(Keys.ENTER)

    wait_for(
        lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .bubble.streaming"),
        timeout=30,
        what="the answer to start streaming",
    )
    assert ask.get_attribute("disabled") is not None  # no second question meanwhile
    question.send_keys("A second question", Keys.ENTER)  # Enter does not send it either
    followed = []
    # The streaming bubble is read in the page, in one script: when the answer ends, htmx swaps
    # it out, and a reference held here would go stale between two calls.
    read_streaming = (
        "const bubble = document.querySelector('.msg.assistant .bubble.streaming');"
        "return bubble ? bubble.textContent : null"
    )
    while (text := browser.execute_script(read_streaming)) is not None:
        if "word20" in text:
            followed.append(_at_bottom(browser))
        time.sleep(0.1)
    assert followed and all(followed), "the page did not follow the streaming answer"
    answer = wait_for(
        lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-status=done]")[-1:],
        timeout=30,
        what="the recorded answer",
    )[0]
    assert "word47" in answer.find_element(By.CSS_SELECTOR, ".bubble").text
    wait_for(lambda: ask.get_attribute("disabled") is None, timeout=10, what="Ask enabled again")
    assert question.get_attribute("value") == "A second question"
    assert Message.objects.filter(conversation=conversation, role="user").count() == 7
    screenshot(browser, "chat-keyboard.png")

    # Every control of the new answer and the form is reached with Tab.
    answer_id = answer.get_attribute("id")
    reached = _tab_through(browser)
    for control in ("Copy", "Regenerate", "Helpful", "Not helpful", "question", "Ask"):
        assert control in reached, f"Tab never reaches {control}: {reached}"

    # Copy puts the answer as written (its [1] marker too) on the clipboard.
    permissions = ["clipboardReadWrite", "clipboardSanitizedWrite"]
    browser.execute_cdp_cmd(
        "Browser.grantPermissions", {"origin": chat_server, "permissions": permissions}
    )
    copy = browser.find_element(By.CSS_SELECTOR, f"#{answer_id} button.copy")
    copy.send_keys(Keys.ENTER)
    wait_for(lambda: copy.text == "Copied", timeout=5, what="the copy to be confirmed")
    clipboard = browser.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0], e => arguments[0]('! ' + e))"
    )
    recorded = Message.objects.get(id=answer_id.removeprefix("message-")).content
    assert "[1]" in clipboard and clipboard == recorded

    # Regenerate, from the keyboard, streams the new answer in the old one's place.
    regenerate = browser.find_element(
        By.CSS_SELECTOR, f"#{answer_id} .actions button[hx-post$=regenerate]"
    )
    regenerate.send_keys(Keys.ENTER)
    wait_for(lambda: not browser.find_elements(By.ID, answer_id), timeout=30, what="the swap")
    answers = browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")
    assert len(answers) == 7 and answers[-1].get_attribute("data-status") in ("pending", "done")
    last_done = "#messages > .msg.assistant:last-child[data-status=done]"
    wait_for(
        lambda: browser.find_elements(By.CSS_SELECTOR, last_done), timeout=60, what="the new answer"
    )
    questions = browser.find_elements(By.CSS_SELECTOR, "#messages .msg.user")
    assert len(questions) == 7 and "risotto" in questions[-1].text  # asked once
    browser.refresh()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")) == 7
    assert not browser.find_elements(By.ID, answer_id)
