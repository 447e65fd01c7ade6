"""A conversation as a file its owner keeps: Markdown to read, JSON for programs. Both carry
the questions, the answers and the passages each answer cites (their text copied at the
time, so an export reads right after a document is deleted)."""

from __future__ import annotations

import json
from typing import Any

from webapp.chat.models import Citation, Conversation, Message


def _citation(citation: Citation) -> dict[str, Any]:
    return {
        "rank": citation.rank,
        "document_title": citation.document_title,
        "document_id": citation.document_id,
        "cited": citation.cited,
        "text": citation.text,
    }


def _message(message: Message) -> dict[str, Any]:
    return {
        "role": message.role,
        "content": message.content,
        "status": message.status,
        "created_at": message.created_at.isoformat(),
        "citations": [_citation(c) for c in message.citations.all()],
    }


def _messages(conversation: Conversation):
    return conversation.messages.shown().prefetch_related("citations")


def conversation_json(conversation: Conversation) -> str:
    data = {
        "id": conversation.pk,
        "title": conversation.title,
        "created_at": conversation.created_at.isoformat(),
        "messages": [_message(m) for m in _messages(conversation)],
    }
    return json.dumps(data, ensure_ascii=False, indent=2)


def conversation_markdown(conversation: Conversation) -> str:
    lines = [
        f"# {conversation.title}",
        "",
        f"Started {conversation.created_at:%Y-%m-%d %H:%M} UTC.",
        "",
    ]
    for message in _messages(conversation):
        if message.role == Message.Role.USER:
            lines += ["## Question", "", message.content, ""]
            continue
        lines += ["## Answer", "", message.content or f"({message.get_status_display().lower()})"]
        sources = [c for c in message.citations.all() if c.cited]
        if sources:
            lines += ["", "Sources:", ""]
            lines += [f"- [{c.rank}] {c.document_title}" for c in sources]
        lines.append("")
    return "\n".join(lines)
