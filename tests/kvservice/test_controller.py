from __future__ import annotations

import json

import pytest

from kvservice.blend.controller import ChunkLoad, LoadingController, choose_loads, choose_ratio

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
        num_tokens=100,
        num_layers=4,
        load_bytes_by_tier={"s3": MB},
        tier_bandwidth={},
        recompute_token_layers_per_s=None,
    )
    assert decision.recompute_ratio == 0.15 and "no measurement" in decision.why["rule"]
    json.dumps(decision.to_dict())


def test_controller_smooths_measurements_and_explains_itself():
    controller = LoadingController()
    controller.observe_recompute(tokens=3000, layers=30, seconds=0.1)
    controller.observe_tier_bandwidths({"s3": 100 * MB})
    decision = controller.choose(num_tokens=3000, num_layers=30, load_bytes_by_tier={"s3": 5 * MB})
    assert decision.recompute_ratio == pytest.approx(0.5)
    controller.observe_recompute(tokens=3000, layers=30, seconds=0.05)  # EWMA: 0.7*0.9M + 0.3*1.8M
    assert controller.recompute_token_layers_per_s == pytest.approx(1_170_000)
    snapshot = controller.snapshot()
    assert snapshot["last_decision"]["source"] == "auto"
    json.dumps(snapshot)


# Per chunk, load or recompute: 6 chunks of 500 tokens x 30 layers at 900k token-layers/s
# recompute in 1/60 s each (full prefill with a 100-token question: 0.1033 s)
LOAD = {"question_tokens": 100, "num_layers": 30, "recompute_token_layers_per_s": 900_000.0}


def _chunks(nbytes: int, tier: str = "s3", count: int = 6) -> list[ChunkLoad]:
    return [ChunkLoad(tokens=500, nbytes=nbytes, tier=tier) for _ in range(count)]


