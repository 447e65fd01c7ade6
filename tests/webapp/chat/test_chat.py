"""Chat without the model: retrieval, isolation between users, asking, recording, rendering."""

from __future__ import annotations

import hashlib

import pytest
import redis
from django.conf import settings
from django.contrib.postgres.search import SearchVector
from django.template import Context, Template

from kvservice.protocol import INFERENCE_QUEUE, AnswerOutcome, request_stop, stop_requested
from webapp.chat import services
from webapp.chat.models import Citation, Message
from webapp.chat.retrieval import reciprocal_rank_fusion, retrieve_chunks
from webapp.documents.embeddings import embed_texts
from webapp.documents.models import SEARCH_CONFIG, Chunk, Document

pytestmark = pytest.mark.django_db

PASSAGES = {
    "rivers": (
        "The Danube flows through Vienna, Budapest and Belgrade before reaching the Black Sea."
    ),
    "cooking": "A risotto needs arborio rice, warm stock added slowly, and constant stirring.",
    "space": "Europa, a moon of Jupiter, hides a salty ocean beneath its icy crust.",
}


def make_document(owner, title: str, texts: list[str]) -> Document:
    digest = hashlib.sha256((title + "".join(texts)).encode()).hexdigest()
    document = Document.objects.create(
        owner=owner, title=title, content_sha256=digest, status=Document.Status.READY
    )
    for index, (text, vector) in enumerate(zip(texts, embed_texts(texts), strict=True)):
        ids = [ord(ch) % 1000 for ch in text]  # stand-in token ids; only identity matters here
        Chunk.objects.create(
            document=document,
            index=index,
            text=text,
            token_ids=ids,
            token_count=len(ids),
            token_ids_sha256=hashlib.sha256(text.encode()).hexdigest(),
            embedding=vector,
        )
    Chunk.objects.filter(document=document).update(
        search_vector=SearchVector("text", config=SEARCH_CONFIG)
    )  # as ingest writes it
    return document


def pending_answer(owner, title: str, passage: str, question: str, *, asked_at=None) -> Message:
    """A question and its pending answer over one passage (a document titled ``title``), the
    passage cited, as ``chat_ask`` leaves them (without retrieval or a worker)."""
    from django.utils import timezone

    from webapp.chat.models import Conversation

    document = make_document(owner, title, [passage])
    conversation = Conversation.objects.create(owner=owner, title=title)
    Message.objects.create(conversation=conversation, role="user", content=question)
    answer = Message.objects.create(
        conversation=conversation,
        role="assistant",
        status="pending",
        mode="blend",
        asked_at=asked_at or timezone.now(),
    )
    chunk = document.chunks.get()
    Citation.objects.create(
        message=answer,
        rank=1,
        chunk=chunk,
        document=document,
        document_title=document.title,
        text=chunk.text,
    )
    return answer


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user(username="alice", password="alice-passphrase")


@pytest.fixture
def mallory(django_user_model):
    return django_user_model.objects.create_user(username="mallory", password="mallory-pass")


def test_reciprocal_rank_fusion_rewards_agreement() -> None:
    assert reciprocal_rank_fusion([[1, 2, 3], [2, 9, 8]])[:2] == [2, 1]
    assert reciprocal_rank_fusion([[5], []]) == [5]


def test_retrieval_finds_the_relevant_chunk_first(alice) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    question = "Which moon has an ocean under its ice?"
    chunks = retrieve_chunks(
        user=alice, question=question, query_embedding=embed_texts([question])[0], top_k=2
    )
    assert chunks[0].text == PASSAGES["space"]
    assert len(chunks) == 2


def test_retrieval_never_returns_another_users_chunks(alice, mallory) -> None:
    make_document(alice, "alice's", [PASSAGES["space"]])
    make_document(mallory, "mallory's", [PASSAGES["cooking"]])
    question = "Europa ocean Jupiter"
    found = retrieve_chunks(
        user=mallory, question=question, query_embedding=embed_texts([question])[0], top_k=6
    )
    assert [c.document.owner_id for c in found] == [mallory.id]


def test_retrieval_skips_documents_that_are_not_ready(alice) -> None:
    document = make_document(alice, "half done", [PASSAGES["rivers"]])
    Document.objects.filter(id=document.id).update(status=Document.Status.PROCESSING)
    question = "Danube"
    assert (
        retrieve_chunks(
            user=alice, question=question, query_embedding=embed_texts([question])[0], top_k=6
        )
        == []
    )


def test_identical_chunks_in_two_documents_are_cited_once(alice) -> None:
    make_document(alice, "copy one", [PASSAGES["rivers"]])
    make_document(alice, "copy two", [PASSAGES["rivers"], PASSAGES["cooking"]])
    question = "Where does the Danube flow?"
    found = retrieve_chunks(
        user=alice, question=question, query_embedding=embed_texts([question])[0], top_k=6
    )
    assert [c.text for c in found].count(PASSAGES["rivers"]) == 1


def test_ask_records_question_pending_answer_citations_and_queues_request(alice) -> None:
    make_document(alice, "notes", list(PASSAGES.values()))
    conversation = services.conversation_create(owner=alice)
    queue = redis.Redis.from_url(settings.REDIS_URL)
    before = queue.llen(INFERENCE_QUEUE)
    from django.test import TestCase

    with TestCase.captureOnCommitCallbacks(execute=True):
        answer = services.chat_ask(user=alice, conversation=conversation, question="Risotto rice?")
    assert answer.status == Message.Status.PENDING and answer.mode == "blend"
    assert conversation.messages.filter(role="user").get().content == "Risotto rice?"
    assert answer.citations.first().text == PASSAGES["cooking"]
    assert queue.llen(INFERENCE_QUEUE) == before + 1
    queue.delete(INFERENCE_QUEUE)  # no inference worker in this test


