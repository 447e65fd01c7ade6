"""What the chat page says about an answer, in a real browser (headless Chromium) on the ASGI
server, a stand-in worker answering through Redis: an answer cut at the length limit says
that it was cut, and Regenerate, whose title says it gives a different attempt, sends a
sampled request with a seed of its own and marks the new answer as another attempt.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.browser import log_in, needs_chromium, screenshot, start_chromium
from tests.conftest import wait_for
from tests.webapp.api.fake_worker import FakeInferenceWorker
from tests.webapp.chat.test_chat import make_document
from webapp.chat.models import Conversation, Message
from webapp.chat.requests import REGENERATE_TEMPERATURE
from webapp.redis import redis_client

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]

QUEUE = "inference-attempts-test"  # the stand-in's own: a real worker never takes it
# What the worker streams for an answer cut at the cap (kvservice.model.sampling.AnswerText).
CUT_ANSWER = ("The Gannet", " seats six", " and the", " Osprey…", " [1]")


@pytest.fixture
def cut_worker():
    with FakeInferenceWorker(
        redis_client(), words=CUT_ANSWER, finish_reason="length", queue=QUEUE, record=True
    ) as worker:
        yield worker


@pytest.fixture
def browser():
    driver = start_chromium("--window-size=1280,900")
    yield driver
    driver.quit()


def _last_answer(browser):
    from selenium.webdriver.common.by import By

    return wait_for(
        lambda: browser.find_elements(
            By.CSS_SELECTOR, "#messages > .msg.assistant:last-child[data-status=done]"
        ),
        timeout=30,
        what="the recorded answer",
    )[0]


def test_a_cut_answer_says_so_and_regenerate_gives_another_attempt(
    browser, chat_server, cut_worker, alice
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    make_document(alice, "Boats", ["The Gannet seats six. The Osprey seats four."])
    conversation = Conversation.objects.create(owner=alice, title="Boats")
    log_in(browser, chat_server, alice)
    browser.get(f"{chat_server}{reverse('chat:conversation', args=[conversation.id])}")
    browser.find_element(By.NAME, "question").send_keys(
        "How many do the Gannet and the Osprey seat?", Keys.ENTER
    )

    answer = _last_answer(browser)
    assert "Osprey…" in answer.find_element(By.CSS_SELECTOR, ".bubble").text
    note = answer.find_element(By.CSS_SELECTOR, ".cut-note")
    assert note.is_displayed() and "cut off" in note.text and "length limit" in note.text
    first = Message.objects.get(id=answer.get_attribute("id").removeprefix("message-"))
    assert first.finish_reason == "length" and first.temperature == 0
    assert not answer.find_elements(By.CSS_SELECTOR, ".attempt")  # a first answer is greedy

    regenerate = answer.find_element(By.CSS_SELECTOR, "button.regenerate")
    assert "different attempt" in regenerate.get_attribute("title")
    answer_id = answer.get_attribute("id")
    regenerate.click()
    wait_for(lambda: not browser.find_elements(By.ID, answer_id), timeout=30, what="the swap")
    again = _last_answer(browser)
    attempt = again.find_element(By.CSS_SELECTOR, ".attempt")
    assert attempt.is_displayed() and "another attempt" in attempt.text
    recorded = Message.objects.get(id=again.get_attribute("id").removeprefix("message-"))
    greedy, sampled = cut_worker.requests
    assert greedy["temperature"] == 0.0 and greedy["seed"] is None
    assert sampled["temperature"] == recorded.temperature == REGENERATE_TEMPERATURE
    assert sampled["seed"] == recorded.seed is not None
    assert str(recorded.seed) in attempt.get_attribute("title")
    # The first answer is not lost: it is read again under the new one.
    earlier = again.find_element(By.CSS_SELECTOR, "details.earlier-attempts")
    assert "Earlier answers to this question (1)" in earlier.text
    earlier.find_element(By.TAG_NAME, "summary").click()
    shown = earlier.find_element(By.CSS_SELECTOR, ".earlier-attempt").text
    assert "Answer 1 of 2" in shown and "Osprey…" in shown
    screenshot(browser, "answer-attempts.png")
