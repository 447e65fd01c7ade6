"""What users read is in plain words and whole: an answer's timing without the engine's terms
(TTFT, mode, recompute ratio, tiers: for staff), a document's progress and passages without
"KV", and each passage in full (it was cut at 600 characters)."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from tests.webapp.dashboard.factories import make_answers, make_document
from webapp.chat.models import Message
from webapp.documents.models import Chunk, Document

pytestmark = pytest.mark.django_db


def test_users_read_plain_timing_and_staff_the_engine_terms(client, alice, staff) -> None:
    for user in (alice, staff):
        conversation = make_answers(user)[0].conversation
        # to the last words on the stream, as the record has it
        conversation.messages.filter(ttft_seen_s__isnull=False).update(total_seen_s=0.9)
        client.force_login(user)
        page = client.get(reverse("chat:conversation", args=[conversation.id])).content.decode()
        if user.is_staff:  # the time the user saw, the worker's beside it
            assert "TTFT 0.420 s (worker 0.120 s) · blend · r=0.15" in page
        else:  # from the question's submit, not the worker's 0.12 s
            assert "First words after 0.4 s · answered in 0.9 s" in page
            assert "First words after 0.1 s" not in page
            assert "TTFT" not in page and "r=0.15" not in page and "cpu×" not in page
            assert "worker" not in page


def test_an_answer_the_model_never_ran_for_has_no_timing_line(client, staff) -> None:
    """An answer of "not found" at retrieval: no model ran, so there is no time to show;
    staff once read a line saying "blend" alone under it."""
    answer = make_answers(staff)[0]
    Message.objects.filter(pk=answer.pk).update(
        content="I could not find this in your documents: no passage is close enough.",
        ttft_s=None,
        ttft_seen_s=None,
        total_s=None,
        recompute_ratio=None,
        tiers={},
    )
    client.force_login(staff)
    page = client.get(reverse("chat:conversation", args=[answer.conversation_id])).content
    bubble = page.decode().split(f'id="message-{answer.id}"')[1].split('class="msg ')[0]
    assert "could not find" in bubble
    assert 'class="metrics"' not in bubble and "blend" not in bubble
    assert page.decode().count('class="metrics"') == 5  # the other answers keep theirs


def test_an_earlier_attempt_that_failed_says_so(client, alice) -> None:
    """Regenerate keeps the answers it replaced; one that failed showed as "Answer 2 of 3"
    with nothing under it."""
    first, failed, latest = make_answers(alice)[:3]
    Message.objects.filter(pk=failed.pk).update(
        status="failed", content="", error_message="The model did not finish this answer in time."
    )
    Message.objects.filter(pk=first.pk).update(replaced_by=failed)
    Message.objects.filter(pk=failed.pk).update(replaced_by=latest)
    client.force_login(alice)
    page = client.get(reverse("chat:conversation", args=[latest.conversation_id])).content
    earlier = page.decode().split('class="earlier-attempts"')[1].split("</details>")[0]
    second, first_shown = earlier.split("Answer 2 of 3")[1].split("Answer 1 of 3")
    assert "The answer failed: The model did not finish this answer in time." in second
    assert "Answer 0" in first_shown


# "KV" as a word: the page's random CSRF token may hold the letters (it did, once in CI).
KV_WORD = re.compile(r"\bKV\b")


def test_a_document_shows_whole_passages_and_no_kv_jargon(client, alice) -> None:
    document = make_document(alice, "Long handbook", chunks=1)
    passage = "The harbour was dug in 1764. " * 60  # 1740 characters
    Chunk.objects.filter(document=document).update(text=passage)
    client.force_login(alice)
    page = client.get(reverse("documents:detail", args=[document.id])).content.decode()
    assert passage.strip() in page
    assert "prepared for fast answers" in page and not KV_WORD.search(page)

    Document.objects.filter(pk=document.pk).update(
        status=Document.Status.PROCESSING, stage=Document.Stage.KV, progress=70
    )
    listing = client.get(reverse("documents:list")).content.decode()
    assert "Preparing it for fast answers" in listing and not KV_WORD.search(listing)
