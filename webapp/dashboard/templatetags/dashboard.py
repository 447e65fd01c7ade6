"""Number formats for the dashboard (None shows as a dash)."""

from __future__ import annotations

from django import template

register = template.Library()
DASH = "—"


@register.filter
def percent(value: float | None) -> str:
    return DASH if value is None else f"{value:.0%}" if value in (0, 1) else f"{value:.1%}"


@register.filter
def si(value: float | None, unit: str = "") -> str:
    """1234567 -> '1.23 M<unit>'."""
    if value is None:
        return DASH
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


@register.filter
def bandwidth(value: float | None) -> str:
    """Bytes per second, binary units: '512 MiB/s'."""
    if not value:
        return DASH
    for factor, prefix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}/s"
    return f"{value:.0f} B/s"


@register.filter
def seconds(value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"
