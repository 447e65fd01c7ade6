"""Managing conversations: rename, delete (stopping an open answer), search by title and by
what was said, export as Markdown and JSON, titles cut at a word, no pile of empty ones;
someone else's conversation is a 404 for each."""

from __future__ import annotations

import json

import pytest
import redis
from django.conf import settings

from kvservice.protocol import stop_requested
from webapp.chat import services
from webapp.chat.models import Citation, Conversation, Message

pytestmark = pytest.mark.django_db


def _exchange(owner, title: str, question: str, answer: str, **conversation_fields):
    conversation = Conversation.objects.create(owner=owner, title=title, **conversation_fields)
    Message.objects.create(conversation=conversation, role="user", content=question)
    reply = Message.objects.create(
        conversation=conversation, role="assistant", content=answer, status="done", mode="blend"
    )
    Citation.objects.create(
        message=reply,
        rank=1,
        document_title="harbour.md",
        cited=True,
        text="The harbour of Velmont was dug in 1764.",
    )
    Citation.objects.create(message=reply, rank=2, document_title="other.md", text="Unrelated.")
    return conversation


def test_rename_keeps_a_cleaned_title_and_refuses_an_empty_one(client, alice) -> None:
    conversation = _exchange(alice, "When was it dug?", "When?", "In 1764 [1].")
    client.force_login(alice)
    client.post(f"/chat/{conversation.id}/rename", {"title": "  Velmont\x07   harbour "})
    conversation.refresh_from_db()
    assert conversation.title == "Velmont harbour"
    response = client.post(f"/chat/{conversation.id}/rename", {"title": "   "}, follow=True)
    assert "Give the conversation a title." in response.content.decode()
    conversation.refresh_from_db()
    assert conversation.title == "Velmont harbour"


def test_delete_removes_the_conversation_and_stops_an_open_answer(client, alice) -> None:
    conversation = _exchange(alice, "Harbour", "When?", "In 1764 [1].")
    open_answer = Message.objects.create(
        conversation=conversation, role="assistant", status="pending", mode="blend"
    )
    client.force_login(alice)
    page = client.get(f"/chat/{conversation.id}/").content.decode()
    assert 'id="delete-form"' in page and "confirm(" in page  # asks before deleting
    response = client.post(f"/chat/{conversation.id}/delete")
    assert response.status_code == 302 and response.url == "/chat/"
    assert not Conversation.objects.filter(pk=conversation.pk).exists()
    assert not Message.objects.filter(conversation_id=conversation.pk).exists()
    assert stop_requested(redis.Redis.from_url(settings.REDIS_URL), str(open_answer.request_id))


def test_search_finds_titles_and_what_was_said_in_the_users_browser_conversations(
    client, alice, mallory
) -> None:
    by_title = _exchange(alice, "Velmont harbour", "When was it dug?", "In 1764 [1].")
    by_content = _exchange(alice, "Old notes", "Who was the shipwright?", "Tomas Orle of Velmont.")
    _exchange(alice, "Risotto", "Which rice?", "Arborio.")
    _exchange(alice, "Velmont via the API", "Velmont?", "Yes.", source="api")
    _exchange(mallory, "Velmont secrets", "Velmont?", "Velmont.")
    client.force_login(alice)
    page = client.get("/chat/", {"q": "velmont"}, HTTP_HX_REQUEST="true").content.decode()
    found = {c.id for c in Conversation.objects.all() if f'id="conversation-link-{c.id}"' in page}
    assert found == {by_title.id, by_content.id}
    page = client.get("/chat/", {"q": "lighthouse"}).content.decode()
    assert "No conversation mentions “lighthouse”." in page


def test_export_as_markdown_and_json(client, alice) -> None:
    conversation = _exchange(alice, "Velmont harbour", "When was it dug?", "In 1764 [1].")
    client.force_login(alice)
    markdown = client.get(f"/chat/{conversation.id}/export.md")
    assert markdown["Content-Type"].startswith("text/markdown")
    assert markdown["Content-Disposition"] == (
        f'attachment; filename="conversation-{conversation.id}.md"'
    )
    text = markdown.content.decode()
    assert text.startswith("# Velmont harbour\n")
    assert "## Question\n\nWhen was it dug?\n" in text and "## Answer\n\nIn 1764 [1].\n" in text
    assert "- [1] harbour.md" in text and "other.md" not in text  # only what it cites

    data = json.loads(client.get(f"/chat/{conversation.id}/export.json").content)
    assert data["title"] == "Velmont harbour"
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    citations = data["messages"][1]["citations"]
    assert [(c["rank"], c["cited"]) for c in citations] == [(1, True), (2, False)]
    assert citations[0]["text"] == "The harbour of Velmont was dug in 1764."


def test_someone_elses_conversation_is_a_404_and_stays(client, alice, mallory) -> None:
    conversation = _exchange(alice, "Velmont harbour", "When?", "In 1764 [1].")
    client.force_login(mallory)
    for url in (f"/chat/{conversation.id}/export.md", f"/chat/{conversation.id}/export.json"):
        assert client.get(url).status_code == 404, url
    for url in (
        f"/chat/{conversation.id}/rename",
        f"/chat/{conversation.id}/delete",
        f"/chat/{conversation.id}/scope",
    ):
        assert client.post(url, {"title": "mine now"}).status_code == 404, url
    conversation.refresh_from_db()
    assert conversation.title == "Velmont harbour" and conversation.messages.count() == 2


def test_a_title_from_a_long_question_is_cut_at_a_word() -> None:
    question = "Which of the harbours along the northern coast was dug first, and by whom, " * 2
    title = services.title_from(question)
    assert title.endswith("…") and len(title) <= services.TITLE_CHARS
    assert question.startswith(title[:-1]) and question[len(title) - 1] in " ,"
    assert services.title_from("  When was it\n dug? ") == "When was it dug?"


def test_new_conversation_reuses_an_empty_one(client, alice) -> None:
    client.force_login(alice)
    first = client.post("/chat/new").url
    assert client.post("/chat/new").url == first
    assert Conversation.objects.filter(owner=alice).count() == 1
    _exchange(alice, "Used", "When?", "Then.")
    Conversation.objects.filter(owner=alice, title="New conversation").delete()
    assert client.post("/chat/new").url != first


def test_the_first_question_renames_the_conversation_on_the_page(client, alice) -> None:
    client.force_login(alice)
    conversation = Conversation.objects.get(pk=client.post("/chat/new").url.split("/")[2])
    response = client.post(
        f"/chat/{conversation.id}/ask", {"question": "When was it dug?"}, HTTP_HX_REQUEST="true"
    )
    html = response.content.decode()
    assert f'id="conversation-link-{conversation.id}"' in html and 'hx-swap-oob="true"' in html
    assert '<h1 id="conversation-title" hx-swap-oob="true">When was it dug?</h1>' in html
