"""An answer's actions read as separate buttons (headless Chromium): Helpful and Not helpful
stand as far apart as Copy and Regenerate (a space between them read "Helpful Not helpful").

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.browser import log_in, needs_chromium
from tests.webapp.dashboard.factories import make_answers
from tests.webapp.dashboard.test_browser import browser  # noqa: F401 - a fixture

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]

GAPS = """
const actions = arguments[0], by = text => [...actions.querySelectorAll('button')]
  .find(b => b.textContent.trim() === text).getBoundingClientRect();
return [by('Regenerate').left - by('Copy').right, by('Not helpful').left - by('Helpful').right];
"""


def test_each_action_of_an_answer_stands_apart(browser, live_server, alice) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    conversation = make_answers(alice)[0].conversation
    log_in(browser, live_server.url, alice)
    browser.get(f"{live_server.url}{reverse('chat:conversation', args=[conversation.id])}")
    actions = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .actions")
    between_copy_and_regenerate, between_feedback = browser.execute_script(GAPS, actions)
    assert between_copy_and_regenerate >= 10
    assert abs(between_feedback - between_copy_and_regenerate) <= 1, (
        between_feedback,
        between_copy_and_regenerate,
    )
