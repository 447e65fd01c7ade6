"""Rows for the dashboard tests: documents with cached chunks, answers with metrics."""

from __future__ import annotations

import hashlib
import uuid
from datetime import timedelta

from django.utils import timezone

from webapp.chat.models import Citation, Conversation, Message
from webapp.documents.models import Chunk, Document


def make_document(owner, title: str = "Rivers of Europe", chunks: int = 3) -> Document:
    digest = hashlib.sha256(f"{title}/{uuid.uuid4()}".encode()).hexdigest()
    document = Document.objects.create(
        owner=owner,
        title=title,
        content_sha256=digest,
        status=Document.Status.READY,
        stage=Document.Stage.DONE,
        progress=100,
    )
    for index in range(chunks):
        ids = [index * 100 + i for i in range(20)]
        Chunk.objects.create(
            document=document,
            index=index,
            text=f"chunk {index}",
            token_ids=ids,
            token_count=len(ids),
            token_ids_sha256=f"{digest[:60]}{index:04d}",
            kv_key=f"kv-{digest[:8]}-{index}",
            kv_status=Chunk.KVStatus.READY,
        )
    return document


def make_answers(owner, document: Document | None = None) -> list[Message]:
    """A conversation with finished answers in several modes over the last hours."""
    conversation = Conversation.objects.create(owner=owner, title="metrics")
    now = timezone.now()
    answers = []
    specs = [
        ("blend", 0.12, 0.15, {"cpu": 2, "s3": 1}),
        ("full", 0.61, None, {}),
        ("blend", 0.15, 0.3, {"disk": 3}),
        ("reuse", 0.09, 0.0, {"cpu": 3}),
        ("blend", 0.11, 0.15, {"cpu": 3}),
        ("full", 0.55, None, {}),
    ]
    for i, (mode, ttft, ratio, tiers) in enumerate(specs):
        Message.objects.create(conversation=conversation, role="user", content=f"Question {i}?")
        answer = Message.objects.create(
            conversation=conversation,
            role="assistant",
            status="done",
            content=f"Answer {i}",
            mode=mode,
            ttft_s=ttft,
            total_s=ttft * 5,
            recompute_ratio=ratio,
            tiers=tiers,
            ttft_seen_s=ttft + 0.3,  # retrieval and the queue before the worker's first token
        )
        when = now - timedelta(hours=len(specs) - i)
        Message.objects.filter(pk=answer.pk).update(completed_at=when, created_at=when)
        if document is not None:
            for rank, chunk in enumerate(document.chunks.all()[:2], start=1):
                Citation.objects.create(
                    message=answer,
                    rank=rank,
                    chunk=chunk,
                    document=document,
                    document_title=document.title,
                    text=chunk.text,
                )
        answers.append(answer)
    return answers
