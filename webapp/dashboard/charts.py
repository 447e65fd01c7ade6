"""Server-side SVG charts: plain functions from numbers to an inline ``<svg>`` string.

No JavaScript and nothing loaded from anywhere: the page is complete as rendered (and in a
screenshot). Every label is escaped; the result is marked safe for the template.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from kvservice.protocol.curve import CurveSeries
from webapp.dashboard import wording
from webapp.dashboard.curve_chart import ratio_curves_svg

WIDTH, HEIGHT = 520, 220
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 52, 16, 30, 42
MODE_COLORS = {"blend": "#3056d3", "full": "#d92d20", "reuse": "#039855", "prefix": "#dc6803"}
TIER_COLORS = {
    "device": "#7a5af8",
    "cpu": "#3056d3",
    "disk": "#dc6803",
    "s3": "#039855",
    "recomputed": "#98a2b3",
}
FALLBACK_COLORS = ("#475467", "#c11574", "#0e9384", "#854a0e")


def color_for(name: str, palette: Mapping[str, str] = MODE_COLORS) -> str:
    if name in palette:
        return palette[name]
    return FALLBACK_COLORS[sum(map(ord, name)) % len(FALLBACK_COLORS)]


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 1:
        return f"{value:.3g}"
    return f"{value:.2g}"


def _nice_max(value: float) -> float:
    """A round upper bound for an axis (1, 2, 2.5, 5 × 10^k)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        bound = step * 10**exponent
        if bound >= value:
            return bound
    return 10 ** (exponent + 1)


class _Frame:
    """Plot area geometry plus the axis scaffolding every chart shares."""

    def __init__(self, *, y_max: float, y_label: str, width: int = WIDTH, height: int = HEIGHT):
        self.width, self.height = width, height
        self.left, self.top = MARGIN_LEFT, MARGIN_TOP
        self.plot_w = width - MARGIN_LEFT - MARGIN_RIGHT
        self.plot_h = height - MARGIN_TOP - MARGIN_BOTTOM
        self.y_max = y_max
        self.y_label = y_label
        self.parts: list[str] = []

    def y(self, value: float) -> float:
        return self.top + self.plot_h * (1 - min(value, self.y_max) / self.y_max)

    def x(self, fraction: float) -> float:
        return self.left + self.plot_w * fraction

    def axes(self) -> None:
        for i in range(5):
            value = self.y_max * i / 4
            y = self.y(value)
            self.parts.append(
                f'<line x1="{self.left}" x2="{self.left + self.plot_w}" y1="{y:.1f}" '
                f'y2="{y:.1f}" class="grid"/>'
                f'<text x="{self.left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(value)}</text>'
            )
        self.parts.append(
            f'<text x="12" y="{self.top + self.plot_h / 2:.1f}" text-anchor="middle" '
            f'transform="rotate(-90 12 {self.top + self.plot_h / 2:.1f})">'
            f"{escape(self.y_label)}</text>"
        )

    def x_tick(self, fraction: float, label: str) -> None:
        x = self.x(fraction)
        base = self.top + self.plot_h
        anchor = "start" if fraction <= 0.02 else "end" if fraction >= 0.98 else "middle"
        self.parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{base}" y2="{base + 4}" class="axis"/>'
            f'<text x="{x:.1f}" y="{base + 16}" text-anchor="{anchor}">{escape(label)}</text>'
        )

    def legend(self, names: Sequence[str], palette: Mapping[str, str]) -> None:
        x = self.left
        y = self.height - 8
        for name in names:
            color = color_for(name, palette)
            self.parts.append(
                f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{color}"/>'
                f'<text x="{x + 14}" y="{y}">{escape(name)}</text>'
            )
            x += 22 + 7 * len(name)

    def render(self, title: str) -> SafeString:
        heading = f'<text x="{self.left}" y="16" class="chart-title">{escape(title)}</text>'
        body = heading + "".join(self.parts)
        return mark_safe(  # noqa: S308 - every interpolated label above is escaped
            f'<svg class="chart" viewBox="0 0 {self.width} {self.height}" role="img" '
            f'xmlns="http://www.w3.org/2000/svg" aria-label="{escape(title)}">'
            f"<title>{escape(title)}</title>{body}</svg>"
        )


