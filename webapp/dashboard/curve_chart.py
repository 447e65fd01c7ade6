"""The ratio curve drawn as SVG: x = TTFT relative to full, y = mean teacher-forced KL to
full, one series per codec of the stored KV (``kvservice.protocol.curve`` reads the bench's
JSON into :class:`~kvservice.protocol.curve.CurveSeries`). The dashboard draws it
(``charts.ratio_curve``) and so does the bench's ``--plot``; plain Python and the standard
library, no Django, so the bench draws it without settings. Progressive blend's points are
drawn hollow and dashed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from kvservice.protocol.curve import CurveSeries, refresh_ratios

WIDTH, HEIGHT = 560, 340
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 60, 24, 34, 84
LEGEND_ROW = 20  # px between the legend's rows
FULL_COLOR = "#d92d20"  # full prefill reads no stored KV: one point, whatever the codec
# one colour per series, the store's codec (drawn first) in the dashboard's blend blue
SERIES_COLORS = ("#3056d3", "#dc6803", "#7a5af8", "#0e9384", "#c11574")
OTHER_COLOR = "#475467"


def _nice_max(value: float) -> float:
    """A round upper bound for an axis (1, 1.25, 1.5, 2, 2.5, 5 × 10^k): full prefill's
    point at 1.02 no longer doubles the axis to 2, leaving half the chart empty."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 1.25, 1.5, 2, 2.5, 5, 10):
        if step * 10**exponent >= value:
            return step * 10**exponent
    return 10.0 ** (exponent + 1)


def _ticks(top: float) -> list[float]:
    """0 to ``top`` in round steps (1, 2, 2.5 or 5 × 10^k), at most six of them."""
    exponent = math.floor(math.log10(top))
    step = next(
        s * 10.0**e
        for e in (exponent - 1, exponent)
        for s in (1, 2, 2.5, 5)
        if top / (s * 10.0**e) <= 6
    )
    return [i * step for i in range(round(top / step) + 1)]


def _fmt(value: float) -> str:
    return "0" if value == 0 else f"{value:.3g}"


def _kind(point: dict) -> str:
    """full, reuse, blend (``blend@0.05``) or progressive (``blend@0.05>0.25``): how the
    point is drawn."""
    if point.get("refresh_ratio"):
        return "progressive"
    return str(point.get("label", "")).partition("@")[0]


def _marker(kind: str, color: str) -> str:
    """A shape centred on (0, 0): full a square, reuse a diamond, blend a circle,
    progressive blend a ring."""
    if kind == "full":
        return f'<rect x="-4.5" y="-4.5" width="9" height="9" fill="{color}"/>'
    if kind == "reuse":
        return f'<polygon points="0,-6 6,0 0,6 -6,0" fill="{color}"/>'
    if kind == "progressive":
        return f'<circle r="3.5" fill="#fff" stroke="{color}" stroke-width="2"/>'
    return f'<circle r="4" fill="{color}"/>'


def _tooltip(point: dict, codec: str) -> str:
    parts = [f"{codec} {point.get('label', '')}".strip()]
    for name, text in (
        ("ratio", "recompute ratio"),
        ("refresh_ratio", "upgraded after the first token to"),
        ("ttft_ratio_to_full", "TTFT × full"),
        ("second_token_ratio_to_full", "second token × full's TTFT"),
        ("tf_kl_mean", "KL mean"),
        ("tf_kl_median", "KL median"),
        ("tf_agreement", "top-1 agreement"),
        ("tf_logprob_gap_mean", "log-prob gap"),
    ):
        if point.get(name) is not None:
            parts.append(f"{text} {point[name]:.4g}")
    return escape(" · ".join(parts))


@dataclass(frozen=True)
class _Frame:
    """The plot area: data coordinates (x from 0 to ``x_top``, y from 0 to ``y_top``) to SVG
    coordinates, y growing downwards."""

    x_top: float
    y_top: float
    left: int = MARGIN_LEFT
    top: int = MARGIN_TOP
    width: int = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    height: int = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM

    def x(self, value: float) -> float:
        return self.left + self.width * min(max(value, 0.0), self.x_top) / self.x_top

    def y(self, value: float) -> float:
        return self.top + self.height * (1 - min(max(value, 0.0), self.y_top) / self.y_top)


def ratio_curve_svg(points: list[dict], title: str) -> str:
    """One curve (a bench run's ``curve``) drawn by :func:`ratio_curves_svg`."""
    return ratio_curves_svg([CurveSeries("", points)], title)


def _drawable(points: list[dict]) -> list[dict]:
    return [
        p
        for p in points
        if p.get("ttft_ratio_to_full") is not None and p.get("tf_kl_mean") is not None
    ]


