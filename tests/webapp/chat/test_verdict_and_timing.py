"""One verdict per answer and numbers that tell what happened: an answer no passage supports
is recorded and shown as "not found", its words withheld and marked, never beside it; a
supported one carries no not-found note; the time to first token is recorded as the user
sees it (from the question's submit) beside the worker's; an answer served whole from the
prefix cache records that, not a ratio that did not run."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from kvservice.protocol import AnswerMetrics, AnswerOutcome, Token, publish_event
from kvservice.serve.citing import UNSUPPORTED, passage_uses, verdict
from tests.webapp.chat.test_chat import PASSAGES, pending_answer
from webapp.chat import services
from webapp.chat.models import Message
from webapp.redis import redis_client

pytestmark = pytest.mark.django_db

QUESTION = "Which rice goes into a risotto?"


def _pending_answer(owner, *, asked_at=None) -> Message:
    """A question and its pending answer over the cooking passage, as ``chat_ask`` leaves
    them (without retrieval or a worker)."""
    return pending_answer(owner, "Kitchen notes", PASSAGES["cooking"], QUESTION, asked_at=asked_at)


def _record(answer: Message, words: str, **metrics) -> Message:
    """The worker's report of ``words``, judged as the worker judges them."""
    judged = verdict(words, [PASSAGES["cooking"]], QUESTION)
    chunk_id = answer.citations.get().chunk_id
    tiers = {str(chunk_id): "cpu"}
    outcome = AnswerOutcome.answered(
        "done",
        text=judged.text,
        withheld=judged.withheld,
        metrics=AnswerMetrics(
            **{
                "ttft_s": 0.05,
                "total_s": 0.3,
                "mode": "blend",
                "recompute_ratio": 0.15,
                "chunk_tiers": tiers,
                "citation": judged.citation,
                **metrics,
            }
        ),
        passages=passage_uses(judged.text, [PASSAGES["cooking"]], [chunk_id], tiers),
    )
    services.record_outcome(message_id=answer.id, outcome=outcome)
    answer.refresh_from_db()
    return answer


def _bubble(client, answer: Message) -> tuple[str, str]:
    """(the answer's bubble as a reader sees it at first, its folded withheld part)."""
    html = client.get(reverse("chat:message", args=[answer.id])).content.decode()
    bubble = html.split('<div class="bubble">', 1)[1].split("</div>", 1)[0]
    match = re.search(r'<details class="withheld">.*?</details>', bubble, re.S)
    folded = match.group() if match else ""
    return bubble.replace(folded, "") if folded else bubble, folded


def test_an_unsupported_answer_is_recorded_and_shown_as_not_found_alone(client, alice) -> None:
    answer = _record(_pending_answer(alice), "The answer is: 4")
    assert answer.content == UNSUPPORTED and answer.withheld_text == "The answer is: 4"
    assert not answer.sources  # "not found" cites nothing
    client.force_login(alice)
    shown, folded = _bubble(client, answer)
    assert "could not find this in your documents" in shown
    assert "The answer is: 4" not in shown  # never beside the verdict
    assert "The answer is: 4" in folded and "not an answer" in folded and " open" not in folded


def test_a_supported_answer_has_no_not_found_note(client, alice) -> None:
    answer = _record(_pending_answer(alice), "Arborio rice, with warm stock added slowly.")
    assert answer.content.endswith("[1]") and answer.withheld_text == ""
    assert [c.rank for c in answer.sources] == [1]
    client.force_login(alice)
    shown, folded = _bubble(client, answer)
    assert "Arborio rice" in shown and "could not find" not in shown.lower() and not folded


def test_time_to_first_token_is_recorded_from_the_submit_beside_the_workers(client, alice) -> None:
    """The worker took 0.05 s; the words reached the stream 0.4 s after the question."""
    answer = _pending_answer(alice)
    time.sleep(0.4)  # retrieval, the queue, the worker: all before the first token
    publish_event(redis_client(), str(answer.request_id), Token(text="Arborio rice"))
    answer = _record(answer, "Arborio rice", ttft_s=0.05, total_s=0.3)
    assert 0.4 <= answer.ttft_seen_s < 5 and answer.ttft_s == 0.05
    assert answer.total_seen_s == answer.ttft_seen_s  # its one token: the last words too
    client.force_login(alice)
    html = client.get(reverse("chat:message", args=[answer.id])).content.decode()
    assert f"First words after {answer.ttft_seen_s:.1f} s" in html


def test_the_time_seen_is_never_less_than_the_workers_own(alice) -> None:
    """Clocks a few milliseconds apart cannot make the user's wait shorter than the work."""
    answer = _pending_answer(alice, asked_at=timezone.now() + timedelta(seconds=1))
    publish_event(redis_client(), str(answer.request_id), Token(text="Arborio rice"))
    answer = _record(answer, "Arborio rice", ttft_s=0.2)
    assert answer.ttft_seen_s == 0.2


def test_an_answer_asked_again_is_timed_from_its_own_asking(alice, queue) -> None:
    answer = _record(_pending_answer(alice), "Arborio rice")
    Message.objects.filter(pk=answer.pk).update(created_at=timezone.now() - timedelta(hours=1))
    again = services.chat_regenerate(user=alice, answer=answer)
    again.refresh_from_db()
    assert again.created_at < timezone.now() - timedelta(minutes=59)  # the old one's place
    assert timezone.now() - again.asked_at < timedelta(minutes=1)  # asked just now


def test_an_answer_served_whole_from_the_prefix_cache_is_recorded_as_such(
    client, alice, django_user_model
) -> None:
    answer = _pending_answer(alice)
    chunk_id = str(answer.citations.get().chunk_id)
    answer = _record(
        answer,
        "Arborio rice",
        recompute_ratio=None,
        prefix_cache=True,
        chunk_tiers={chunk_id: "prefix"},
    )
    assert answer.recompute_ratio is None and answer.from_prefix_cache
    assert answer.tiers == {"prefix": 1}
    alice.is_staff = True
    alice.save()
    client.force_login(alice)
    html = client.get(reverse("chat:message", args=[answer.id])).content.decode()
    assert "from the prefix cache" in html and "r=" not in html
