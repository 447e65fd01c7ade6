"""How an answer is shown, in a real browser (headless Chromium on the ASGI server, a stand-in
worker that speaks the real protocol): the citation highlights the list item that holds the
answer's fact, number and text together (a numbered step's "2." was highlighted alone); a
line break is a line break and a numbered line with its citation on the next is no list
(they showed as "1. ... 2. [1]"), after Regenerate too; after Stop the page shows the answer
as saved; the passage's title stays whole at the top of the panel, on a phone too, while the
passage scrolls to the cited sentence (the title scrolled away, Close over the text).

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import time

import pytest
from django.urls import reverse

from kvservice.protocol import (
    AnswerMetrics,
    AnswerOutcome,
    Done,
    GenerateRequest,
    Token,
    inflight_add,
    inflight_remove,
    publish_event,
    stop_requested,
)
from kvservice.serve.citing import passage_uses
from tests.browser import (
    ANSWER_DONE,
    ask,
    log_in,
    needs_chromium,
    open_citation,
    screenshot,
    start_chromium,
    start_phone,
)
from tests.conftest import wait_for
from tests.webapp.api.fake_worker import FakeInferenceWorker
from tests.webapp.chat.test_chat import make_document
from webapp.chat.models import Conversation, Message
from webapp.redis import redis_client

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]

QUEUE = "inference-display-test"  # the stand-in's own: a real worker never takes it
# A file's name as its title, longer than a phone is wide.
TITLE = "kestrel_quay_harbour_notice_for_passengers_2025.pdf"
STEP_2 = "2. Found items are kept for two months at the office."
# A PDF's lines as the chunker joined them, the numbered steps on one line, after a screenful
# of others: the cited step is out of sight until the panel scrolls to it.
PASSAGE = "\n".join(
    ["Kestrel Quay harbour notice"]
    + [
        f"The {name} ferry stops at Kestrel Quay on weekdays and on Sundays in summer."
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
    + [
        "Found property",
        f"1. Bring what you find to the ticket office. {STEP_2} 3. Collect "
        "an item with its receipt number.",
        "Safety",
        "The safety officer is Olga Brandt.",
    ]
)
OFFICER = ("The", " safety", " officer", " is", " Olga", " Brandt.", "\n[1]")
NUMBERED = ("1.", " The", " ticket", " office", " keeps", " it.", "\n2.", " [1]")
FIRST_STEP = (
    "1.",
    " The",
    " first",
    " step",
    " is",
    " to",
    " bring",
    " what",
    " you",
    " find",
    " to",
    " the",
    " ticket",
    " office.",
)


class RealisticWorker(FakeInferenceWorker):
    """The stand-in as the real worker behaves on Stop: the request is in flight (so Stop asks
    it, not the web app, to end the answer), its last words are held back while it writes
    them (``AnswerText``), and a stop streams those and records what it wrote."""

    held_words = 3

    def _answer(self, request: dict) -> None:
        request_id = request["request_id"]
        inflight_add(self.client, "display-test", GenerateRequest.from_dict(request))
        try:
            written, stopped = self._write(request_id)
            passages = [chunk["text"] for chunk in request["chunks"]]
            chunk_ids = [chunk["chunk_id"] for chunk in request["chunks"]]
            tiers = {str(chunk_id): "cpu" for chunk_id in chunk_ids}
            metrics = AnswerMetrics(ttft_s=0.05, total_s=0.2, mode=request["mode"])
            text = "".join(written)
            outcome = AnswerOutcome.answered(
                "stopped" if stopped else "done",
                text=text,
                metrics=metrics,
                passages=passage_uses(text, passages, chunk_ids, tiers, request["question"]),
            )
            self._report(request, outcome)
            publish_event(self.client, request_id, Done(outcome))
        finally:
            inflight_remove(self.client, request_id)

    def _write(self, request_id: str) -> tuple[list[str], bool]:
        """The words written until the end or a stop, each streamed once ``held_words`` more
        follow it, the rest at the end."""
        written: list[str] = []
        stopped = False
        for word in self.words:
            time.sleep(self.token_delay_s)
            written.append(word)
            if len(written) > self.held_words:
                publish_event(self.client, request_id, Token(text=written[-self.held_words - 1]))
            if stop_requested(self.client, request_id):
                stopped = True
                break
        rest = "".join(written[max(len(written) - self.held_words, 0) :])
        publish_event(self.client, request_id, Token(text=rest))
        return written, stopped


@pytest.fixture
def worker():
    with RealisticWorker(redis_client(), queue=QUEUE, record=True) as stand_in:
        yield stand_in


def _open_conversation(driver, base_url: str, owner) -> None:
    make_document(owner, TITLE, [PASSAGE])
    conversation = Conversation.objects.create(owner=owner, title="Kestrel Quay")
    log_in(driver, base_url, owner)
    driver.get(f"{base_url}{reverse('chat:conversation', args=[conversation.id])}")


# Whether the title is whole in the panel: inside it, on top (nothing over any of its
# corners), and not cut at its right edge; and the cited sentence below it, not under it.
TITLE_WHOLE = """
const title = document.getElementById('citation-title'), panel = title.closest('aside');
const t = title.getBoundingClientRect(), p = panel.getBoundingClientRect();
const mark = panel.querySelector('mark.cited-sentence').getBoundingClientRect();
const points = [[t.left + 2, t.top + 2], [t.right - 2, t.top + 2], [t.left + 2, t.bottom - 2],
                [t.left + t.width / 2, t.top + t.height / 2]];
