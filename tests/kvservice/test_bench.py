"""The bench's command line: which examples, and blend settings passed through."""

from __future__ import annotations

import pytest

from kvservice.bench import blend_settings, parse_args


def test_blend_settings_are_read_as_literals_or_text():
    settings = blend_settings(["smooth_window=1", "measure=kv", "question_weight=False"])
    assert settings == {"smooth_window": 1, "measure": "kv", "question_weight": False}
    assert blend_settings(["question_weight_floor=0.5"]) == {"question_weight_floor": 0.5}


@pytest.mark.parametrize("pair", ["smoothwindow=3", "smooth_window", "recompute_ratio=0.2"])
def test_unknown_or_bench_owned_settings_are_refused(pair):
    with pytest.raises(ValueError, match="NAME=VALUE"):
        blend_settings([pair])


def test_command_line_picks_examples_and_settings(capsys):
    args = parse_args(["--data", "x.json", "--first", "10", "--examples", "20",
                       "--blend", "smooth_window=5"])  # fmt: skip
    assert (args.first, args.examples, args.blend) == (10, 20, {"smooth_window": 5})
    with pytest.raises(SystemExit):
        parse_args(["--data", "x.json", "--blend", "smooth_window=5", "--engine", "vllm"])
    assert "native engine only" in capsys.readouterr().err
