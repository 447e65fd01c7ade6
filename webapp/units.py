"""The product's number formats, in every template (``TEMPLATES`` builtins): counts with
thousands separators, bytes in binary units (the one unit of bytes on every page), seconds,
percentages. None shows as a dash."""

from __future__ import annotations

from django import template

register = template.Library()
DASH = "—"


@register.filter
def percent(value: float | None) -> str:
    return DASH if value is None else f"{value:.0%}" if value in (0, 1) else f"{value:.1%}"


@register.filter
def count(value: float | None) -> str:
    """A count or a rate, whole, with thousands separators: 3140 -> '3,140'."""
    return DASH if value is None else f"{value:,.0f}"


BINARY_UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


@register.filter
def kib(value: float | None) -> str:
    """Bytes in binary units, three significant digits: '22.5 KiB' (the one unit of bytes on
    the dashboard; Django's ``filesizeformat`` writes KiB as "KB"). From 1,000 to 1,023 of a
    unit, whole with a thousands separator: '1,010 KiB', where three digits read '1.01e+03'."""
    if value is None:
        return DASH
    for factor, unit in BINARY_UNITS:
        if value >= factor:
            scaled = value / factor
            return f"{scaled:,.0f} {unit}" if scaled >= 999.5 else f"{scaled:.3g} {unit}"
    return f"{value:.0f} B"


@register.filter
def bandwidth(value: float | None) -> str:
    """Bytes per second, binary units: '512 MiB/s'."""
    return DASH if not value else f"{kib(value)}/s"


@register.filter
def seconds(value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"
