"""The quality/speed curve a recompute ratio is chosen from, drawn as SVG.

``python -m kvservice.bench ... --ratios 0.05,0.10,0.15,0.25,0.40 --json out.json`` measures
it: the ``curve`` of its JSON holds one point for full, reuse and blend at each ratio, each
with its TTFT relative to full and its teacher-forced KL to full. ``--plot`` draws it with
:func:`ratio_curve_svg`; the staff dashboard draws the same points from the JSON
(:func:`load_curve`; :func:`bench_command` says how to measure it). Plain Python and the
standard library: no Django, no plotting library.

The curve also answers "which ratio for this fidelity": :func:`ratio_for_target` gives the
lowest recompute ratio whose interpolated mean KL to full is at most a target (the dashboard's
fidelity target), and :func:`predict` what the curve expects of a ratio (the fidelity audit's
prediction beside what it measured).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from html import escape
from pathlib import Path

WIDTH, HEIGHT = 560, 320
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 60, 24, 34, 64
COLORS = {"full": "#d92d20", "reuse": "#039855", "blend": "#3056d3"}  # the dashboard's modes
OTHER_COLOR = "#475467"


def bench_command(json_path: str) -> str:
    """The bench run that measures the curve, on the reporting examples (20-39; 0-19 are for
    tuning), writing its JSON to ``json_path``."""
    return (
        "python -m kvservice.bench --data ../shared/data/musique_dev.json --first 20 "
        "--examples 20 --passages 6 --modes full,reuse,blend --no-hf "
        f"--ratios 0.05,0.10,0.15,0.25,0.40 --json {json_path}"
    )


def load_curve(path: str | Path) -> list[dict] | None:
    """The ``curve`` of a JSON written by ``kvservice.bench --ratios``; None if there is no
    file. A file that is not such a JSON raises ValueError, saying what is wrong."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    data = json.loads(text)  # json.JSONDecodeError is a ValueError
    if not isinstance(data, dict) or "curve" not in data:
        raise ValueError(f"{path} has no 'curve': write it with kvservice.bench --ratios --json")
    curve = data["curve"]
    if not isinstance(curve, list) or not all(isinstance(point, dict) for point in curve):
        raise ValueError(f"{path}: 'curve' is not a list of points")
    return curve


def _by_ratio(points: list[dict], field: str) -> list[tuple[float, float]]:
    """(ratio, value) of the points that have both, by ratio; one value per ratio."""
    pairs = {}
    for point in points:
        ratio, value = point.get("ratio"), point.get(field)
        if isinstance(ratio, int | float) and isinstance(value, int | float):
            pairs.setdefault(float(ratio), float(value))
    return sorted(pairs.items())


def _interpolate(pairs: list[tuple[float, float]], ratio: float) -> float | None:
    """The piecewise-linear value at ``ratio`` (the nearest end outside the measured span)."""
    if not pairs:
        return None
    if ratio <= pairs[0][0]:
        return pairs[0][1]
    for (r0, v0), (r1, v1) in itertools.pairwise(pairs):
        if ratio <= r1:
            return v0 + (v1 - v0) * (ratio - r0) / (r1 - r0)
    return pairs[-1][1]


def predict(points: list[dict], ratio: float) -> dict[str, float | None]:
    """What the curve expects at ``ratio``: the mean teacher-forced KL to full
    (``tf_kl_mean``) and the token F1 of the greedy answer against full's (``fidelity_f1``),
    each interpolated between the measured ratios; None where the curve lacks the field."""
    return {
        field: _interpolate(_by_ratio(points, field), ratio)
        for field in ("tf_kl_mean", "fidelity_f1")
    }


def ratio_for_target(points: list[dict], max_kl: float) -> float | None:
    """The lowest recompute ratio at which the curve's mean KL to full, interpolated between
    the measured ratios, is at most ``max_kl``; None when no point of the curve reaches it
    (a curve without full). Walking up from the lowest ratio, the first point at or under the
    target ends the search, interpolated from the point before it."""
    if max_kl < 0:
        raise ValueError(f"a KL target is not negative, got {max_kl}")
    pairs = _by_ratio(points, "tf_kl_mean")
    for index, (ratio, kl) in enumerate(pairs):
        if kl > max_kl:
            continue
        if index == 0:
            return ratio
        r0, kl0 = pairs[index - 1]
        return r0 + (ratio - r0) * (kl0 - max_kl) / (kl0 - kl)
    return None