def ratio_curves_svg(
    series: Sequence[CurveSeries], title: str, *, current: str | None = None
) -> str:
    """An inline ``<svg>``: x = TTFT relative to full, y = mean teacher-forced KL to full; one
    colour per series (codec), in the order given, one marker per point (full once: it reads
    no stored KV), each labelled (blend with its ratio), each series' blend points joined in
    ratio order, the bootstrap 95 % interval of the mean as a bar where the point has one.
    The legend names each series' codec, ``current`` (the codec the store writes) marked.
    Lower left is fast and faithful. Every label is escaped."""
    drawn = []  # (codec, colour, points)
    full_drawn = False
    for index, one in enumerate(series):
        points = []
        for point in _drawable(one.points):
            if _kind(point) == "full":
                if full_drawn:
                    continue
                full_drawn = True
            points.append(point)
        drawn.append((one.codec, SERIES_COLORS[index % len(SERIES_COLORS)], points))
    every = [p for _, _, points in drawn for p in points]
    heading = (
        f'<text x="{MARGIN_LEFT}" y="18" font-size="13" font-weight="600" fill="#1d2330" '
        f'class="chart-title">{escape(title)}</text>'
    )
    if not every:
        empty = (
            f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" '
            f'class="empty">No curve points</text>'
        )
        return _svg(title, [heading, empty])
    highs = [p["tf_kl_ci95"][1] for p in every if p.get("tf_kl_ci95")]
    frame = _Frame(
        x_top=_nice_max(max(1.0, *(p["ttft_ratio_to_full"] for p in every))),
        y_top=_nice_max(max([p["tf_kl_mean"] for p in every] + highs)),
    )
    parts = [heading, *_axes(frame)]
    placed: list[tuple[float, float, float]] = []  # every series' labels, kept apart
    for codec, color, points in drawn:
        parts += _points(frame, points, codec, color, placed)
    legend, height = _legend(drawn, current)
    return _svg(title, [*parts, *legend], height=height)


def _axes(frame: _Frame) -> list[str]:
    bottom = frame.top + frame.height
    parts = []
    for value in _ticks(frame.y_top):
        y = frame.y(value)
        parts.append(
            f'<line x1="{frame.left}" x2="{frame.left + frame.width}" y1="{y:.1f}" '
            f'y2="{y:.1f}" stroke="#eaecf0" class="grid"/>'
            f'<text x="{frame.left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(value)}</text>'
        )
    for value in _ticks(frame.x_top):
        x = frame.x(value)
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}" stroke="#98a2b3" '
            f'class="axis"/><text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">'
            f"{_fmt(value)}</text>"
        )
    middle = frame.top + frame.height / 2
    parts.append(
        f'<text x="{frame.left + frame.width / 2:.1f}" y="{bottom + 32}" text-anchor="middle">'
        f"TTFT relative to full prefill (lower is faster)</text>"
        f'<text x="14" y="{middle:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 14 {middle:.1f})">mean KL to full (teacher-forced)</text>'
    )
    return parts


def _points(
    frame: _Frame,
    drawn: list[dict],
    codec: str,
    color: str,
    placed: list[tuple[float, float, float]],
) -> list[str]:
    """One series' lines, markers and labels; ``placed``: the labels drawn so far, of every
    series, as (left, right, baseline), which this series' labels keep clear of and join."""
    parts = []
    for refresh in [None, *refresh_ratios(drawn)]:  # blend's line, then each progressive one
        line = sorted(
            (
                p
                for p in drawn
                if _kind(p) in ("blend", "progressive") and p.get("refresh_ratio") == refresh
            ),
            key=lambda p: p.get("ratio") or 0,
        )
        if len(line) < 2:
            continue
        path = " ".join(
            f"{frame.x(p['ttft_ratio_to_full']):.1f},{frame.y(p['tf_kl_mean']):.1f}" for p in line
        )
        dashed = "" if refresh is None else ' stroke-dasharray="4 3"'
        parts.append(
            f'<polyline points="{path}" fill="none" stroke="{color}"{dashed} '
            f'stroke-opacity=".6" stroke-width="1.5" '
            f'class="{"blend-line" if refresh is None else "progressive-line"}"/>'
        )
    codec_attr = f' data-codec="{escape(codec)}"' if codec else ""
    for point in drawn:
        kind = _kind(point)
        point_color = FULL_COLOR if kind == "full" else color
        x, y = frame.x(point["ttft_ratio_to_full"]), frame.y(point["tf_kl_mean"])
        if point.get("tf_kl_ci95"):
            low, high = point["tf_kl_ci95"]
            parts.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{frame.y(low):.1f}" '
                f'y2="{frame.y(high):.1f}" stroke="{point_color}" stroke-opacity=".5" '
                f'class="interval"/>'
            )
        parts.append(
            f'<g class="marker marker-{escape(kind)}"{codec_attr} '
            f'transform="translate({x:.1f} {y:.1f})">'
            f"<title>{_tooltip(point, codec)}</title>{_marker(kind, point_color)}</g>"
        )
        # Blend points sit close together: each is labelled with its (first token's) ratio
        # alone (the legend says so), in its series' colour, to the right; above the point
        # (clear of a curve that falls to the right), a progressive one below, and moved on
        # where a label already drawn is in the way.
        label = str(point.get("label", ""))
        ratios = label.partition("@")[2]  # "0.05", or "0.05>0.25" for a progressive one
        text = {"blend": ratios, "progressive": ratios.rpartition(">")[0]}.get(kind, label)
        parts.append(_label(frame, placed, x, y, text, point_color, below=kind == "progressive"))
    return parts


