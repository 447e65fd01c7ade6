"""The routing bench's summary (the run itself starts two workers: a benchmark, not a test)."""

from __future__ import annotations

import pytest

from bench.routing import summarize


def test_summary_gives_the_hot_share_ttft_and_questions_per_worker():
    rows = [
        {"policy": "random", "worker": 0, "ttft_s": 1.0, "hot": 0, "chunks": 6},
        {"policy": "random", "worker": 1, "ttft_s": 3.0, "hot": 3, "chunks": 6},
        {"policy": "cache-aware", "worker": 0, "ttft_s": 2.0, "hot": 6, "chunks": 6},
        {"policy": "cache-aware", "worker": 0, "ttft_s": None, "hot": 6, "chunks": 6},
    ]
    summary = summarize(rows)
    assert summary["random"]["hot_hit_rate"] == 0.25
    assert summary["random"]["ttft_median_s"] == 2.0
    assert summary["random"]["ttft_p90_s"] == pytest.approx(2.8)  # linear, as numpy
    assert summary["random"]["per_worker"] == {"0": 1, "1": 1}
    assert summary["cache-aware"] == {
        "questions": 2,
        "hot_hit_rate": 1.0,
        "ttft_median_s": 2.0,
        "ttft_p90_s": 2.0,
        "per_worker": {"0": 2, "1": 0},
    }
