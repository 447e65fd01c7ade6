"""The real inference worker checks, at start, that the ratio curve target mode reads
(``RATIO_CURVE_PATH``) was measured on its model, and says in its log and heartbeat where it
was not (``kvservice.blend.planning.check_ratio_curve``)."""

from __future__ import annotations

import json
import uuid

import pytest

from kvservice.protocol.codecs import DEFAULT_CODEC


@pytest.mark.slow
def test_the_worker_says_its_ratio_curve_is_another_models(
    s3_service, redis_service, tmp_path
) -> None:
    from tests.conftest import started_inference_worker

    curve = tmp_path / "ratio_curve.json"
    points = [{"label": "full", "ratio": 1.0, "tf_kl_mean": 0.0}]
    env = {"kv_codec": DEFAULT_CODEC, "model_fingerprint": "another-model"}
    curve.write_text(json.dumps({"curve": points, "env": env}))
    tag = f"curve-{uuid.uuid4().hex[:12]}"
    environ = {
        **s3_service.env,
        "KV_S3_PREFIX": f"{tag}/",
        "KV_CODEC": DEFAULT_CODEC,
        "RATIO_CURVE_PATH": str(curve),
    }
    with started_inference_worker(tmp_path, tag, environ) as (beat, log):
        report = beat["ratio_curve"]
        assert report["fits"] is False and report["model_fingerprint"] == "another-model"
        assert "No ratio curve has been measured for this model" in report["note"]
        running = beat["model_fingerprint"]
        assert f"measured on model another-model, not this one ({running})" in log.read_text()
