"""The bench's command line (which examples, blend settings, the ratio curve) and the
numbers it reports: fidelity measures, their distribution, the curve."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys

import pytest
import torch

from bench.data import REPO_ROOT
from bench.fidelity import (
    progressive_greedy,
    progressive_logits,
    teacher_forced_fidelity,
    teacher_forced_logits,
)
from bench.prefill import (
    GAP_TOKENS,
    TF_TOKENS,
    blend_settings,
    parse_args,
    print_table,
    run_plan,
    summarize,
)
from bench.stats import bootstrap_ci, quantile
from kvservice.blend.prefill import blend_prefill
from kvservice.model.transformer import precompute_chunks


def test_blend_settings_are_read_as_literals_or_text():
    # One setting that blend_prefill keeps, so that the test outlives changes to the others.
    for text, value in [("1", 1), ("0.5", 0.5), ("False", False), ("kv", "kv")]:
        assert blend_settings([f"smooth_window={text}"]) == {"smooth_window": value}


@pytest.mark.parametrize("pair", ["smoothwindow=3", "smooth_window", "recompute_ratio=0.2"])
def test_unknown_or_bench_owned_settings_are_refused(pair):
    with pytest.raises(ValueError, match="NAME=VALUE"):
        blend_settings([pair])


def test_command_line_picks_examples_and_settings(capsys):
    args = parse_args(
        ["--data", "x.json", "--first", "10", "--examples", "20", "--blend", "smooth_window=5"]
    )
    assert (args.first, args.examples, args.blend) == (10, 20, {"smooth_window": 5})
    with pytest.raises(SystemExit):
        parse_args(["--data", "x.json", "--blend", "smooth_window=5", "--engine", "vllm"])
    assert "native engine only" in capsys.readouterr().err


def test_ratios_add_blend_runs_without_running_a_setting_twice(capsys):
    args = parse_args(
        [
            "--data",
            "x.json",
            "--modes",
            "full,reuse,blend",
            "--ratio",
            "0.15",
            "--ratios",
            "0.05,0.15,0.4",
            "--plot",
            "curve.svg",
        ]
    )
    assert args.ratios == [0.05, 0.15, 0.4]
    assert args.plan == {
        "full": ("full", 0.15),
        "reuse": ("reuse", 0.15),
        "blend": ("blend", 0.15),
        "blend@0.05": ("blend", 0.05),
        "blend@0.4": ("blend", 0.4),
    }
    assert run_plan(["full"], 0.15, [0.1]) == {"full": ("full", 0.15), "blend@0.1": ("blend", 0.1)}
    for argv, message in [
        (["--modes", "reuse,blend", "--ratios", "0.1"], "needs full"),
        (["--plot", "c.svg"], "give --ratios"),
        (["--ratios", "0.1,x"], "expected numbers"),
        (["--ratios", "1.5"], "between 0 and 1"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(["--data", "x.json", *argv])
        assert message in capsys.readouterr().err


def test_quantile_interpolates_between_order_statistics():
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    assert quantile([4.0], 0.9) == 4.0


def test_bootstrap_ci_is_seeded_and_close_to_the_normal_interval():
    values = [random.Random(i).gauss(0.05, 0.02) for i in range(400)]
    low, high = bootstrap_ci(values)
    assert bootstrap_ci(values) == (low, high)  # the same seed, the same interval
    assert bootstrap_ci(values, seed=1) != (low, high)
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / len(values) ** 0.5
    assert low < mean < high
    assert low == pytest.approx(mean - half, rel=0.02) and high == pytest.approx(
        mean + half, rel=0.02
    )
    assert bootstrap_ci([0.3] * 5) == pytest.approx((0.3, 0.3))
    narrow = bootstrap_ci(values, confidence=0.5)
    assert low < narrow[0] < narrow[1] < high
    with pytest.raises(ValueError):
        bootstrap_ci([])


def test_teacher_forced_fidelity_kl_on_the_first_positions_gap_on_all():
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(6, 11, generator=gen)
    answer = full.argmax(-1).tolist()
    same = teacher_forced_fidelity(full, full, answer, tf_positions=4)
    assert same["tf_agreement"] == 1.0 and same["tf_kl"] == 0.0 and same["tf_logprob_gap"] == 0.0

    later = full.clone()
    later[4:] = torch.randn(2, 11, generator=gen)  # only past the KL window
    measured = teacher_forced_fidelity(later, full, answer, tf_positions=4)
    assert measured["tf_agreement"] == 1.0 and measured["tf_kl"] == 0.0
    logp, full_logp = later.log_softmax(-1), full.log_softmax(-1)
    gap = sum(full_logp[i, t] - logp[i, t] for i, t in enumerate(answer)) / len(answer)
    assert measured["tf_logprob_gap"] == pytest.approx(gap.item()) and gap > 0

    flat = teacher_forced_fidelity(torch.zeros(6, 11), full, answer, tf_positions=4)
    head = full_logp[:4]
    kl = (torch.full_like(head, 1 / 11) * (torch.log(torch.tensor(1 / 11)) - head)).sum(-1).mean()
    assert flat["tf_kl"] == pytest.approx(kl.item(), rel=1e-5)


def _row(kl: dict[str, float], ttft: dict[str, float]) -> dict:
    return {
        "num_tokens": 900,
        "modes": {
            key: {
                "ttft_s": ttft[key],
                "tf_agreement": 1 - value,
                "tf_kl": value,
                "tf_logprob_gap": value / 2,
                "fidelity_f1": 1.0,
                "gold_f1": 0.5,
                "recompute_ratio": 0.1,
                "load_s": 0.0,
                "hidden_load_fraction": None,
                "ratio_chosen": None,
            }
            for key, value in kl.items()
        },
    }


def test_summary_gives_distributions_counts_against_reuse_and_the_curve():
    plan = run_plan(["full", "reuse", "blend"], 0.15, [0.05])
    ttft = {"full": 2.0, "reuse": 0.2, "blend": 0.6, "blend@0.05": 0.4}
    rows = [
        _row({"full": 0.0, "reuse": 0.30, "blend": 0.05, "blend@0.05": 0.10}, ttft),
        _row({"full": 0.0, "reuse": 0.20, "blend": 0.04, "blend@0.05": 0.20}, ttft),  # a tie
        _row({"full": 0.0, "reuse": 0.10, "blend": 0.50, "blend@0.05": 0.40}, ttft),
    ]
    summary = summarize(rows, plan, curve=True)
    blend = summary["modes"]["blend"]
    assert blend["tf_kl"] == pytest.approx(statistics.fmean([0.05, 0.04, 0.50]))
    assert blend["tf_kl_median"] == 0.05 and blend["tf_kl_p90"] == pytest.approx(0.41)
    low, high = blend["tf_kl_ci95"]
    assert 0.04 <= low < blend["tf_kl"] < high <= 0.50
    assert blend["tf_logprob_gap"] == pytest.approx(blend["tf_kl"] / 2)
    assert blend["ttft_median_s"] == 0.6 and blend["ttft_ratio_to_full"] == pytest.approx(0.3)
    assert (blend["worse_than_reuse"], blend["better_than_reuse"]) == (1, 2)
    at_005 = summary["modes"]["blend@0.05"]
    assert (at_005["worse_than_reuse"], at_005["better_than_reuse"]) == (1, 1)
    assert summary["modes"]["full"]["better_than_reuse"] == 3

    curve = summary["curve"]
    assert [p["label"] for p in curve] == ["reuse", "blend@0.05", "blend@0.15", "full"]
    assert [p["ratio"] for p in curve] == [0.0, 0.05, 0.15, 1.0]
    point = curve[2]
    assert point["tf_kl_mean"] == blend["tf_kl"] and point["tf_kl_median"] == 0.05
    assert point["ttft_ratio_to_full"] == pytest.approx(0.3)
    assert set(point) >= {
        "label",
        "ratio",
        "ttft_median_s",
        "ttft_ratio_to_full",
        "tf_kl_mean",
        "tf_kl_median",
        "tf_agreement",
        "tf_logprob_gap_mean",
    }
    assert "curve" not in summarize(rows, plan)
    print_table(summary)  # every column it prints is there


def test_also_tiers_runs_reuse_and_blend_from_another_tier_and_reports_the_slowdown(capsys):
    args = parse_args(
        [
            "--data",
            "x.json",
            "--modes",
            "full,reuse,blend",
            "--tier",
            "cpu",
            "--also-tiers",
            "s3,cpu",
            "--ratios",
            "0.05",
        ]
    )
    assert args.run_tiers == {"reuse[s3]": "s3", "blend[s3]": "s3"}  # cpu is --tier already
    assert args.plan["blend[s3]"] == ("blend", 0.15) and args.plan["reuse[s3]"] == ("reuse", 0.15)
    with pytest.raises(SystemExit):
        parse_args(["--data", "x.json", "--also-tiers", "tape"])
    assert "tiers are" in capsys.readouterr().err

    ttft = {"full": 2.0, "reuse": 0.2, "blend": 0.6, "blend@0.05": 0.4}
    rows = []
    for slower in (1.1, 1.3, 1.2):  # blend from S3 against from CPU, on the same prompt
        times = {**ttft, "reuse[s3]": 0.3, "blend[s3]": 0.6 * slower}
        rows.append(_row({key: 0.1 for key in times}, times))
    summary = summarize(rows, args.plan, curve=True, run_tiers=args.run_tiers)
    slow = summary["tier_slowdown"]["blend[s3]"]
    assert slow["tier"] == "s3" and slow["relative_to"] == "blend"
    assert slow["ttft_ratio_per_example"] == pytest.approx([1.1, 1.3, 1.2])
    assert slow["ttft_ratio_median"] == pytest.approx(1.2)
    assert summary["tier_slowdown"]["reuse[s3]"]["ttft_ratio_median"] == pytest.approx(1.5)
    assert [p["label"] for p in summary["curve"]] == ["reuse", "blend@0.05", "blend@0.15", "full"]
    print_table(summary)
    assert "blend[s3]: TTFT 1.200x blend's" in capsys.readouterr().out


def test_the_kl_window_of_the_long_teacher_forcing_is_the_short_one(tiny_llama):
    """tf_kl/tf_agreement read the first TF_TOKENS positions of the GAP_TOKENS teacher
    forcing: the logits there are those of a TF_TOKENS teacher forcing (as the bench did
    before tf_logprob_gap), and the cache is rolled back after each."""
    gen = torch.Generator().manual_seed(3)
    head = torch.randint(0, 128, (5,), generator=gen).tolist()
    chunks = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (12, 17, 9)]
    question = torch.randint(0, 128, (6,), generator=gen).tolist()
    answer = torch.randint(0, 128, (GAP_TOKENS,), generator=gen).tolist()
    kvs = precompute_chunks(tiny_llama, head, chunks)
    for mode in ("full", "reuse"):
        result = blend_prefill(
            tiny_llama, head, kvs, question, mode=mode, extra_capacity=GAP_TOKENS
        )
        short = teacher_forced_logits(tiny_llama, result, answer[:TF_TOKENS])
        long = teacher_forced_logits(tiny_llama, result, answer)
        assert long.shape[0] == GAP_TOKENS
        torch.testing.assert_close(long[:TF_TOKENS], short, atol=1e-5, rtol=1e-5)
        again = teacher_forced_logits(tiny_llama, result, answer[:TF_TOKENS])
        torch.testing.assert_close(again, short, atol=0, rtol=0)  # rolled back


def test_python_m_kvservice_bench_is_still_the_command():
    """The command the README, the docs and the issues give reaches this bench's parser."""
    done = subprocess.run(
        [sys.executable, "-m", "kvservice.bench", "--modes", "full"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "python -m kvservice.bench: error: --data is required" in done.stderr


def test_refresh_adds_a_progressive_run_of_each_blend_below_it_with_its_second_token(capsys):
    args = parse_args(
        [
            "--data",
            "x.json",
            "--modes",
            "full,reuse,blend",
            "--ratio",
            "0.1",
            "--refresh",
            "0.25",
            "--ratios",
            "0.05,0.4",
        ]
    )
    assert args.plan["blend>0.25"] == ("blend", 0.1)
    assert args.plan["blend@0.05>0.25"] == ("blend", 0.05) and "blend@0.4>0.25" not in args.plan
    assert args.refresh_keys == {"blend>0.25": 0.25, "blend@0.05>0.25": 0.25}
    refused = [
        (["--modes", "full,reuse", "--refresh", "0.25"], "give blend"),
        (["--ratio", "0.3", "--refresh", "0.25"], "between --ratio"),
    ]
    for argv, message in refused:
        with pytest.raises(SystemExit):
            parse_args(["--data", "x.json", *argv])
        assert message in capsys.readouterr().err
    ttft = {
        "full": 2.0,
        "reuse": 0.2,
        "blend": 0.6,
        "blend@0.05": 0.4,
        "blend@0.4": 1.0,
        "blend>0.25": 0.6,
        "blend@0.05>0.25": 0.4,
    }
    rows = [_row({key: 0.1 for key in ttft}, ttft) for _ in range(3)]
    for row, second in zip(rows, (1.2, 1.4, 1.3), strict=True):
        for key in args.refresh_keys:
            row["modes"][key].update(second_token_s=second, refresh_ratio=0.25)
    summary = summarize(rows, args.plan, curve=True)
    progressive = summary["modes"]["blend>0.25"]
    assert progressive["second_token_median_s"] == pytest.approx(1.3)
    assert progressive["second_token_ratio_to_full"] == pytest.approx(0.65)
    assert progressive["refresh_ratio"] == 0.25
    assert "second_token_median_s" not in summary["modes"]["blend"]
    labels = [p["label"] for p in summary["curve"]]
    assert labels == [
        "reuse",
        "blend@0.05",
        "blend@0.05>0.25",
        "blend@0.1",
        "blend@0.1>0.25",
        "blend@0.4",
        "full",
    ]
    points = {p["label"]: p for p in summary["curve"]}
    assert points["blend@0.1>0.25"]["refresh_ratio"] == 0.25
    assert points["blend@0.1>0.25"]["second_token_ratio_to_full"] == pytest.approx(0.65)
    assert "refresh_ratio" not in points["blend@0.1"]
    print_table(summary)
    assert "blend>0.25: second token's logits at 1.300 s (x full 0.650)" in capsys.readouterr().out


def test_progressive_logits_and_answer_come_from_the_refreshed_cache(tiny_llama):
    """The first position from the prefill at the low ratio, the later ones over the cache
    a blend at the high ratio leaves with the first answer token."""
    gen = torch.Generator().manual_seed(3)
    head = torch.randint(0, 128, (4,), generator=gen).tolist()
    chunks = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (10, 14, 12)]
    question = torch.randint(0, 128, (5,), generator=gen).tolist()
    kvs = precompute_chunks(tiny_llama, head, chunks)

    def blend(ratio):
        return blend_prefill(
            tiny_llama,
            head,
            kvs,
            question,
            recompute_ratio=ratio,
            chunk_ids=chunks,
            extra_capacity=8,
        )

    answer = [5, 9, 2, 7]
    logits = progressive_logits(tiny_llama, lambda: blend(0.1), 0.5, answer)
    high = blend(0.5)
    n = high.num_tokens
    later, _ = tiny_llama(
        torch.tensor([answer[:-1]]), torch.arange(n, n + 3)[None], high.cache, all_logits=True
    )
    assert logits.shape == (4, later.shape[-1])
    torch.testing.assert_close(logits[0], blend(0.1).logits)
    torch.testing.assert_close(logits[1:], later[0], atol=1e-4, rtol=1e-4)
    # landing after 3 tokens (as in the product, while the answer streams): the first three
    # positions over the low ratio's cache, the last over the upgraded one
    lagged = progressive_logits(tiny_llama, lambda: blend(0.1), 0.5, answer, lag=3)
    low = blend(0.1)
    before, _ = tiny_llama(
        torch.tensor([answer[:2]]), torch.arange(n, n + 2)[None], low.cache, all_logits=True
    )
    torch.testing.assert_close(lagged[1:3], before[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lagged[3], later[0, 2], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(lagged[1], logits[1], atol=1e-4)  # the ratios' caches differ
    greedy = progressive_greedy(tiny_llama, lambda: blend(0.1), 0.5, 3, stop_ids=set())
    assert len(greedy) == 3 and greedy[0] == int(blend(0.1).logits.argmax())


@pytest.mark.slow
def test_the_musique_bench_runs_progressive_blend_end_to_end(tmp_path):
    """``python -m kvservice.bench`` on a Musique-format example with the bundled model:
    full, blend and the progressive run, whose second token comes after its first."""
    example = {
        "question": "Which city is the capital of France?",
        "answers": ["Paris"],
        "ctxs": [
            {"title": "France", "text": "France is a country in Europe. Its capital is Paris."},
            {"title": "Paris", "text": "Paris lies on the Seine and has about two million people."},
            {"title": "Lyon", "text": "Lyon is the third-largest city of France, on the Rhone."},
        ],
    }
    data, out = tmp_path / "musique.json", tmp_path / "out.json"
    data.write_text(json.dumps([example]))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvservice.bench",
            "--data",
            str(data),
            "--examples",
            "1",
            "--passages",
            "3",
            "--modes",
            "full,blend",
            "--ratio",
            "0.1",
            "--refresh",
            "0.5",
            "--no-hf",
            "--threads",
            "1",
            "--json",
            str(out),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    row = report["examples"][0]["modes"]
    progressive, blend = row["blend>0.5"], row["blend"]
    assert progressive["refresh_ratio"] == 0.5 and "second_token_s" not in blend
    assert progressive["second_token_s"] > progressive["ttft_s"] > 0
    assert 0 <= progressive["tf_kl"] and 0 <= blend["tf_kl"] and progressive["answer"]
    assert "blend>0.5: second token's logits at" in done.stdout
    # the model it measured, as its chunk keys name it: a ratio curve steers target mode for
    # that model only (kvservice.protocol.ratio)
    from kvservice.model.bundled import resolve_llm_path
    from kvservice.model.checkpoint import checkpoint_fingerprint

    assert report["env"]["model_fingerprint"] == checkpoint_fingerprint(resolve_llm_path(None))
