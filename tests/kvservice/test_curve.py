"""The ratio curve's SVG and the JSON it is read from."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest

from kvservice.protocol.curve import (
    UNRECORDED_CODEC,
    CurveSeries,
    bench_command,
    load_series,
    plan_for_target,
    predict,
    ratio_for_target,
    refresh_ratios,
    series_path,
    series_paths,
)
from webapp.dashboard.curve_chart import (
    FULL_COLOR,
    SERIES_COLORS,
    ratio_curve_svg,
    ratio_curves_svg,
)

SVG = "{http://www.w3.org/2000/svg}"


def _point(label: str, ratio: float, ttft: float, kl: float) -> dict:
    return {
        "label": label,
        "ratio": ratio,
        "ttft_median_s": ttft * 2.0,
        "ttft_ratio_to_full": ttft,
        "tf_kl_mean": kl,
        "tf_kl_median": kl / 2,
        "tf_kl_ci95": [kl * 0.8, kl * 1.2],
        "tf_agreement": 1 - kl,
        "tf_logprob_gap_mean": kl / 3,
    }


POINTS = [
    _point("reuse", 0.0, 0.12, 0.40),
    _point("blend@0.05", 0.05, 0.20, 0.09),
    _point("blend@0.15", 0.15, 0.31, 0.05),
    _point("blend@0.4", 0.4, 0.55, 0.02),
    _point("full", 1.0, 1.0, 0.0),
]


def _markers(svg: str) -> list[tuple[str, float, float]]:
    """(class, x, y) of each marker, in the order drawn."""
    root = ET.fromstring(svg)  # also shows the SVG is well-formed XML
    found = []
    for group in root.iter(f"{SVG}g"):
        if "marker" in group.get("class", "").split():
            x, y = re.fullmatch(r"translate\(([\d.]+) ([\d.]+)\)", group.get("transform")).groups()
            found.append((group.get("class"), float(x), float(y)))
    return found


def test_one_marker_per_point_with_full_and_reuse_drawn_apart():
    svg = ratio_curve_svg(POINTS, "Quality against speed")
    markers = _markers(svg)
    assert len(markers) == len(POINTS)
    assert [cls for cls, _, _ in markers] == [
        "marker marker-reuse",
        *["marker marker-blend"] * 3,
        "marker marker-full",
    ]
    for label in ("reuse", "0.05", "0.15", "0.4", "full"):  # blend points: their ratio
        assert f'class="point-label">{label}</text>' in svg
    line = ET.fromstring(svg).find(f"{SVG}polyline")
    assert line is not None and len(line.get("points").split()) == 3  # the blend points only


def test_x_grows_with_ttft_and_y_falls_with_kl():
    markers = _markers(ratio_curve_svg(POINTS, "t"))
    xs = [x for _, x, _ in markers]
    ys = [y for _, _, y in markers]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)  # TTFT rises along POINTS
    assert ys == sorted(ys) and len(set(ys)) == len(ys)  # KL falls: SVG y grows downwards
    # The mapping is linear: equal steps in TTFT are equal steps on the page.
    even = _markers(
        ratio_curve_svg([_point(f"blend@{i}", i / 10, i / 4, 0.1) for i in range(1, 5)], "t")
    )
    steps = [b[1] - a[1] for a, b in zip(even, even[1:], strict=False)]
    assert min(steps) > 0 and max(steps) - min(steps) < 0.2


def test_labels_and_title_are_escaped():
    points = [_point("<script>x</script>&", 0.1, 0.3, 0.05), _point("blend@<i>", 0.1, 0.4, 0.04)]
    svg = ratio_curve_svg(points, 'A "title" <b>')
    assert "<script>" not in svg and "<b>" not in svg and "<i>" not in svg
    assert ">&lt;script&gt;x&lt;/script&gt;&amp;</text>" in svg and ">&lt;i&gt;</text>" in svg
    assert ET.fromstring(svg).find(f"{SVG}title").text == 'A "title" <b>'


def test_no_drawable_points_says_so():
    svg = ratio_curve_svg([{"label": "full", "ttft_ratio_to_full": None, "tf_kl_mean": 0.0}], "t")
    assert _markers(svg) == [] and "No curve points" in svg


def test_load_series_reads_the_bench_json(tmp_path):
    path = tmp_path / "curve.json"
    assert load_series(path) is None  # not measured yet
    path.write_text(json.dumps({"modes": {}, "curve": POINTS}))
    assert load_series(path).points == POINTS
    path.write_text(json.dumps({"modes": {}}))  # a bench run without --ratios
    with pytest.raises(ValueError, match="--ratios"):
        load_series(path)
    path.write_text("{not json")
    with pytest.raises(ValueError):
        load_series(path)


def test_ratio_for_target_interpolates_the_first_crossing():
    # reuse 0.40, 0.05 -> 0.09, 0.15 -> 0.05, 0.4 -> 0.02, full 0
    assert ratio_for_target(POINTS, 0.09) == pytest.approx(0.05)
    assert ratio_for_target(POINTS, 0.07) == pytest.approx(0.10)  # halfway from 0.09 to 0.05
    assert ratio_for_target(POINTS, 0.5) == 0.0  # reuse already reaches it
    assert ratio_for_target(POINTS, 0.0) == pytest.approx(1.0)  # only full
    without_full = [p for p in POINTS if p["label"] != "full"]
    assert ratio_for_target(without_full, 0.01) is None
    with pytest.raises(ValueError, match="not negative"):
        ratio_for_target(POINTS, -0.1)


def test_predict_interpolates_kl_and_f1_and_says_none_without_the_field():
    points = [dict(p, fidelity_f1=1.0 - p["tf_kl_mean"]) for p in POINTS]
    expected = predict(points, 0.10)
    assert expected["tf_kl_mean"] == pytest.approx(0.07)
    assert expected["fidelity_f1"] == pytest.approx(0.93)
    assert predict(points, 2.0)["tf_kl_mean"] == 0.0  # past the last point: its value
    assert predict(POINTS, 0.10)["fidelity_f1"] is None


def _series(codec: str, shift: float) -> CurveSeries:
    """A codec's curve: the same ratios, its KL ``shift`` above ``POINTS``' (full stays 0)."""
    return CurveSeries(
        codec,
        [dict(p, tf_kl_mean=p["tf_kl_mean"] + shift * (p["label"] != "full")) for p in POINTS],
    )


def test_one_series_per_codec_each_in_its_colour_with_full_drawn_once():
    svg = ratio_curves_svg(
        [_series("kivi4k3v", 0.0), _series("fp16", -0.01)], "t", current="kivi4k3v"
    )
    root = ET.fromstring(svg)
    markers = [g for g in root.iter(f"{SVG}g") if "marker" in g.get("class", "").split()]
    by_codec = {
        codec: [g.get("class") for g in markers if g.get("data-codec") == codec]
        for codec in ("kivi4k3v", "fp16")
    }
    assert by_codec["kivi4k3v"] == [c for c, _, _ in _markers(ratio_curve_svg(POINTS, "t"))]
    assert by_codec["fp16"] == ["marker marker-reuse", *["marker marker-blend"] * 3]  # no full
    lines = root.findall(f"{SVG}polyline")
    assert [line.get("stroke") for line in lines] == list(SERIES_COLORS[:2])  # a line per codec
    # every point labelled in its series' colour, blend points with their ratio
    labels = [
        (t.get("fill"), t.text) for t in root.iter(f"{SVG}text") if t.get("class") == "point-label"
    ]
    assert labels.count((SERIES_COLORS[1], "0.05")) == 1
    assert labels.count((SERIES_COLORS[0], "0.05")) == 1 and labels.count((FULL_COLOR, "full")) == 1
    legend = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "series-label"]
    assert legend == ["KV stored as kivi4k3v (the store's codec)", "KV stored as fp16"]
    # fp16's points (less KL) lie lower on the page than the same ratios' of the other codec
    ys = {
        codec: [
            float(g.get("transform").split()[1].rstrip(")"))
            for g in markers
            if g.get("data-codec") == codec
        ][:4]
        for codec in ("kivi4k3v", "fp16")
    }
    assert all(f > k for f, k in zip(ys["fp16"], ys["kivi4k3v"], strict=True))


def test_a_series_reads_its_codec_and_note_and_an_old_file_is_the_old_defaults(tmp_path):
    primary = tmp_path / "ratio_curve.json"
    assert load_series(primary) is None
    primary.write_text(json.dumps({"curve": POINTS, "env": {"first_example": 20}}))
    old = load_series(primary)
    assert old.codec == UNRECORDED_CODEC == "kivi4k3v" and old.points == POINTS
    assert old.note is None and old.path == str(primary)
    fp16 = series_path(primary, "fp16", "kivi4k3v")
    assert fp16 == tmp_path / "ratio_curve_fp16.json"
    assert series_path(primary, "kivi4k3v", "kivi4k3v") == primary
    fp16.write_text(
        json.dumps({"curve": POINTS[:2], "env": {"kv_codec": "fp16"}, "note": "busy machine"})
    )
    (tmp_path / "other.json").write_text("{}")  # not a sibling of the primary
    assert series_paths(primary) == [primary, fp16]
    read = load_series(fp16)
    assert (read.codec, read.points, read.note) == ("fp16", POINTS[:2], "busy machine")


def test_the_bench_command_names_the_codec_it_measures():
    command = bench_command("docs/ratio_curve_fp16.json", "fp16")
    assert command.startswith("KV_CODEC=fp16 python -m kvservice.bench ")
    assert command.endswith("--json docs/ratio_curve_fp16.json") and "--first 20" in command
    assert bench_command("x.json").startswith("python -m kvservice.bench ")
    assert "--refresh 0.25" in command  # progressive blend's points on the same curve


def _progressive(ratio: float, ttft: float, kl: float, refresh: float = 0.25) -> dict:
    return dict(
        _point(f"blend@{ratio:g}>{refresh:g}", ratio, ttft, kl),
        refresh_ratio=refresh,
        second_token_ratio_to_full=ttft + 0.5,
    )


# progressive blend upgrading to 0.25: 0.05 -> 0.030, 0.15 -> 0.026 (plain: 0.09, 0.05)
WITH_PROGRESSIVE = [*POINTS, _progressive(0.05, 0.20, 0.030), _progressive(0.15, 0.31, 0.026)]


def test_progressive_points_are_a_curve_of_their_own():
    assert refresh_ratios(WITH_PROGRESSIVE) == [0.25] and refresh_ratios(POINTS) == []
    # plain blend reads its own points, as before the progressive ones were added
    assert ratio_for_target(WITH_PROGRESSIVE, 0.07) == pytest.approx(0.10)
    assert predict(WITH_PROGRESSIVE, 0.10)["tf_kl_mean"] == pytest.approx(0.07)
    assert ratio_for_target(WITH_PROGRESSIVE, 0.028, 0.25) == pytest.approx(0.10)
    assert predict(WITH_PROGRESSIVE, 0.10, 0.25)["tf_kl_mean"] == pytest.approx(0.028)
    assert ratio_for_target(WITH_PROGRESSIVE, 0.02, 0.25) is None  # never reaches it
    assert predict(WITH_PROGRESSIVE, 0.10, 0.4)["tf_kl_mean"] is None  # not measured


def test_plan_for_target_takes_progressive_blend_only_where_it_starts_lower():
    # 0.04: plain needs 0.15 + (0.4-0.15)/3 ~ 0.233; progressive from 0.05
    assert plan_for_target(WITH_PROGRESSIVE, 0.04, 0.25) == (pytest.approx(0.05), 0.25)
    assert plan_for_target(WITH_PROGRESSIVE, 0.04) == (pytest.approx(0.15 + 0.25 / 3), None)
    # 0.09: plain reaches it at 0.05, as low as progressive's first point: plain
    assert plan_for_target(WITH_PROGRESSIVE, 0.09, 0.25) == (pytest.approx(0.05), None)
    # 0.02: progressive never reaches it; plain at 0.4
    assert plan_for_target(WITH_PROGRESSIVE, 0.02, 0.25) == (pytest.approx(0.4), None)
    # no progressive curve at that upgrade: plain
    assert plan_for_target(WITH_PROGRESSIVE, 0.04, 0.4)[1] is None
    # a progressive curve past its upgrade ratio is never chosen (nothing to upgrade)
    late = [*POINTS, _progressive(0.3, 0.4, 0.001, refresh=0.25)]
    assert plan_for_target(late, 0.01, 0.25) == (pytest.approx(0.7), None)  # 0.4 -> 0.02, full 0


def test_progressive_points_are_drawn_as_rings_on_a_dashed_line_and_named_in_the_legend():
    svg = ratio_curve_svg(WITH_PROGRESSIVE, "Quality against speed")
    kinds = [cls.split()[1] for cls, _, _ in _markers(svg)]
    assert kinds.count("marker-progressive") == 2 and kinds.count("marker-blend") == 3
    root = ET.fromstring(svg)
    lines = {line.get("class"): line for line in root.iter(f"{SVG}polyline")}
    assert lines["progressive-line"].get("stroke-dasharray") and lines["blend-line"] is not None
    assert len(lines["progressive-line"].get("points").split()) == 2
    assert "then 0.25 (progressive)" in svg  # the legend names the upgrade
    assert "blend@0.05&gt;0.25" in svg and "second token × full" in svg  # its tooltip
    assert "progressive" not in ratio_curve_svg(POINTS, "plain")


def test_labels_that_would_overlap_are_moved_apart():
    """Progressive points sit right beside plain blend's: every label is drawn where no
    other covers it, a ring's (its first token's ratio) below it by preference."""
    svg = ratio_curve_svg(WITH_PROGRESSIVE, "Quality against speed")
    root = ET.fromstring(svg)
    labels = [
        (float(t.get("x")), float(t.get("y")), t.text)
        for t in root.iter(f"{SVG}text")
        if t.get("class") == "point-label"
    ]
    assert sorted(text for *_, text in labels) == sorted(
        ["reuse", "0.05", "0.15", "0.4", "full", "0.05", "0.15"]
    )
    for i, (x0, y0, a) in enumerate(labels):
        for x1, y1, b in labels[i + 1 :]:
            wide = 6.5 * max(len(a), len(b))
            assert abs(x0 - x1) >= wide or abs(y0 - y1) >= 12, (a, b)
    rings = [(x, y) for cls, x, y in _markers(svg) if "marker-progressive" in cls]
    for x, y in rings:  # a ring's label sits below it (a larger y)
        assert any(abs(lx - (x + 6)) < 1 and ly > y for lx, ly, _ in labels)