def test_fast_link_reads_every_chunk():
    # 200 kB a chunk at 100 MB/s: 6 chunks in 0.012 s, then the second pass (550 tokens,
    # 0.0183 s): 0.0303 s; recomputing one chunk instead: 0.02 + 0.0158 s
    plan = choose_loads(
        chunks=_chunks(MB // 5), tier_bandwidth=BANDWIDTH, recompute_ratio=0.15, **LOAD
    )
    assert plan.load == (True,) * 6 and plan.recomputed == 0
    assert plan.load_s_estimate == pytest.approx(0.012)
    assert plan.total_s_estimate == pytest.approx(0.012 + 550 * 30 / 900_000)


def test_chunk_slower_to_load_than_to_recompute_on_a_slow_link():
    # 20 MB a chunk at 100 MB/s: 0.2 s to arrive, longer than full prefill: all recomputed
    plan = choose_loads(
        chunks=_chunks(20 * MB), tier_bandwidth=BANDWIDTH, recompute_ratio=0.15, **LOAD
    )
    assert plan.load == (False,) * 6
    assert plan.load_s_estimate == 0.0
    assert plan.total_s_estimate == pytest.approx(plan.full_s_estimate)  # full prefill


def test_some_chunks_recomputed_while_the_rest_arrive():
    # 2 MB a chunk: 0.02 s to arrive against 0.0167 s to recompute. Reading all: 0.12 s + the
    # second pass (slower than full's 0.103); recomputing all: full. Recomputing 3 while the
    # other 3 arrive: max(0.06, 0.0533) + 0.0108 s (225 + 100 tokens), the least of the splits
    plan = choose_loads(
        chunks=_chunks(2 * MB), tier_bandwidth=BANDWIDTH, recompute_ratio=0.15, **LOAD
    )
    assert plan.recomputed == 3
    assert plan.total_s_estimate == pytest.approx(0.06 + 325 * 30 / 900_000)
    assert "3 of 6 chunks recomputed" in plan.why["rule"]


def test_never_estimated_slower_than_full_whatever_the_link():
    for mbps in (0.01, 1, 10, 50, 100, 1000, 1e6):
        plan = choose_loads(
            chunks=_chunks(5 * MB),
            tier_bandwidth={"s3": mbps * MB},
            recompute_ratio=0.15,
            **LOAD,
        )
        assert plan.total_s_estimate <= plan.full_s_estimate + 1e-12


def test_the_slow_tiers_chunks_are_recomputed_first():
    # three chunks in CPU memory (instant) and three from a slow S3: only S3's are recomputed
    chunks = [*_chunks(10 * MB, "cpu", 3), *_chunks(10 * MB, "s3", 3)]
    plan = choose_loads(chunks=chunks, tier_bandwidth=BANDWIDTH, recompute_ratio=0.15, **LOAD)
    assert plan.load == (True, True, True, False, False, False)


def test_chunks_of_unmeasured_tiers_are_read_and_no_throughput_reads_all():
    plan = choose_loads(
        chunks=_chunks(10 * MB, "disk"), tier_bandwidth={}, recompute_ratio=0.15, **LOAD
    )
    assert plan.load == (True,) * 6
    unmeasured = choose_loads(
        chunks=_chunks(10 * MB),
        tier_bandwidth=BANDWIDTH,
        recompute_ratio=0.15,
        question_tokens=100,
        num_layers=30,
        recompute_token_layers_per_s=None,
    )
    assert unmeasured.load == (True,) * 6 and "no measurement" in unmeasured.why["rule"]
    json.dumps(plan.to_dict())


def test_controller_chooses_loads_from_its_measurements():
    controller = LoadingController()
    assert (
        controller.choose_loads(
            chunks=_chunks(20 * MB), question_tokens=100, num_layers=30, recompute_ratio=0.15
        ).load
        == (True,) * 6
    )  # nothing measured yet
    controller.observe_recompute(tokens=3100, layers=30, seconds=0.1033)
    controller.observe_tier_bandwidths({"s3": 100 * MB})
    plan = controller.choose_loads(
        chunks=_chunks(20 * MB), question_tokens=100, num_layers=30, recompute_ratio=0.15
    )
    assert plan.recomputed == 6


def test_blends_own_cost_per_read_token_can_make_recomputing_pay():
    # 5 MB a chunk at 100 MB/s: 0.05 s to arrive, 0.0167 s to recompute. Priced at full's
    # throughput, reading one chunk while the other five are recomputed is the least (0.0925 s
    # against full's 0.1033); at 2 us a read token-layer that chunk adds 0.03 s: full prefill.
    free = choose_loads(
        chunks=_chunks(5 * MB), tier_bandwidth=BANDWIDTH, recompute_ratio=0.15, **LOAD
    )
    assert free.recomputed == 5
    priced = choose_loads(
        chunks=_chunks(5 * MB),
        tier_bandwidth=BANDWIDTH,
        recompute_ratio=0.15,
        read_token_layer_s=2e-6,
        **LOAD,
    )
    assert priced.recomputed == 6
    assert priced.total_s_estimate == pytest.approx(priced.full_s_estimate)


def test_chunks_are_all_read_when_loading_hides_behind_blends_compute():
    # 0.5 MB a chunk at 100 MB/s: the six arrive in 0.03 s, while blend computes for 0.04 s
    # (0.2 us a read token-layer): loading is not what the request waits on, and the whole
    # blend (0.066 s) is well below full prefill (0.103 s)
    plan = choose_loads(
        chunks=_chunks(MB // 2),
        tier_bandwidth=BANDWIDTH,
        recompute_ratio=0.15,
        read_token_layer_s=2e-7,
        **LOAD,
    )
    assert plan.recomputed == 0 and plan.load_s_estimate < plan.compute_s_estimate
    assert plan.total_s_estimate == pytest.approx(0.03 + 550 * 30 / 900_000 + 3000 * 30 * 2e-7)


def test_full_prefill_unless_blend_is_estimated_faster_by_the_margin():
    # 2 MB a chunk at 100 MB/s: loading is what the request waits on. The best split
    # (3 recomputed) is estimated at 0.0708 s, 0.685 of full's 0.1033: blend runs while the
    # margin asks for less than 31.5 % below full, full prefill beyond.
    kwargs = dict(chunks=_chunks(2 * MB), tier_bandwidth=BANDWIDTH, recompute_ratio=0.15, **LOAD)
    kept = choose_loads(full_margin=0.30, **kwargs)
    assert kept.recomputed == 3 and kept.total_s_estimate / kept.full_s_estimate < 0.70
    full = choose_loads(full_margin=0.35, **kwargs)
    assert full.load == (False,) * 6 and full.read_bytes == 0
    assert full.total_s_estimate == pytest.approx(full.full_s_estimate)
    assert full.why["rule"].startswith("full prefill")


def test_where_loading_hides_every_chunk_is_read_whatever_blend_costs():
    # 1 MB a chunk in CPU memory: loading hides; blend's own compute (2 us a read
    # token-layer) is estimated slower than full, and the stored KV is still read
    plan = choose_loads(
        chunks=_chunks(MB, "cpu"),
        tier_bandwidth=BANDWIDTH,
        recompute_ratio=0.15,
        read_token_layer_s=2e-6,
        **LOAD,
    )
    assert plan.load == (True,) * 6 and plan.total_s_estimate > plan.full_s_estimate


def test_what_reading_costs_beyond_the_link_is_learned_and_priced():
    controller = LoadingController(smoothing=1.0)
    controller.observe_recompute(tokens=3100, layers=30, seconds=3100 * 30 / 900_000)
    controller.observe_tier_bandwidths({"s3": 100 * MB})
    # 400 kB a chunk at 100 MB/s: loading is what the request waits on (one is recomputed)
    kwargs = dict(
        chunks=_chunks(400 * 1024), question_tokens=100, num_layers=30, recompute_ratio=0.15
    )
    plan = controller.choose_loads(**kwargs)
    assert plan.recomputed == 1 and plan.read_bytes == 5 * 400 * 1024 and plan.overhead_s == 0
    # the request took 0.01 s longer than estimated: that much per byte it read
    controller.observe_plan(plan, plan.total_s_estimate + 0.01)
    per_byte = 0.01 / plan.read_bytes
    assert controller.overhead_s_per_byte == pytest.approx(per_byte)
    again = controller.choose_loads(**kwargs)
    assert again.overhead_s == pytest.approx(again.read_bytes * per_byte) and again.overhead_s > 0
    assert again.total_s_estimate > plan.total_s_estimate
    # a request that beat its estimate counts as 0, averaged in (one request is noisy)
    controller.observe_plan(again, 0.001)
    assert controller.overhead_s_per_byte == pytest.approx(0.7 * per_byte)
    # and when reading costs more than full prefill would, full prefill runs
    for _ in range(10):
        controller.observe_plan(plan, plan.full_s_estimate * 1.2)
    assert controller.choose_loads(**kwargs).load == (False,) * 6