CURVE_TITLE = "Answer quality against speed, per recompute ratio"
# the y axis as ``curve_chart`` labels it (for the bench's plots), and in words
CURVE_Y_LABEL = ("mean KL to full (teacher-forced)", "difference from full (mean KL)")


def ratio_curve(series: Sequence[CurveSeries], *, current: str | None = None) -> SafeString:
    """The bench's quality/speed curves, one series per codec, ``current`` (the store's)
    marked (drawn by ``curve_chart``, as ``--plot`` draws one); the legend names
    each codec by its bit widths (short enough for one line of the legend)."""
    named = {one.codec: wording.codec_in_words(one.codec, short=True) for one in series}
    for codec, words in named.items():
        if codec == current:
            named[codec] = f"{words} (in use)"
    svg = ratio_curves_svg([replace(one, codec=named[one.codec]) for one in series], CURVE_TITLE)
    for codec, words in named.items():  # the attribute keeps the codec's name
        svg = svg.replace(f'data-codec="{escape(words)}"', f'data-codec="{escape(codec)}"')
    svg = svg.replace(*CURVE_Y_LABEL)
    return mark_safe(svg)  # noqa: S308 - ratio_curves_svg escapes every label


def empty_chart(title: str, message: str = "No data yet") -> SafeString:
    frame = _Frame(y_max=1.0, y_label="")
    frame.parts.append(
        f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="empty">'
        f"{escape(message)}</text>"
    )
    return frame.render(title)


def time_series(
    series: Mapping[str, Sequence[tuple[datetime, float]]],
    *,
    title: str,
    y_label: str,
    y_max: float | None = None,
    palette: Mapping[str, str] = MODE_COLORS,
) -> SafeString:
    """Points over time, one colour per series, joined by a thin line."""
    points = [p for values in series.values() for p in values]
    if not points:
        return empty_chart(title)
    start = min(t for t, _ in points).timestamp()
    end = max(t for t, _ in points).timestamp()
    span = (end - start) or 1.0
    frame = _Frame(y_max=y_max or _nice_max(max(v for _, v in points)), y_label=y_label)
    frame.axes()
    for i in range(3):
        fraction = i / 2
        moment = datetime.fromtimestamp(start + span * fraction, tz=points[0][0].tzinfo)
        frame.x_tick(fraction, moment.strftime("%H:%M" if span < 86400 else "%m-%d %H:%M"))
    for name, values in series.items():
        color = color_for(name, palette)
        coords = [(frame.x((t.timestamp() - start) / span), frame.y(v)) for t, v in values]
        if len(coords) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
            frame.parts.append(
                f'<polyline points="{path}" fill="none" stroke="{color}" stroke-opacity=".45"/>'
            )
        frame.parts.extend(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in coords
        )
    frame.legend(list(series), palette)
    return frame.render(title)


