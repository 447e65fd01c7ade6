"""``{% load dashboard %}``: the product's number formats (``webapp.units``, which every
template has already) and the dashboard's own words (a codec as its bit widths, a tier by
what it is)."""

from __future__ import annotations

from django import template

from webapp import units
from webapp.dashboard.selectors import tier_label
from webapp.dashboard.wording import codec_in_words, model_name

register = template.Library()
register.filters.update(units.register.filters)
register.filter("codec_words", codec_in_words)
register.filter("tier_name", tier_label)
register.filter("model_name", model_name)


@register.filter
def codec_short(name: str | None) -> str:
    """A codec's bit widths in a table cell's few words."""
    return codec_in_words(name, short=True)