const onTop = points.every(([x, y]) => title.contains(document.elementFromPoint(x, y)));
return {inside: t.top >= p.top && t.bottom <= p.bottom, onTop: onTop,
        uncut: title.scrollWidth <= title.clientWidth, markBelow: mark.top >= t.bottom,
        scrolled: panel.scrollTop > 0, text: title.textContent};
"""


def _assert_title_whole(driver) -> None:
    state = driver.execute_script(TITLE_WHOLE)
    assert state["text"] == f"[1] {TITLE}"
    assert state == {
        **state,
        "inside": True,
        "onTop": True,
        "uncut": True,
        "markBelow": True,
        "scrolled": True,
    }, state


def _first_paragraph(answer) -> str:
    from selenium.webdriver.common.by import By

    return answer.find_element(By.CSS_SELECTOR, ".bubble > p").text


# Whether the answer's [1] stands on the line below its sentence (a line break shown).
CITATION_ON_NEXT_LINE = """
const paragraph = arguments[0].querySelector('.bubble > p');
const cite = paragraph.querySelector('a.cite'), range = document.createRange();
range.selectNodeContents(paragraph.firstChild);
return range.getBoundingClientRect().bottom <= cite.getBoundingClientRect().top + 1;
"""


def test_highlight_line_breaks_regenerate_and_stop_on_a_desktop(chat_server, worker, alice) -> None:
    from selenium.webdriver.common.by import By

    driver = start_chromium("--window-size=1280,800")
    try:
        _open_conversation(driver, chat_server, alice)

        worker.words = ("They", " stay", " 2", " months", " [1].")
        answer = ask(driver, "How long are found items kept?")
        highlighted = open_citation(driver, answer)
        time.sleep(0.3)  # the scroll settled, for the screenshot
        screenshot(driver, "item1_after_desktop.png")
        assert highlighted == STEP_2  # not "2." alone
        screenshot(driver, "item5_after_desktop.png")
        _assert_title_whole(driver)

        worker.words = OFFICER
        answer = ask(driver, "Who is the safety officer?")
        screenshot(driver, "item2_after_desktop.png")
        assert not answer.find_elements(By.CSS_SELECTOR, ".bubble li")
        assert driver.execute_script(CITATION_ON_NEXT_LINE, answer)

        worker.words = NUMBERED
        answer = ask(driver, "Who keeps found property?")
        assert not answer.find_elements(By.CSS_SELECTOR, ".bubble li")
        assert _first_paragraph(answer) == "1. The ticket office keeps it. [1]"
        done_ids = f"return [...document.querySelectorAll({ANSWER_DONE!r})].map(e => e.id)"
        earlier = set(driver.execute_script(done_ids))
        answer.find_element(By.CSS_SELECTOR, "button.regenerate").click()
        (again_id,) = wait_for(
            lambda: set(driver.execute_script(done_ids)) - earlier,
            timeout=60,
            what="the answer asked again, in the first one's place",
        )
        again = driver.find_element(By.ID, again_id)
        assert not again.find_elements(By.CSS_SELECTOR, ".bubble li")
        assert _first_paragraph(again) == "1. The ticket office keeps it. [1]"

        worker.words, worker.token_delay_s = FIRST_STEP, 0.4
        driver.find_element(By.NAME, "question").send_keys("What is the first step?\n")
        wait_for(
            lambda: (
                "first"
                in (
                    driver.execute_script(
                        "const b = document.querySelector('.bubble.streaming');"
                        " return b && b.textContent"
                    )
                    or ""
                )
            ),
            timeout=30,
            what="the answer to stream",
        )
        driver.find_element(By.XPATH, "//button[text()='Stop']").click()
        stopped = wait_for(
            lambda: driver.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-status=stopped]"),
            timeout=30,
            what="the stopped answer",
        )[0]
        saved = Message.objects.filter(role="assistant", status="stopped").get()
        assert saved.content.startswith("1. The first step is to")
        assert _first_paragraph(stopped) == saved.content  # as saved, and as written
        screenshot(driver, "item4_after_desktop.png")
    finally:
        driver.quit()


def test_highlight_line_breaks_and_a_whole_title_on_a_phone(chat_server, worker, alice) -> None:
    from selenium.webdriver.common.by import By

    driver = start_phone()
    try:
        _open_conversation(driver, chat_server, alice)
        worker.words = OFFICER
        answer = ask(driver, "Who is the safety officer?")
        screenshot(driver, "item2_after_phone.png")
        assert not answer.find_elements(By.CSS_SELECTOR, ".bubble li")
        assert driver.execute_script(CITATION_ON_NEXT_LINE, answer)

        worker.words = ("They", " stay", " 2", " months", " [1].")
        answer = ask(driver, "How long are found items kept?")
        highlighted = open_citation(driver, answer)
        time.sleep(0.3)  # the scroll settled, for the screenshot
        screenshot(driver, "item1_after_phone.png")
        screenshot(driver, "item5_after_phone.png")
        assert highlighted == STEP_2
        _assert_title_whole(driver)
        close = driver.find_element(By.CSS_SELECTOR, "#citation-overlay .panel-close")
        close.click()
        assert not driver.find_element(By.ID, "citation-overlay").is_displayed()
    finally:
        driver.quit()
