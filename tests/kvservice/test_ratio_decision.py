"""The recompute ratio decided in one place: the operator's setting, the measured curve and
the running model's fingerprint turned into a request's ratios (``kvservice.protocol.ratio``),
then the worker's policy on the loader's estimate (``kvservice.blend.planning.RatioPolicy``);
a curve measured on another model steers nothing and says so; one default, declared once."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from kvservice.blend.controller import LoadingController
from kvservice.blend.planning import RatioPolicy, check_ratio_curve
from kvservice.protocol import GenerateRequest
from kvservice.protocol.curve import CurveSeries, load_series
from kvservice.protocol.ratio import (
    DEFAULT_RECOMPUTE_RATIO,
    RatioSetting,
    plan_ratios,
    resolve_refresh_ratio,
)

REPOSITORY = Path(__file__).resolve().parents[2]
BUNDLED = "9ee0332e337276df2c492920980cfe04"  # the bundled SmolLM2's fingerprint


def _point(label: str, ratio: float, kl: float, refresh: float | None = None) -> dict:
    point = {"label": label, "ratio": ratio, "tf_kl_mean": kl}
    return point if refresh is None else point | {"refresh_ratio": refresh}


POINTS = [
    _point("reuse", 0.0, 0.09),
    _point("blend@0.05", 0.05, 0.05),
    _point("blend@0.15", 0.15, 0.03),
    _point("full", 1.0, 0.0),
    _point("blend@0.05>0.25", 0.05, 0.032, 0.25),
    _point("blend@0.15>0.25", 0.15, 0.028, 0.25),
]
CURVE = CurveSeries("fp16", POINTS, model_fingerprint="model-a")
TARGET = RatioSetting(mode="target", fidelity_target=0.04)


def test_a_fixed_ratio_is_sent_as_it_is_with_the_progressive_setting():
    plan = plan_ratios(RatioSetting(mode="fixed", fixed_ratio=0.3, refresh_ratio=0.5), CURVE)
    assert plan.request_fields() == {
        "recompute_ratio": 0.3,
        "target_ratio": None,
        "refresh_ratio": 0.5,
    }


def test_auto_sends_only_the_progressive_setting():
    plan = plan_ratios(RatioSetting(mode="auto", refresh_ratio=None), CURVE, "model-a")
    assert plan.request_fields() == dict.fromkeys(
        ("recompute_ratio", "target_ratio", "refresh_ratio")
    )
    assert plan.no_curve is None


def test_a_target_reads_the_curve_of_its_model():
    plan = plan_ratios(TARGET, CURVE, "model-a")
    assert plan.target_ratio == pytest.approx(0.10)  # halfway from 0.05 (0.05) to 0.15 (0.03)
    assert plan.refresh_ratio == 0.0 and plan.target_refresh is None  # plain blend reaches it
    assert plan.recompute_ratio is None and plan.no_curve is None


def test_a_target_plain_blend_reaches_late_takes_progressive_blend():
    setting = RatioSetting(mode="target", fidelity_target=0.03, refresh_ratio=0.25)
    plan = plan_ratios(setting, CURVE, "model-a")
    assert plan.target_ratio == pytest.approx(0.10) and plan.target_refresh == 0.25


def test_a_curve_of_another_model_steers_nothing_and_says_so():
    """Today's bug: the curve measured on one model steered target mode on any."""
    plan = plan_ratios(TARGET, CURVE, "model-b", command="python -m kvservice.bench --json x")
    assert plan.request_fields() == dict.fromkeys(
        ("recompute_ratio", "target_ratio", "refresh_ratio")
    )
    assert plan.no_curve.startswith("No ratio curve has been measured for this model")
    assert f"at least {DEFAULT_RECOMPUTE_RATIO:g}" in plan.no_curve
    assert plan.no_curve.endswith("Measure one with: python -m kvservice.bench --json x")


def test_an_unknown_fingerprint_on_either_side_cannot_be_checked_and_the_curve_is_read():
    unrecorded = CurveSeries("fp16", POINTS)  # a curve measured before the bench recorded it
    assert plan_ratios(TARGET, unrecorded, "model-b").target_ratio == pytest.approx(0.10)
    assert plan_ratios(TARGET, CURVE, None).target_ratio == pytest.approx(0.10)  # no heartbeat


def test_without_a_curve_or_a_point_that_reaches_it_the_controller_decides():
    assert plan_ratios(TARGET, None, "model-a").target_ratio is None
    unreachable = CurveSeries("fp16", [_point("reuse", 0.0, 0.09)], model_fingerprint="model-a")
    plan = plan_ratios(RatioSetting("target", fidelity_target=0.01, refresh_ratio=0.4), unreachable)
    assert plan.target_ratio is None and plan.refresh_ratio == 0.4 and plan.no_curve is None


