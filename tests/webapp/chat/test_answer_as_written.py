"""An answer is shown as written, and timed as the user waited for it: a line break is a line
break (not a numbered list, not a space), a numbered line with its citation on the next line
("1. ...\\n2. [1]", the bundled model's habit) is one line with its citation, a real list
stays a list; "answered in" is the time from the question to the answer's last words on its
stream, never more than the time that passed (it was shown 26.8 s into a 17.5 s wait)."""

from __future__ import annotations

import json
import re
import time

import pytest
from django.urls import reverse

from kvservice.protocol import AnswerMetrics, AnswerOutcome, Token, answer_stream, publish_event
from tests.webapp.chat.test_chat import pending_answer
from webapp.chat import services
from webapp.chat.models import Message
from webapp.redis import redis_client

pytestmark = pytest.mark.django_db

PASSAGE = "The harbour master of Kestrel Quay is Ines Varga. Her office is above the ferry hall."


def _pending(owner, *, asked_at=None) -> Message:
    """A question and its pending answer over the passage, as ``chat_ask`` leaves them."""
    return pending_answer(owner, "Kestrel Quay contacts", PASSAGE, "Who is it?", asked_at=asked_at)


def _record(answer: Message, content: str, **metrics) -> Message:
    """The worker's report of ``content``, recorded."""
    metrics = {"ttft_s": 0.05, "total_s": 0.3, "mode": "blend", **metrics}
    outcome = AnswerOutcome.answered("done", text=content, metrics=AnswerMetrics(**metrics))
    services.record_outcome(message_id=answer.id, outcome=outcome)
    answer.refresh_from_db()
    return answer


def _answered(owner, content: str) -> Message:
    return _record(_pending(owner), content)


def _bubble(client, answer: Message) -> str:
    html = client.get(reverse("chat:message", args=[answer.id])).content.decode()
    return html.split('<div class="bubble">', 1)[1].split("</div>", 1)[0]


def test_a_line_break_is_a_line_break_and_not_a_list(client, alice) -> None:
    client.force_login(alice)
    bubble = _bubble(client, _answered(alice, "The harbour master is Ines Varga.\n[1]"))
    assert re.search(r"Ines Varga\.<br ?/?>\s*<a [^>]*class=\"cite\"", bubble), bubble
    assert "<ol" not in bubble and "<li" not in bubble


def test_a_numbered_line_and_its_citation_on_the_next_are_one_line_as_written(
    client, alice
) -> None:
    client.force_login(alice)
    bubble = _bubble(client, _answered(alice, "1. The harbour master is Ines Varga.\n2. [1]"))
    assert "<ol" not in bubble and "<li" not in bubble  # not "1. ... 2. [1]" as a list
    assert re.search(r"<p>1\. The harbour master is Ines Varga\. <a [^>]*>\[1\]</a></p>", bubble)


def test_a_real_list_stays_a_list_its_citation_with_its_last_item(client, alice) -> None:
    client.force_login(alice)
    text = "1. Ines Varga is the harbour master.\n2. Her office is above the ferry hall.\n3. [1]"
    bubble = _bubble(client, _answered(alice, text))
    items = re.findall(r"<li>(.*?)</li>", bubble, re.S)
    assert len(items) == 2 and items[0] == "Ines Varga is the harbour master."
    assert items[1].startswith("Her office is above the ferry hall. <a ")


def test_answered_in_is_the_wait_to_the_last_words_never_more_than_passed(client, alice) -> None:
    """The worker held its first words back while it wrote them (``AnswerText``): its own
    first token came long before the first words on the stream. Adding its time from first
    token to last (1.45 s here) onto the first words as seen counted that time twice."""
    answer = _pending(alice)
    request_id = str(answer.request_id)
    time.sleep(0.6)
    publish_event(redis_client(), request_id, Token(text="The harbour master is "))
    time.sleep(0.2)
    publish_event(redis_client(), request_id, Token(text="Ines Varga. [1]"))
    answer = _record(answer, "The harbour master is Ines Varga. [1]", ttft_s=0.05, total_s=1.5)
    passed = (answer.completed_at - answer.asked_at).total_seconds()
    assert 0.6 <= answer.ttft_seen_s <= answer.total_seen_s <= passed
    assert answer.total_seen_s == pytest.approx(answer.ttft_seen_s + 0.2, abs=0.1)
    client.force_login(alice)
    html = client.get(reverse("chat:message", args=[answer.id])).content.decode()
    assert f"answered in {answer.total_seen_s:.1f} s" in html


def test_the_times_shown_never_exceed_the_time_passed_when_the_stream_clock_runs_ahead(
    alice,
) -> None:
    """The question's time is this server's clock, the words' the stream server's (the
    entry ids): words stamped 5 s ahead of this clock show no more than the time passed."""
    answer = _pending(alice)
    ahead_ms = int((time.time() + 5) * 1000)
    stream = redis_client()
    for at, text in enumerate(["Ines ", "Varga. [1]"]):
        entry = {"type": "token", "data": json.dumps({"text": text})}
        stream.xadd(answer_stream(str(answer.request_id)), entry, id=f"{ahead_ms + at}-0")
    time.sleep(0.3)  # the worker's own 0.05 s to its first token, and the rest
    answer = _record(answer, "Ines Varga. [1]")
    passed = (answer.completed_at - answer.asked_at).total_seconds()
    assert answer.ttft_seen_s <= answer.total_seen_s <= passed < 5
