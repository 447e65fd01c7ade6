"""Answers are Markdown from a model: rendered without raw HTML, then sanitized, and [n]
becomes a link to citation n: in the answer's text only (never inside a link, its title or
code), so nothing the model writes can put its own attributes on a citation link.

An answer is shown as written: a line break is a line break (Markdown would join the lines),
and a numbered list is one of two items or more. The bundled model numbers the lines of a
one-sentence answer, its citation on a line of its own ("1. The officer is Olga Brandt.\n2.
[1]"), which showed as a numbered list of the sentence and a lone "[1]": a list item of
citation markers alone is the citation of the item before it, and a numbered list left with
one item is the line as written, its number included."""

from __future__ import annotations

import re

import nh3
from django import template
from django.urls import reverse
from django.utils.safestring import SafeString, mark_safe
from markdown_it import MarkdownIt
from markdown_it.token import Token

register = template.Library()
_markdown = MarkdownIt("commonmark", {"html": False, "linkify": False, "breaks": True}).enable(
    "table"
)
_CITATION = re.compile(r"\[(\d{1,2})\]")
_CITATIONS_ALONE = re.compile(r"\s*(?:\[\d{1,2}\]\s*)+")
_ALLOWED_TAGS = {
    "p",
    "br",
    "strong",
    "em",
    "code",
    "pre",
    "ul",
    "ol",
    "li",
    "blockquote",
    "a",
    "h1",
    "h2",
    "h3",
    "h4",
    "table",
    "thead",
    "tbody",
    "tr",
    "th",
    "td",
    "hr",
}


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


def _item_paragraph(tokens: list[Token], at: int) -> Token | None:
    """The inline token of the list item opening at ``at`` when the item is one paragraph
    (a tight list's item: open, paragraph, inline, paragraph, close); else None."""
    kinds = [t.type for t in tokens[at : at + 5]]
    if kinds != [
        "list_item_open",
        "paragraph_open",
        "inline",
        "paragraph_close",
        "list_item_close",
    ]:
        return None
    return tokens[at + 2]


def _fold_citation_items(tokens: list[Token]) -> list[Token]:
    """Each list item of citation markers alone ("2. [1]") joined to the end of the item
    before it, as that item's citation."""
    folded: list[Token] = []
    at = 0
    while at < len(tokens):
        inline = _item_paragraph(tokens, at)
        alone = inline is not None and _CITATIONS_ALONE.fullmatch(inline.content)
        if alone and folded and folded[-1].type == "list_item_close":
            before = next(t for t in reversed(folded) if t.type == "inline")
            markers = " " + inline.content.strip()
            before.content += markers
            before.children = [*(before.children or []), Token("text", "", 0, content=markers)]
            at += 5
            continue
        folded.append(tokens[at])
        at += 1
    return folded


def _unlist_single_items(tokens: list[Token]) -> list[Token]:
    """A numbered list of one one-paragraph item as the line it was written as: "1. The
    first step is to", its number kept as text."""
    out: list[Token] = []
    at = 0
    while at < len(tokens):
        inline = _item_paragraph(tokens, at + 1) if tokens[at].type == "ordered_list_open" else None
        closing = tokens[at + 6] if inline is not None and at + 6 < len(tokens) else None
        if closing is None or closing.type != "ordered_list_close":
            out.append(tokens[at])
            at += 1
            continue
        item = tokens[at + 1]
        number = f"{item.info}{item.markup} "
        inline.content = number + inline.content
        inline.children = [Token("text", "", 0, content=number), *(inline.children or [])]
        paragraph_open, paragraph_close = tokens[at + 2], tokens[at + 4]
        paragraph_open.hidden = paragraph_close.hidden = False  # a tight list's are hidden
        out.extend([paragraph_open, inline, paragraph_close])
        at += 7
    return out


@register.filter
def render_answer(text: str, citations) -> SafeString:
    by_rank = {c.rank: c for c in citations}
    tokens = _unlist_single_items(_fold_citation_items(_markdown.parse(text or "")))
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
