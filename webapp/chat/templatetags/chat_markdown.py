"""Answers are Markdown from a model: rendered without raw HTML, then sanitized, and [n]
becomes a link to citation n: in the answer's text only (never inside a link, its title or
code), so nothing the model writes can put its own attributes on a citation link."""

from __future__ import annotations

import re

import nh3
from django import template
from django.urls import reverse
from django.utils.safestring import SafeString, mark_safe
from markdown_it import MarkdownIt
from markdown_it.token import Token

register = template.Library()
_markdown = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")
_CITATION = re.compile(r"\[(\d{1,2})\]")
_ALLOWED_TAGS = {"p", "br", "strong", "em", "code", "pre", "ul", "ol", "li", "blockquote",
                 "h1", "h2", "h3", "h4", "table", "thead", "tbody", "tr", "th", "td", "a", "hr"}  # fmt: skip


def _cite(text: Token, by_rank: dict) -> list[Token]:
    """A text token with [n] in it as text and citation-link tokens."""
    parts, at = [], 0
    for match in _CITATION.finditer(text.content):
        citation = by_rank.get(int(match.group(1)))
        if citation is None:
            continue
        url = reverse("chat:citation", args=[citation.id])
        parts.append(Token("text", "", 0, content=text.content[at : match.start()]))
        link = (
            f'<a href="{url}" class="cite" hx-get="{url}" hx-target="#citation-panel">'
            f"[{citation.rank}]</a>"
        )
        parts.append(Token("html_inline", "", 0, content=link))
        at = match.end()
    parts.append(Token("text", "", 0, content=text.content[at:]))
    return parts


@register.filter
def render_answer(text: str, citations) -> SafeString:
    by_rank = {c.rank: c for c in citations}
    tokens = _markdown.parse(text or "")
    for block in tokens:
        if block.type != "inline" or not block.children:
            continue
        children, in_link = [], 0
        for child in block.children:
            in_link += {"link_open": 1, "link_close": -1}.get(child.type, 0)
            if child.type == "text" and not in_link and _CITATION.search(child.content):
                children.extend(_cite(child, by_rank))
            else:
                children.append(child)
        block.children = children
    html = _markdown.renderer.render(tokens, _markdown.options, {})
    cleaned = nh3.clean(
        html,
        tags=_ALLOWED_TAGS,
        attributes={"a": {"href", "class", "hx-get", "hx-target"}},
        url_schemes={"http", "https"},
        link_rel="noopener noreferrer",
    )
    return mark_safe(cleaned)  # noqa: S308 - nh3 allow-list sanitized above
