"""The inference worker's configuration is read once, from one mapping, and a bad value
stops the worker with the variable's name before the model loads."""

from __future__ import annotations

import pytest

from kvservice.config import WorkerConfig

BASE = {"REDIS_URL": "redis://127.0.0.1:1/0"}


def test_the_worker_reads_its_settings_from_the_mapping_it_is_given() -> None:
    env = {
        "BLEND_REFRESH_RATIO": "0.4",
        "PREFIX_CACHE_BYTES": "64MiB",
        "INFERENCE_CONCURRENCY": "3",
        "ENGINE_COMPILE": " OFF",
        "ENGINE_BUFFER_BYTES": "3GiB",
        "ENGINE_STEP_BUDGET": "0.15",
    }
    config = WorkerConfig.from_env({**BASE, **env})
    assert (config.refresh_ratio, config.prefix_cache_bytes) == (0.4, 64 << 20)
    assert config.concurrency == 3 and config.kv_source.kind == "s3"
    assert config.store is not None and config.graphs is False
    assert config.buffer_bytes == 3 << 30 and config.step_budget.seconds == 0.15
    assert config.task_threads == 6  # the batch's rows and as many waiting in its line
    defaults = WorkerConfig.from_env(BASE)
    assert defaults.refresh_ratio == 0.25 and defaults.prefix_cache_bytes == 1 << 30
    assert defaults.graphs is True and defaults.buffer_bytes == 1 << 30
    assert str(defaults.step_budget) == "auto"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("BLEND_REFRESH_RATIO", "2"),
        ("PREFIX_CACHE_BYTES", "lots"),
        ("KV_SOURCE", "gcs"),
        ("ENGINE", "tgi"),
        ("REDIS_URL", ""),
        ("ENGINE_COMPILE", "maybe"),
        ("ENGINE_BUFFER_BYTES", "big"),
        ("ENGINE_STEP_BUDGET", "soon"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ValueError, match=variable):
        WorkerConfig.from_env({**BASE, variable: value})


def test_the_prompt_heartbeat_and_vllm_settings_come_from_the_same_mapping() -> None:
    config = WorkerConfig.from_env({**BASE, "KV_PREAMBLE": "on", "HEARTBEAT_KEY": "hb:test"})
    assert config.kv_preamble is True and config.heartbeat_key == "hb:test"
    assert config.vllm is None  # only read for ENGINE=vllm
    assert WorkerConfig.from_env(BASE).kv_preamble is False


def test_the_vllm_settings_are_read_through_the_registry() -> None:
    vllm = {**BASE, "ENGINE": "vllm", "VLLM_MAX_MODEL_LEN": "2048", "VLLM_ENFORCE_EAGER": "on"}
    settings = WorkerConfig.from_env(vllm).vllm
    assert (settings.max_model_len, settings.enforce_eager, settings.dtype) == (2048, True, None)
    with pytest.raises(ValueError, match="VLLM_MAX_NUM_SEQS must be a whole number"):
        WorkerConfig.from_env({**vllm, "VLLM_MAX_NUM_SEQS": "eight"})