def histogram(
    values_by_series: Mapping[str, Sequence[float]],
    *,
    title: str,
    x_label: str,
    bins: int = 12,
    palette: Mapping[str, str] = MODE_COLORS,
) -> SafeString:
    """Distribution per series: side-by-side bars in shared bins (share of each series)."""
    values = [v for vs in values_by_series.values() for v in vs]
    if not values:
        return empty_chart(title)
    top = _nice_max(max(values))
    width = top / bins
    shares: dict[str, list[float]] = {}
    for name, vs in values_by_series.items():
        counts = [0] * bins
        for v in vs:
            counts[min(bins - 1, int(v / width))] += 1
        shares[name] = [c / len(vs) for c in counts] if vs else counts
    frame = _Frame(
        y_max=_nice_max(max(max(s) for s in shares.values())), y_label="share of answers"
    )
    frame.axes()
    names = [n for n in values_by_series if values_by_series[n]]
    slot = frame.plot_w / bins
    bar = slot * 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        color = color_for(name, palette)
        for b, share in enumerate(shares[name]):
            if share <= 0:
                continue
            x = frame.left + slot * b + slot * 0.1 + bar * i
            y = frame.y(share)
            frame.parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" '
                f'height="{frame.top + frame.plot_h - y:.1f}" fill="{color}">'
                f"<title>{escape(name)}: {share:.0%} in {_fmt(b * width)}–"
                f"{_fmt((b + 1) * width)} {escape(x_label)}</title></rect>"
            )
    for b in range(0, bins + 1, max(1, bins // 4)):
        frame.x_tick(b / bins, _fmt(b * width))
    frame.parts.append(
        f'<text x="{frame.left + frame.plot_w:.1f}" y="{frame.top + frame.plot_h + 30}" '
        f'text-anchor="end">{escape(x_label)}</text>'
    )
    frame.legend(names, palette)
    return frame.render(title)


def bars(
    labelled_values: Sequence[tuple[str, float]], *, title: str, y_label: str, every: int = 1
) -> SafeString:
    """One bar per label (e.g. questions per hour); every ``every``-th label is printed."""
    if not labelled_values or not any(v for _, v in labelled_values):
        return empty_chart(title)
    frame = _Frame(y_max=_nice_max(max(v for _, v in labelled_values)), y_label=y_label)
    frame.axes()
    slot = frame.plot_w / len(labelled_values)
    for i, (label, value) in enumerate(labelled_values):
        y = frame.y(value)
        frame.parts.append(
            f'<rect x="{frame.left + slot * i + slot * 0.1:.1f}" y="{y:.1f}" '
            f'width="{slot * 0.8:.1f}" height="{frame.top + frame.plot_h - y:.1f}" '
            f'fill="#3056d3"><title>{escape(label)}: {_fmt(value)}</title></rect>'
        )
        if i % every == 0:
            frame.x_tick((i + 0.5) / len(labelled_values), label)
    return frame.render(title)


def stacked_bars(
    rows: Sequence[tuple[str, Mapping[str, float]]],
    *,
    title: str,
    y_label: str,
    palette: Mapping[str, str] = TIER_COLORS,
) -> SafeString:
    """One stacked bar per row (e.g. which tier served each chunk of one answer)."""
    rows = [(label, parts) for label, parts in rows if sum(parts.values()) > 0]
    if not rows:
        return empty_chart(title)
    frame = _Frame(y_max=_nice_max(max(sum(p.values()) for _, p in rows)), y_label=y_label)
    frame.axes()
    names = sorted(
        {n for _, p in rows for n in p},
        key=lambda n: list(palette).index(n) if n in palette else len(palette),
    )
    slot = frame.plot_w / len(rows)
    for i, (label, parts) in enumerate(rows):
        base = 0.0
        for name in names:
            value = parts.get(name, 0)
            if not value:
                continue
            y_top, y_bottom = frame.y(base + value), frame.y(base)
            frame.parts.append(
                f'<rect x="{frame.left + slot * i + slot * 0.1:.1f}" y="{y_top:.1f}" '
                f'width="{max(1.0, slot * 0.8):.1f}" height="{y_bottom - y_top:.1f}" '
                f'fill="{color_for(name, palette)}"><title>{escape(label)}: {_fmt(value)} '
                f"{escape(name)}</title></rect>"
            )
            base += value
    every = max(1, len(rows) // 6)
    for i, (label, _) in enumerate(rows):
        if i % every == 0:
            frame.x_tick((i + 0.5) / len(rows), label)
    frame.legend(names, palette)
    return frame.render(title)