def test_the_refresh_ratio_is_the_requests_else_the_workers():
    assert resolve_refresh_ratio(None, 0.25) == 0.25
    assert resolve_refresh_ratio(0.0, 0.25) == 0.0  # the operator turned it off
    assert resolve_refresh_ratio(0.4, None) == 0.4


def _policy(**fields) -> RatioPolicy:
    request = GenerateRequest("r1", "why?", [], **fields)
    return RatioPolicy(request, LoadingController(), worker_refresh_ratio=0.25)


def test_the_worker_policy_takes_up_the_request_and_the_loaders_estimate():
    estimate = {"num_tokens": 3000, "num_layers": 30, "load_bytes": {"cpu": 1 << 20}}
    assert _policy(recompute_ratio=0.3).choose(**estimate) == (0.3, None)
    assert _policy(mode="reuse").choose(**estimate) == (0.0, None)
    # no measurement yet: the controller's floor, the target's else the default
    ratio, decision = _policy(target_ratio=0.06).choose(**estimate)
    assert ratio == pytest.approx(0.06) and decision.source == "target"
    ratio, decision = _policy().choose(**estimate)
    assert ratio == DEFAULT_RECOMPUTE_RATIO and decision.source == "r_min"
    assert _policy().expected() == DEFAULT_RECOMPUTE_RATIO
    assert _policy().refresh_ratio == 0.25 and _policy(refresh_ratio=0.0).refresh_ratio == 0.0


def _write_curve(path: Path, fingerprint: str | None) -> Path:
    env = {"kv_codec": "fp16"} | ({"model_fingerprint": fingerprint} if fingerprint else {})
    path.write_text(json.dumps({"curve": POINTS, "env": env}))
    return path


def test_the_worker_says_at_start_that_the_curve_is_another_models(tmp_path, caplog):
    path = _write_curve(tmp_path / "ratio_curve.json", "model-a")
    with caplog.at_level(logging.WARNING, logger="kvservice.blend.planning"):
        report = check_ratio_curve("model-b", "fp16", path)
    assert report["fits"] is False and report["model_fingerprint"] == "model-a"
    assert "No ratio curve has been measured for this model" in report["note"]
    assert "measured on model model-a, not this one (model-b)" in caplog.text
    caplog.clear()
    assert check_ratio_curve("model-a", "fp16", path)["fits"] is True
    assert check_ratio_curve("model-a", "int8", path)["fits"] is None  # no curve of that codec
    assert not caplog.text


def test_the_shipped_curves_carry_the_bundled_models_fingerprint(smollm2_dir):
    """docs/ratio_curve*.json, measured on the bundled model, steer target mode for it (the
    fingerprint its chunk keys carry) and no other model."""
    from kvservice.model.checkpoint import checkpoint_fingerprint

    assert checkpoint_fingerprint(smollm2_dir) == BUNDLED
    paths = sorted((REPOSITORY / "docs").glob("ratio_curve*.json"))
    assert len(paths) >= 3
    for path in paths:
        curve = load_series(path)
        assert curve.model_fingerprint == BUNDLED, path.name
        assert plan_ratios(TARGET, curve, BUNDLED).no_curve is None
        assert plan_ratios(TARGET, curve, "another-model").target_ratio is None


# A ratio-named parameter, field or constant given a literal number strictly between 0 and 1:
# `recompute_ratio: float = 0.15`, `ratio=0.15`, `R_MIN = 0.15`. The bounds (0.0, 1.0: the fixed
# modes' reuse and full) are no default, nor is the bench's progressive point
# (BENCH_REFRESH_RATIO, a setting of the measurement).
LITERAL_DEFAULT = re.compile(
    r"\b(\w*ratio\w*|r_min\w*)\s*(:[^=\n]+)?=\s*0?\.\d*[1-9]\d*\b", re.IGNORECASE
)
NOT_DEFAULTS = {"BENCH_REFRESH_RATIO"}


def test_the_recompute_ratios_default_is_written_once():
    declared, others = [], []
    for package in ("kvservice", "webapp", "worker"):
        for path in sorted((REPOSITORY / package).rglob("*.py")):
            for line in path.read_text().splitlines():
                code = line.split("#", 1)[0]
                for match in LITERAL_DEFAULT.finditer(code):
                    where = f"{path.relative_to(REPOSITORY)}: {line.strip()}"
                    if match.group(1) == "DEFAULT_RECOMPUTE_RATIO":
                        declared.append(where)
                    elif match.group(1) not in NOT_DEFAULTS:
                        others.append(where)
    assert declared == ["kvservice/protocol/ratio.py: DEFAULT_RECOMPUTE_RATIO = 0.15"]
    assert others == []
    template = (REPOSITORY / "templates" / "dashboard" / "index.html").read_text()
    assert "'0.15'" not in template  # the fixed ratio's field shows the constant
