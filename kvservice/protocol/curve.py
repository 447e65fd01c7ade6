"""The quality/speed curve a recompute ratio is chosen from: the bench's JSON and what it says.

``python -m kvservice.bench ... --ratios 0.05,0.10,0.15,0.25,0.40 --json out.json`` measures
it: the ``curve`` of its JSON holds one point for full, reuse and blend at each ratio, each
with its TTFT relative to full and its teacher-forced KL to full. The staff dashboard reads
the points from the JSON (:func:`load_series`; :func:`bench_command` says how to measure it)
and draws them (``webapp.dashboard.curve_chart``, as the bench's ``--plot`` does). Plain
Python and the standard library: no torch, no Django.

Ratio and codec are one quality/speed choice, so a curve is measured per codec of the stored
chunk KV (``KV_CODEC``; the bench records it as ``env.kv_codec``): the file the dashboard is
pointed at (``RATIO_CURVE_PATH``) and its siblings ``<stem>_<codec>.json`` are one
:class:`CurveSeries` each (:func:`load_series`).

The curve also answers "which ratio for this fidelity": :func:`ratio_for_target` gives the
lowest recompute ratio whose interpolated mean KL to full is at most a target (the dashboard's
fidelity target, read from the series of the codec the store writes), and :func:`predict`
what the curve expects of a ratio (the fidelity audit's prediction beside what it measured).

Progressive blend (``--refresh R``: blend at a ratio for the first token, the cache upgraded
to ``R`` before the second) adds points with a ``refresh_ratio``: a curve of its own at each
``R``. Every function that reads KL by ratio takes the ``refresh_ratio`` whose points it reads
(None: plain blend); :func:`plan_for_target` chooses between plain blend and progressive blend
for a target.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvservice.protocol import environment

# where RATIO_CURVE_PATH is relative to: the repository (kvservice's parent)
REPOSITORY = Path(__file__).resolve().parents[2]
# docs/ratio_curve.json was measured (966f619) before the bench recorded its codec, under
# the default of then; a curve that records none is taken to be that codec's.
UNRECORDED_CODEC = "kivi4k3v"


@dataclass(frozen=True)
class CurveSeries:
    """One measured curve: the codec its chunk KV was stored in, its points (the bench
    JSON's ``curve``), the file it was read from, the file's ``note`` on how it was
    measured (e.g. that its TTFT was taken on a busy machine) and the fingerprint of the
    model it was measured on (``env.model_fingerprint``; None where the file records none):
    a curve steers target mode only for that model (``kvservice.protocol.ratio``)."""

    codec: str
    points: list[dict]
    path: str = ""
    note: str | None = None
    model_fingerprint: str | None = None


# The ratio progressive blend upgrades to on the measured curve: "0.10, then 0.25" was chosen
# on the tuning examples (docs/blend.md, "Progressive blend").
BENCH_REFRESH_RATIO = 0.25


def bench_command(json_path: str, codec: str | None = None) -> str:
    """The bench run that measures the curve, on the reporting examples (20-39; 0-19 are for
    tuning), with chunk KV stored in ``codec`` (else ``KV_CODEC``'s), progressive blend's
    points upgrading to :data:`BENCH_REFRESH_RATIO`, writing its JSON to ``json_path``."""
    return (
        (f"KV_CODEC={codec} " if codec else "")
        + "python -m kvservice.bench --data ../shared/data/musique_dev.json --first 20 "
        "--examples 20 --passages 6 --modes full,reuse,blend --no-hf "
        f"--ratios 0.05,0.10,0.15,0.25,0.40 --refresh {BENCH_REFRESH_RATIO:g} "
        f"--json {json_path}"
    )


def series_path(path: str | Path, codec: str, primary_codec: str) -> Path:
    """Where the curve of ``codec`` is kept: ``path`` itself for ``primary_codec`` (the
    default's), else its sibling ``<stem>_<codec>.json``."""
    path = Path(path)
    return path if codec == primary_codec else path.with_name(f"{path.stem}_{codec}.json")


def series_paths(path: str | Path) -> list[Path]:
    """``path`` and its siblings ``<stem>_*.json`` (a curve per further codec), in name order."""
    path = Path(path)
    return [path, *sorted(p for p in path.parent.glob(f"{path.stem}_*.json") if p != path)]


def _read(path: str | Path) -> dict | None:
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
    return data


def load_series(path: str | Path) -> CurveSeries | None:
    """The ``curve`` of a JSON written by ``kvservice.bench --ratios``, with the codec it was
    measured with (``env.kv_codec``, else :data:`UNRECORDED_CODEC`), the file's ``note`` and
    the model's fingerprint (``env.model_fingerprint``); None if there is no file. A file that
    is not such a JSON raises ValueError, saying what is wrong."""
    data = _read(path)
    if data is None:
        return None
    env = data.get("env") if isinstance(data.get("env"), dict) else {}
    codec = env.get("kv_codec") or UNRECORDED_CODEC
    note = data.get("note") if isinstance(data.get("note"), str) else None
    fingerprint = env.get("model_fingerprint") or None
    return CurveSeries(str(codec), data["curve"], str(path), note, fingerprint and str(fingerprint))


def configured_path(environ: Mapping[str, str] | None = None) -> Path:
    """The curve ``RATIO_CURVE_PATH`` names, relative to the repository (as the web app's
    settings read it), for the worker's own check of it."""
    return REPOSITORY / environment.read("RATIO_CURVE_PATH", environ)


def series_for_codec(path: str | Path, codec: str) -> CurveSeries | None:
    """The first curve of ``codec`` among ``path`` and its siblings (:func:`series_paths`),
    files that cannot be read skipped (the dashboard shows why); None where none is."""
    for one_path in series_paths(path):
        try:
            one = load_series(one_path)
        except (OSError, ValueError):
            continue
        if one is not None and one.codec == codec:
            return one
    return None


def refresh_ratios(points: list[dict]) -> list[float]:
    """The ratios progressive blend was measured upgrading to, in order."""
    return sorted({float(p["refresh_ratio"]) for p in points if p.get("refresh_ratio")})


def _by_ratio(
    points: list[dict], field: str, refresh_ratio: float | None = None
) -> list[tuple[float, float]]:
    """(ratio, value) of the points that have both, by ratio, one value per ratio: plain
    blend's (with reuse and full) or, given ``refresh_ratio``, progressive blend's upgrading
    to it."""
    pairs = {}
    for point in points:
        if point.get("refresh_ratio") != refresh_ratio:
            continue
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


def predict(
    points: list[dict], ratio: float, refresh_ratio: float | None = None
) -> dict[str, float | None]:
    """What the curve expects at ``ratio`` (upgraded to ``refresh_ratio`` after the first
    token, where given): the mean teacher-forced KL to full (``tf_kl_mean``) and the token F1
    of the greedy answer against full's (``fidelity_f1``), each interpolated between the
    measured ratios; None where the curve lacks the field or that progressive curve."""
    return {
        field: _interpolate(_by_ratio(points, field, refresh_ratio), ratio)
        for field in ("tf_kl_mean", "fidelity_f1")
    }


def ratio_for_target(
    points: list[dict], max_kl: float, refresh_ratio: float | None = None
) -> float | None:
    """The lowest recompute ratio at which the curve's mean KL to full, interpolated between
    the measured ratios, is at most ``max_kl``; None when no point of the curve reaches it
    (a curve without full). Walking up from the lowest ratio, the first point at or under the
    target ends the search, interpolated from the point before it. With ``refresh_ratio``:
    the first token's ratio on the progressive curve upgrading to it."""
    if max_kl < 0:
        raise ValueError(f"a KL target is not negative, got {max_kl}")
    pairs = _by_ratio(points, "tf_kl_mean", refresh_ratio)
    for index, (ratio, kl) in enumerate(pairs):
        if kl > max_kl:
            continue
        if index == 0:
            return ratio
        r0, kl0 = pairs[index - 1]
        return r0 + (ratio - r0) * (kl0 - max_kl) / (kl0 - kl)
    return None


def plan_for_target(
    points: list[dict], max_kl: float, refresh_ratio: float | None = None
) -> tuple[float | None, float | None]:
    """(ratio, refresh ratio) for a fidelity target: plain blend's :func:`ratio_for_target`,
    or, where progressive blend upgrading to ``refresh_ratio`` reaches the target at a lower
    first-token ratio, that ratio and ``refresh_ratio``; (None, None) when neither reaches
    it. Progressive blend is never chosen at or above its upgrade's ratio (nothing to
    upgrade) nor where plain blend is as cheap."""
    plain = ratio_for_target(points, max_kl)
    if refresh_ratio is None:
        return plain, None
    first = ratio_for_target(points, max_kl, refresh_ratio)
    if first is None or first >= refresh_ratio or (plain is not None and plain <= first):
        return plain, None
    return first, refresh_ratio
