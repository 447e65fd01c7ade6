"""The recompute ratio chosen for a fidelity target: the curve's ratio is the floor that
loading may raise and never lower (``choose_ratio(target_ratio=...)``)."""

from __future__ import annotations

import pytest

from kvservice.blend.controller import LoadingController, choose_ratio

MB = 1 << 20
# 3000 tokens x 30 layers; recompute at 900k token-layers/s -> full recompute 0.1 s
BASE = {"num_tokens": 3000, "num_layers": 30, "recompute_token_layers_per_s": 900_000.0}
BANDWIDTH = {"s3": 100 * MB, "disk": 500 * MB, "cpu": 10_000 * MB}


def test_a_target_ratio_below_r_min_is_taken_when_loading_hides_behind_it():
    # 1 MB from memory: 0.1 ms, hidden behind recomputing 6 % (6 ms)
    decision = choose_ratio(
        **BASE, load_bytes_by_tier={"cpu": 1 * MB}, tier_bandwidth=BANDWIDTH, target_ratio=0.06
    )
    assert decision.recompute_ratio == pytest.approx(0.06) and decision.source == "target"
    assert "fidelity target" in decision.why["rule"] and decision.why["target_ratio"] == 0.06


def test_slow_loading_raises_a_target_ratio_to_break_even():
    # 2 MB from S3 at 100 MB/s = 0.02 s = 20 % of the 0.1 s full recompute
    decision = choose_ratio(
        **BASE, load_bytes_by_tier={"s3": 2 * MB}, tier_bandwidth=BANDWIDTH, target_ratio=0.06
    )
    assert decision.recompute_ratio == pytest.approx(0.2) and decision.source == "auto"


def test_the_tier_that_hides_loading_is_judged_at_the_target_ratio():
    # budget at 0.06: 6 ms. 1 MB: S3 10 ms (no), disk 2 ms (yes)
    decision = choose_ratio(
        **BASE, load_bytes_by_tier={"cpu": 1 * MB}, tier_bandwidth=BANDWIDTH, target_ratio=0.06
    )
    assert decision.cheapest_hidden_tier == "disk"


def test_without_measurements_the_target_ratio_is_the_ratio():
    decision = choose_ratio(
        num_tokens=3000,
        num_layers=30,
        load_bytes_by_tier={"cpu": MB},
        tier_bandwidth={},
        recompute_token_layers_per_s=None,
        target_ratio=0.08,
    )
    assert decision.recompute_ratio == 0.08 and "no measurement" in decision.why["rule"]


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="target ratio"):
        choose_ratio(**BASE, load_bytes_by_tier={}, tier_bandwidth={}, target_ratio=1.5)


def test_the_loading_controller_passes_the_target_ratio_per_request():
    controller = LoadingController()
    controller.observe_recompute(tokens=3000, layers=30, seconds=0.1)
    controller.observe_tier_bandwidths(BANDWIDTH)
    chosen = controller.choose(
        num_tokens=3000, num_layers=30, load_bytes_by_tier={"cpu": MB}, target_ratio=0.05
    )
    assert chosen.recompute_ratio == pytest.approx(0.05) and chosen.source == "target"
    plain = controller.choose(num_tokens=3000, num_layers=30, load_bytes_by_tier={"cpu": MB})
    assert plain.recompute_ratio == 0.15 and plain.source == "r_min"
