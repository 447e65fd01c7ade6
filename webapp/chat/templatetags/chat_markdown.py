"""Answers are Markdown from a model: rendered without raw HTML, then sanitized, and [n]
becomes a link to citation n."""

from __future__ import annotations

import re

import nh3
from django import template
from django.urls import reverse
from django.utils.safestring import SafeString, mark_safe
from markdown_it import MarkdownIt

register = template.Library()
_markdown = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")
_CITATION = re.compile(r"\[(\d{1,2})\]")
_ALLOWED_TAGS = {"p", "br", "strong", "em", "code", "pre", "ul", "ol", "li", "blockquote",
                 "h1", "h2", "h3", "h4", "table", "thead", "tbody", "tr", "th", "td", "a", "hr"}  # fmt: skip


@register.filter
def render_answer(text: str, citations) -> SafeString:
    by_rank = {c.rank: c for c in citations}

    def link(match: re.Match) -> str:
        citation = by_rank.get(int(match.group(1)))
        if citation is None:
            return match.group(0)
        url = reverse("chat:citation", args=[citation.id])
        return (
            f'<a href="{url}" class="cite" hx-get="{url}" hx-target="#citation-panel">'
            f"[{citation.rank}]</a>"
        )

    html = _CITATION.sub(link, _markdown.render(text or ""))
    cleaned = nh3.clean(
        html,
        tags=_ALLOWED_TAGS,
        attributes={"a": {"href", "class", "hx-get", "hx-target"}},
        url_schemes={"http", "https"},
        link_rel="noopener noreferrer",
    )
    return mark_safe(cleaned)  # noqa: S308 - nh3 allow-list sanitized above
