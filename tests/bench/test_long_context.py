"""The long-context benchmark's command line and one real run end to end, on a tiny shape
registered under a synthetic name (the llama3-8b run itself is a benchmark, not a test)."""

from __future__ import annotations

import json

import pytest
import torch

from bench.long_context import HEAD_TOKENS, QUESTION_TOKENS, synthetic_prompt
from bench.prefill import main, parse_args
from kvservice.tools.synthetic import SYNTHETIC_CONFIGS
from tests.kvservice.conftest import TINY_COMMON


def test_synthetic_needs_no_data_and_has_long_context_defaults():
    args = parse_args(["--synthetic", "llama3-8b"])
    assert (args.context, args.chunks, args.repeats, args.warmup) == (16384, 12, 3, 1)
    assert args.device == torch.device("cpu") and args.dtype == torch.float32
    args = parse_args(
        [
            "--synthetic",
            "llama3-8b",
            "--layers",
            "2",
            "--context",
            "2048",
            "--chunks",
            "6",
            "--dtype",
            "bfloat16",
        ]
    )
    assert (args.layers, args.context, args.chunks, args.dtype) == (2, 2048, 6, torch.bfloat16)
    musique = parse_args(["--data", "x.json"])
    assert musique.repeats == 1 and musique.dtype == torch.float32


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--data is required"),
        (["--data", "x.json", "--layers", "2"], "with --synthetic only"),
        (["--synthetic", "llama3-8b", "--engine", "vllm"], "native engine only"),
        (
            ["--synthetic", "llama3-8b", "--ratios", "0.1", "--plot", "c.svg"],
            "not with --synthetic",
        ),
        (["--synthetic", "llama3-8b", "--repeats", "0"], "at least 1"),
        (["--synthetic", "llama3-8b", "--dtype", "float64"], "invalid choice"),
        (["--synthetic", "llama3-8b", "--device", "tpu9"], "--device"),
    ],
)
def test_command_line_refusals(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a CUDA device here")
def test_cuda_is_refused_where_there_is_none(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--synthetic", "llama3-8b", "--device", "cuda"])
    assert "no CUDA device here" in capsys.readouterr().err


def test_prompt_fills_the_context_with_equal_random_chunks():
    head, chunks, question = synthetic_prompt(1000, 2048, 6, seed=1)
    assert (len(head), len(question), len(chunks)) == (HEAD_TOKENS, QUESTION_TOKENS, 6)
    assert {len(c) for c in chunks} == {(2048 - HEAD_TOKENS - QUESTION_TOKENS) // 6}
    assert 2048 - 6 < len(head) + sum(map(len, chunks)) + len(question) <= 2048
    assert chunks[0] != chunks[1] and all(0 <= t < 1000 for c in chunks for t in c)
    assert synthetic_prompt(1000, 2048, 6, seed=1) == (head, chunks, question)
    with pytest.raises(ValueError, match="no tokens"):
        synthetic_prompt(1000, 64, 6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_reports_ttft_memory_and_loading_per_mode(dtype, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(SYNTHETIC_CONFIGS, "tiny", {"model_type": "llama", **TINY_COMMON})
    out = tmp_path / "synthetic.json"
    report = main(
        [
            "--synthetic",
            "tiny",
            "--context",
            "400",
            "--chunks",
            "4",
            "--modes",
            "full,reuse,blend",
            "--ratio",
            "0.15",
            "--repeats",
            "2",
            "--dtype",
            dtype,
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    tokens = report["prompt"]["tokens"]
    assert tokens == HEAD_TOKENS + 4 * 84 + QUESTION_TOKENS
    modes = report["modes"]
    assert list(modes) == ["full", "reuse", "blend"]
    for key, m in modes.items():
        assert len(m["ttft_s"]) == 2 and m["ttft_median_s"] > 0
        assert m["prefill_tokens_per_s"] == pytest.approx(tokens / m["ttft_median_s"])
        assert m["ttft_ratio_to_full"] == pytest.approx(
            m["ttft_median_s"] / modes["full"]["ttft_median_s"]
        )
        assert m["peak_memory_bytes"] is None  # no per-mode figure on CPU
        if key == "full":  # reads no cached KV
            assert m["load_s"] == 0.0 and m["hidden_load_fraction"] is None
        else:
            assert m["load_s"] > 0 and 0.0 <= m["hidden_load_fraction"] <= 1.0
            assert m["load_bytes"] > 0
    assert modes["full"]["kl_to_full"] == 0.0 and modes["full"]["agrees_with_full"]
    assert modes["reuse"]["kl_to_full"] > 0  # reuse's stale KV changes the distribution
    assert modes["reuse"]["recompute_ratio"] == 0.0
    # 15 % of all chunk tokens, taken from the three chunks after the first (exact) one
    assert modes["blend"]["recompute_ratio"] == pytest.approx(0.15, abs=1 / (4 * 84))
    memory = report["memory"]
    assert "process max RSS" in memory["measure"]
    assert memory["process_max_rss_bytes"] > memory["weights_bytes"] > 0
    assert report["env"]["dtype"] == dtype and report["env"]["layers"] == 3
    printed = capsys.readouterr().out
    assert "process max RSS" in printed and "random weights" in printed
    assert printed.count("\nblend ") == 1


@pytest.mark.slow
def test_the_llama3_8b_shape_runs_end_to_end(capsys):
    """The real shape (vocabulary 128,256, 4:1 grouped heads, llama3 RoPE), one layer deep:
    2.5 GB of bfloat16 weights, ~20 s here."""
    report = main(
        [
            "--synthetic",
            "llama3-8b",
            "--layers",
            "1",
            "--context",
            "1024",
            "--chunks",
            "4",
            "--modes",
            "full,reuse,blend",
            "--dtype",
            "bfloat16",
            "--repeats",
            "1",
            "--warmup",
            "0",
        ]
    )
    assert report["env"]["config"]["vocab_size"] == 128256 and report["env"]["layers"] == 1
    assert report["memory"]["weights_bytes"] == 2 * (2 * 128256 * 4096 + 218_112_000 + 4096)
    blend = report["modes"]["blend"]
    assert blend["recompute_ratio"] == pytest.approx(0.15, abs=0.01) and blend["load_s"] > 0
    assert "llama3-8b (layers: 1, bfloat16" in capsys.readouterr().out