def _label(
    frame: _Frame, placed: list, x: float, y: float, text: str, color: str, *, below: bool
) -> str:
    """A point's label beside (``x``, ``y``): to its right (left near the right edge), then
    on its other side, at the first of a few heights where it overlaps no label in
    ``placed`` (which it joins). Where every place is taken (three codecs' points crowd
    together), none: the point's tooltip and the table below the chart still say it."""
    width = 6.5 * len(text)  # ~11 px type
    first = "end" if x > frame.left + frame.width * 0.85 else "start"
    heights = (16, 28, -7, -19) if below else (-7, -19, 16, 28)
    for anchor in (first, "start" if first == "end" else "end"):
        left = x + (-8 if anchor == "end" else 6)
        left, right = (left - width, left) if anchor == "end" else (left, left + width)
        for dy in heights:
            if all(
                right <= a or left >= b or abs(y + dy - baseline) >= 12 for a, b, baseline in placed
            ):
                placed.append((left, right, y + dy))
                x_text = right if anchor == "end" else left
                return (
                    f'<text x="{x_text:.1f}" y="{y + dy:.1f}" text-anchor="{anchor}" '
                    f'fill="{color}" class="point-label">{escape(text)}</text>'
                )
    return ""


def _legend(drawn: list[tuple[str, str, list[dict]]], current: str | None) -> tuple[list, int]:
    """The modes' shapes, then one swatch per named series (codec), in rows that wrap at the
    chart's right edge (a long codec name ran off it); and the chart's height with them."""
    kinds = [("full", "full prefill"), ("reuse", "reuse (ratio 0)")]
    upgrades = refresh_ratios([p for _, _, points in drawn for p in points])
    if upgrades:  # the ring's label is its first token's ratio; the legend names the upgrade
        then = "/".join(f"{r:g}" for r in upgrades)
        kinds += [("blend", "blend (its ratio)"), ("progressive", f"then {then} (progressive)")]
    else:
        kinds.append(("blend", "blend, labelled with its recompute ratio"))
    entries = [  # (a shape centred on (0, 0), its text, the text's class)
        (_marker(kind, FULL_COLOR if kind == "full" else OTHER_COLOR), text, "")
        for kind, text in kinds
    ]
    for codec, color, _ in drawn:
        if codec:
            text = f"KV stored as {codec}" + (" (the store's codec)" if codec == current else "")
            swatch = f'<rect x="-5" y="-5" width="10" height="10" fill="{color}"/>'
            entries.append((swatch, escape(text), ' class="series-label"'))
    parts, x, y = [], MARGIN_LEFT, HEIGHT - 28
    for shape, text, css in entries:
        width = 30 + 6 * len(text)  # ~11 px type
        if x > MARGIN_LEFT and x + width - 16 > WIDTH - MARGIN_RIGHT:
            x, y = MARGIN_LEFT, y + LEGEND_ROW
        parts.append(
            f'<g transform="translate({x + 5} {y - 4})">{shape}</g>'
            f'<text x="{x + 14}" y="{y}"{css}>{text}</text>'
        )
        x += width
    return parts, max(HEIGHT, y + 12)


def _svg(title: str, parts: list[str], *, height: int = HEIGHT) -> str:
    return (
        f'<svg class="chart ratio-curve" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'xmlns="http://www.w3.org/2000/svg" aria-label="{escape(title)}" '
        f'font-family="system-ui, sans-serif" font-size="11" fill="#475467">'
        f"<title>{escape(title)}</title>{''.join(parts)}</svg>"
    )
