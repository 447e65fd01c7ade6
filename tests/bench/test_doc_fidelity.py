"""The product-document fidelity bench's plan and summary (pure; its runs are the prefill
bench's functions, tested there)."""

from __future__ import annotations

import pytest

from bench.doc_fidelity import plan_runs, summary
from kvservice.blend.prefill import BlendSettings


def test_runs_cover_both_stored_forms_each_ratio_and_each_temperature():
    runs = plan_runs(["off", "on"], [0.1, 0.15], [1.0], {"stale_ramp_tokens": 0})
    assert list(runs)[:3] == ["reuse[off]", "blend@0.10[off]", "blend@0.15[off]"]
    assert runs["reuse[on]"][:3] == ("on", "reuse", 0.0)
    kv, mode, ratio, settings = runs["blend@0.15[on,x1]"]
    assert (kv, mode, ratio) == ("on", "blend", 0.15)
    assert settings == BlendSettings(stale_key_scale=1.0, stale_ramp_tokens=0)
    assert runs["blend@0.10[off]"][3].stale_ramp_tokens == 0  # --blend applies to every run
    assert len(runs) == 2 * (1 + 2) + 2 * 2


def test_summary_counts_answers_that_lost_fulls_fact():
    def row(kl, full_fact, fact):
        blend = {"tf_kl": kl, "tf_agreement": 1.0, "has_fact": fact}
        return {"runs": {"full": {"has_fact": full_fact}, "blend": blend}}

    rows = [row(0.1, True, False), row(0.3, True, True), row(0.2, False, True)]
    out = summary(rows, ["blend"])
    assert out["full"]["has_fact"] == 2
    assert out["blend"]["has_fact"] == 2 and out["blend"]["lost_fact"] == 1
    assert out["blend"]["tf_kl_mean"] == pytest.approx(0.2)
    assert out["blend"]["tf_kl_median"] == pytest.approx(0.2)