def _nice_max(value: float) -> float:
    """A round upper bound for an axis (1, 2, 2.5, 5 × 10^k)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if step * 10**exponent >= value:
            return step * 10**exponent
    return 10.0 ** (exponent + 1)


def _ticks(top: float) -> list[float]:
    """0 to ``top`` in round steps (1, 2 or 5 × 10^k), at most six of them."""
    exponent = math.floor(math.log10(top))
    step = next(
        s * 10.0**e for e in (exponent - 1, exponent) for s in (1, 2, 5) if top / (s * 10.0**e) <= 6
    )
    return [i * step for i in range(round(top / step) + 1)]


def _fmt(value: float) -> str:
    return "0" if value == 0 else f"{value:.3g}"


def _kind(point: dict) -> str:
    """full, reuse or blend (``blend@0.05``): how the point is drawn."""
    return str(point.get("label", "")).partition("@")[0]


def _marker(kind: str, color: str) -> str:
    """A shape centred on (0, 0): full a square, reuse a diamond, blend a circle."""
    if kind == "full":
        return f'<rect x="-4.5" y="-4.5" width="9" height="9" fill="{color}"/>'
    if kind == "reuse":
        return f'<polygon points="0,-6 6,0 0,6 -6,0" fill="{color}"/>'
    return f'<circle r="4" fill="{color}"/>'


def _tooltip(point: dict) -> str:
    parts = [str(point.get("label", ""))]
    for name, text in (
        ("ratio", "recompute ratio"),
        ("ttft_ratio_to_full", "TTFT × full"),
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
    """An inline ``<svg>``: x = TTFT relative to full, y = mean teacher-forced KL to full; one
    marker per point, labelled, the blend points joined in ratio order, full and reuse drawn
    apart, the bootstrap 95 % interval of the mean as a bar where the point has one. Lower
    left is fast and faithful. Every label is escaped."""
    drawn = [
        p
        for p in points
        if p.get("ttft_ratio_to_full") is not None and p.get("tf_kl_mean") is not None
    ]
    heading = (
        f'<text x="{MARGIN_LEFT}" y="18" font-size="13" font-weight="600" fill="#1d2330" '
        f'class="chart-title">{escape(title)}</text>'
    )
    if not drawn:
        empty = (
            f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" '
            f'class="empty">No curve points</text>'
        )
        return _svg(title, [heading, empty])
    highs = [p["tf_kl_ci95"][1] for p in drawn if p.get("tf_kl_ci95")]
    frame = _Frame(
        x_top=_nice_max(max(1.0, *(p["ttft_ratio_to_full"] for p in drawn))),
        y_top=_nice_max(max([p["tf_kl_mean"] for p in drawn] + highs)),
    )
    return _svg(title, [heading, *_axes(frame), *_points(frame, drawn), *_legend()])


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


def _points(frame: _Frame, drawn: list[dict]) -> list[str]:
    parts = []
    blend = sorted((p for p in drawn if _kind(p) == "blend"), key=lambda p: p.get("ratio") or 0)
    if len(blend) > 1:
        path = " ".join(
            f"{frame.x(p['ttft_ratio_to_full']):.1f},{frame.y(p['tf_kl_mean']):.1f}" for p in blend
        )
        parts.append(
            f'<polyline points="{path}" fill="none" stroke="{COLORS["blend"]}" '
            f'stroke-opacity=".6" stroke-width="1.5" class="blend-line"/>'
        )
    for point in drawn:
        kind = _kind(point)
        color = COLORS.get(kind, OTHER_COLOR)
        x, y = frame.x(point["ttft_ratio_to_full"]), frame.y(point["tf_kl_mean"])
        if point.get("tf_kl_ci95"):
            low, high = point["tf_kl_ci95"]
            parts.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{frame.y(low):.1f}" '
                f'y2="{frame.y(high):.1f}" stroke="{color}" stroke-opacity=".5" '
                f'class="interval"/>'
            )
        parts.append(
            f'<g class="marker marker-{escape(kind)}" transform="translate({x:.1f} {y:.1f})">'
            f"<title>{_tooltip(point)}</title>{_marker(kind, color)}</g>"
        )
        # Blend points sit close together: each is labelled with its ratio alone (the legend
        # says so), above and to the right, clear of a curve that falls to the right.
        label = str(point.get("label", ""))
        text = label.partition("@")[2] if kind == "blend" else label
        anchor = "end" if x > frame.left + frame.width * 0.85 else "start"
        parts.append(
            f'<text x="{x + (-8 if anchor == "end" else 6):.1f}" y="{y - 7:.1f}" '
            f'text-anchor="{anchor}" class="point-label">{escape(text)}</text>'
        )
    return parts


def _legend() -> list[str]:
    parts = []
    x, y = MARGIN_LEFT, HEIGHT - 10
    for kind, text in (
        ("full", "full prefill"),
        ("reuse", "reuse (ratio 0)"),
        ("blend", "blend, labelled with its recompute ratio"),
    ):
        parts.append(
            f'<g transform="translate({x + 5} {y - 4})">{_marker(kind, COLORS[kind])}</g>'
            f'<text x="{x + 14}" y="{y}">{text}</text>'
        )
        x += 24 + 6 * len(text)
    return parts


def _svg(title: str, parts: list[str]) -> str:
    return (
        f'<svg class="chart ratio-curve" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'xmlns="http://www.w3.org/2000/svg" aria-label="{escape(title)}" '
        f'font-family="system-ui, sans-serif" font-size="11" fill="#475467">'
        f"<title>{escape(title)}</title>{''.join(parts)}</svg>"
    )