def test_non_staff_cannot_pick_another_mode(alice) -> None:
    conversation = services.conversation_create(owner=alice)
    with pytest.raises(services.ChatError, match="Only staff"):
        services.chat_ask(user=alice, conversation=conversation, question="hi", mode="full")
    with pytest.raises(services.ChatError, match="Type a question"):
        services.chat_ask(user=alice, conversation=conversation, question="   ")
    with pytest.raises(services.ChatError, match="Type a question"):
        services.chat_ask(user=alice, conversation=conversation, question="\x00\x07 ")


def test_control_characters_are_dropped_from_a_question(alice) -> None:
    conversation = services.conversation_create(owner=alice)
    services.chat_ask(user=alice, conversation=conversation, question="Risotto\x00 rice?\x1b")
    assert conversation.messages.filter(role="user").get().content == "Risotto rice?"


def test_record_answer_stores_metrics_and_is_idempotent(alice) -> None:
    conversation = services.conversation_create(owner=alice)
    answer = Message.objects.create(
        conversation=conversation, role="assistant", status="pending", mode="blend"
    )
    result = {
        "status": "done",
        "text": "Arborio [1].",
        "metrics": {
            "ttft_s": 0.12,
            "total_s": 1.5,
            "mode": "blend",
            "recompute_ratio": 0.15,
            "chunk_tiers": {"7": "s3", "8": "cpu"},
            "refresh_ratio": 0.25,
            "second_token_s": 0.4,
        },
    }
    services.record_outcome(message_id=answer.id, outcome=AnswerOutcome.from_dict(result))
    answer.refresh_from_db()
    assert (answer.status, answer.content, answer.ttft_s, answer.tiers) == (
        "done",
        "Arborio [1].",
        0.12,
        {"s3": 1, "cpu": 1},
    )
    assert (answer.refresh_ratio, answer.second_token_s) == (0.25, 0.4)  # progressive blend
    services.record_outcome(
        message_id=answer.id, outcome=AnswerOutcome.from_dict({"status": "error", "error": "late"})
    )
    answer.refresh_from_db()
    assert answer.status == "done" and answer.error_message == ""


def test_answers_render_markdown_without_script_injection(alice) -> None:
    conversation = services.conversation_create(owner=alice)
    answer = Message.objects.create(
        conversation=conversation,
        role="assistant",
        status="done",
        content="**Bold** <script>alert(1)</script> [link](javascript:alert(1)) see [1]",
    )
    Citation.objects.create(message=answer, rank=1, document_title="d", text="t")
    html = Template("{% load chat_markdown %}{{ m.content|render_answer:m.citations.all }}").render(
        Context({"m": answer})
    )
    assert "<strong>Bold</strong>" in html
    assert "<script" not in html and "&lt;script&gt;" in html  # shown as text, never run
    assert 'href="javascript' not in html
    assert 'class="cite"' in html and "[1]</a>" in html


def test_a_citation_marker_inside_a_link_or_code_never_becomes_markup(alice) -> None:
    """[n] is rewritten in the answer's text only: inside a link's title it once broke out of
    the attribute, letting the model's own words become attributes (an hx-get of its choice)."""
    conversation = services.conversation_create(owner=alice)
    content = (
        'See [the site](https://a.example "per [1] hx-get=/accounts/logout/") and '
        "`code [1]`, but [1] here."
    )
    answer = Message.objects.create(
        conversation=conversation, role="assistant", status="done", content=content
    )
    citation = Citation.objects.create(message=answer, rank=1, document_title="d", text="t")
    html = Template("{% load chat_markdown %}{{ m.content|render_answer:m.citations.all }}").render(
        Context({"m": answer})
    )
    # One hx-get: the citation's; the title's words stay words inside its (escaped) value.
    assert html.count('hx-get="') == 1 and 'title="per [1] hx-get=/accounts/logout/"' in html
    assert html.count('class="cite"') == 1 and f"/chat/citations/{citation.id}/" in html
    assert "<code>code [1]</code>" in html
    assert 'href="https://a.example"' in html


def test_other_users_get_404_for_conversations_messages_and_citations(
    client, alice, mallory
) -> None:
    conversation = services.conversation_create(owner=alice)
    answer = Message.objects.create(
        conversation=conversation, role="assistant", status="done", content="x"
    )
    citation = Citation.objects.create(message=answer, rank=1, document_title="d", text="secret")
    client.force_login(mallory)
    for url in (
        f"/chat/{conversation.id}/",
        f"/chat/messages/{answer.id}/",
        f"/chat/citations/{citation.id}/",
        f"/chat/messages/{answer.id}/stream",
    ):
        assert client.get(url).status_code == 404, url
    for url in (
        f"/chat/{conversation.id}/ask",
        f"/chat/messages/{answer.id}/stop",
        f"/chat/messages/{answer.id}/feedback",
        f"/chat/messages/{answer.id}/regenerate",
    ):
        assert client.post(url, {"question": "q", "value": "1"}).status_code == 404, url
    client.force_login(alice)
    assert b"secret" in client.get(f"/chat/citations/{citation.id}/").content


def test_stop_flag_reaches_the_worker_side(alice) -> None:
    client = redis.Redis.from_url(settings.REDIS_URL)
    assert not stop_requested(client, "abc")
    request_stop(client, "abc")
    assert stop_requested(client, "abc")
