from __future__ import annotations

import json

import pytest

from kvservice.controller import LoadingController, choose_ratio

MB = 1 << 20
# 3000 tokens x 30 layers; recompute at 900k token-layers/s -> full recompute 0.1 s
BASE = {"num_tokens": 3000, "num_layers": 30, "recompute_token_layers_per_s": 900_000.0}
BANDWIDTH = {"s3": 100 * MB, "disk": 500 * MB, "cpu": 10_000 * MB}


def test_fast_tier_gives_r_min():
    decision = choose_ratio(**BASE, load_bytes_by_tier={"cpu": 50 * MB}, tier_bandwidth=BANDWIDTH)
    assert decision.recompute_ratio == 0.15 and decision.source == "r_min"
    assert decision.load_s_estimate == pytest.approx(0.005)
    assert "r_min" in decision.why["rule"]


def test_slow_tier_raises_ratio_to_break_even():
    # 5 MB from S3 at 100 MB/s = 0.05 s = half of the 0.1 s full recompute
    decision = choose_ratio(**BASE, load_bytes_by_tier={"s3": 5 * MB}, tier_bandwidth=BANDWIDTH)
    assert decision.recompute_ratio == pytest.approx(0.5) and decision.source == "auto"
    assert decision.recompute_s_estimate == pytest.approx(decision.load_s_estimate)


def test_loading_slower_than_full_recompute_means_full_recompute():
    decision = choose_ratio(**BASE, load_bytes_by_tier={"s3": 50 * MB}, tier_bandwidth=BANDWIDTH)
    assert decision.recompute_ratio == 1.0 and "full recompute" in decision.why["rule"]


def test_slowest_serving_tier_bounds_the_load():
    decision = choose_ratio(
        **BASE, load_bytes_by_tier={"cpu": 40 * MB, "s3": 2 * MB}, tier_bandwidth=BANDWIDTH
    )
    assert decision.load_s_estimate == pytest.approx(0.02)
    assert decision.recompute_ratio == pytest.approx(0.2)


def test_admin_ratio_overrides():
    decision = choose_ratio(
        **BASE, load_bytes_by_tier={"s3": 50 * MB}, tier_bandwidth=BANDWIDTH, fixed_ratio=0.3
    )
    assert decision.recompute_ratio == 0.3 and decision.source == "admin"


def test_cheapest_tier_that_hides_loading():
    # budget at r_min: 0.15 * 0.1 s = 15 ms. 5 MB: S3 50 ms (no), disk 10 ms (yes)
    decision = choose_ratio(**BASE, load_bytes_by_tier={"s3": 5 * MB}, tier_bandwidth=BANDWIDTH)
    assert decision.cheapest_hidden_tier == "disk"
    assert decision.why["tiers"]["s3"]["hidden"] is False
    tiny = choose_ratio(**BASE, load_bytes_by_tier={"s3": MB // 2}, tier_bandwidth=BANDWIDTH)
    assert tiny.cheapest_hidden_tier == "s3"
    huge = choose_ratio(**BASE, load_bytes_by_tier={"s3": 500 * MB}, tier_bandwidth=BANDWIDTH)
    assert huge.cheapest_hidden_tier is None


def test_no_measurements_fall_back_to_r_min_and_say_so():
    decision = choose_ratio(
        num_tokens=100, num_layers=4, load_bytes_by_tier={"s3": MB}, tier_bandwidth={},
        recompute_token_layers_per_s=None,
    )  # fmt: skip
    assert decision.recompute_ratio == 0.15 and "no measurement" in decision.why["rule"]
    json.dumps(decision.to_dict())


def test_controller_smooths_measurements_and_explains_itself():
    controller = LoadingController()
    controller.observe_recompute(tokens=3000, layers=30, seconds=0.1)
    controller.observe_tier("s3", nbytes=100 * MB, seconds=1.0)
    decision = controller.choose(num_tokens=3000, num_layers=30, load_bytes_by_tier={"s3": 5 * MB})
    assert decision.recompute_ratio == pytest.approx(0.5)
    controller.observe_tier("s3", nbytes=300 * MB, seconds=1.0)  # EWMA: 0.7*100 + 0.3*300
    assert controller.tier_bandwidth["s3"] == pytest.approx(160 * MB)
    controller.set_fixed_ratio(0.9)
    assert (
        controller.choose(num_tokens=10, num_layers=1, load_bytes_by_tier={}).recompute_ratio == 0.9
    )
    snapshot = controller.snapshot()
    assert snapshot["mode"] == "admin" and snapshot["last_decision"]["source"] == "admin"
    json.dumps(snapshot)
    with pytest.raises(ValueError):
        controller.set_fixed_ratio(1.5)
