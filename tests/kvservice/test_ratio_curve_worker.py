"""The real inference worker checks, at start, that the ratio curve target mode reads
(``RATIO_CURVE_PATH``) was measured on its model, and says in its log and heartbeat where it
was not (``kvservice.blend.planning.check_ratio_curve``)."""

from __future__ import annotations

import json
import os
import sys
import uuid

import pytest

from kvservice.protocol.codecs import DEFAULT_CODEC


@pytest.mark.slow
def test_the_worker_says_its_ratio_curve_is_another_models(
    s3_service, redis_service, tmp_path
) -> None:
    from tests.conftest import _spawn_worker, _stop, wait_for
    from webapp.redis import redis_client

    curve = tmp_path / "ratio_curve.json"
    points = [{"label": "full", "ratio": 1.0, "tf_kl_mean": 0.0}]
    env = {"kv_codec": DEFAULT_CODEC, "model_fingerprint": "another-model"}
    curve.write_text(json.dumps({"curve": points, "env": env}))
    tag = f"curve-{uuid.uuid4().hex[:12]}"
    heartbeat = f"ragblend:inference:heartbeat:{tag}"
    environ = {
        **os.environ,
        **s3_service.env,
        "PYTHONUNBUFFERED": "1",
        "KV_S3_PREFIX": f"{tag}/",
        "INFERENCE_QUEUE": f"inference-{tag}",
        "INFERENCE_NODE_NAME": f"{tag}@%h",
        "INFERENCE_CONCURRENCY": "1",
        "HEARTBEAT_KEY": heartbeat,
        "KV_DISK_DIR": str(tmp_path / "disk"),
        "KV_CODEC": DEFAULT_CODEC,
        "RATIO_CURVE_PATH": str(curve),
    }

    def loaded_heartbeat() -> dict | None:
        beat = json.loads(redis_client().get(heartbeat) or "{}")
        return beat if beat.get("model_loaded") else None

    log = tmp_path / "inference.log"
    process = _spawn_worker([sys.executable, "-m", "kvservice.worker"], log, environ)
    try:
        beat = wait_for(
            lambda: process.poll() is not None or loaded_heartbeat(),
            timeout=300,
            interval=1,
            what="the inference worker's heartbeat",
        )
        assert process.poll() is None, log.read_text()[-3000:]
        report = beat["ratio_curve"]
        assert report["fits"] is False and report["model_fingerprint"] == "another-model"
        assert "No ratio curve has been measured for this model" in report["note"]
        running = beat["model_fingerprint"]
        assert f"measured on model another-model, not this one ({running})" in log.read_text()
    finally:
        _stop(process, log)
        redis_client().delete(heartbeat)
