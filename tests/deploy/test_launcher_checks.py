"""`make dev` says what is wrong in its own terminal: a bad ``MODEL_PATH`` before anything
starts (it was found by the inference worker once the stack was up, which then exited six
times in a minute, the reason only in its log), and the end of the log of a part that keeps
exiting when the stack stops for it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from deploy import devstack, services
from kvservice.model.bundled import resolve_llm_path
from kvservice.protocol.models import ModelPathError
from tests.conftest import ROOT
from tests.deploy.test_devstack import _stack_env


def _bad_model_paths(root: Path) -> dict[str, tuple[Path, str]]:
    """Each kind of bad ``MODEL_PATH``, with the reason the worker gives for it."""
    (root / "not-a-model").mkdir()
    (root / "notes.gguf").write_text("not a GGUF file")
    weights_only = root / "weights-only"
    weights_only.mkdir()
    (weights_only / "config.json").write_text("{}")
    return {
        "missing": (root / "missing", "does not exist"),
        "not a model": (root / "not-a-model", "has no readable config.json"),
        "not a gguf": (root / "notes.gguf", "is not a GGUF file"),
        "no weights": (weights_only, "has no *.safetensors weights"),
    }


def test_the_launcher_gives_the_workers_reasons_for_a_bad_model_path(tmp_path) -> None:
    for path, reason in _bad_model_paths(tmp_path).values():
        with pytest.raises(ModelPathError) as refused:
            resolve_llm_path(str(path), tmp_path / "cache")  # what the worker runs
        assert devstack.model_path_problem(str(path)) == str(refused.value)
        assert reason in str(refused.value) and str(path) in str(refused.value)
    model = tmp_path / "model"
    model.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (model / name).write_text("{}")
    config = {
        "model_type": "llama",
        "num_attention_heads": 2,
        "hidden_size": 32,
        "vocab_size": 8,
        "num_hidden_layers": 1,
        "intermediate_size": 8,
    }
    (model / "config.json").write_text(json.dumps(config))
    assert resolve_llm_path(str(model)) == model
    assert devstack.model_path_problem(str(model)) is None
    assert devstack.model_path_problem(None) is None  # the bundled model


def test_the_launcher_refuses_a_model_family_the_engine_does_not_run(tmp_path) -> None:
    """A BERT checkpoint passed the launcher's check; the worker refused it at load and the
    stack stopped 36 s later. The launcher reads the config as the worker's loader does."""
    model = tmp_path / "bert"
    model.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (model / name).write_text("{}")
    (model / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    said = devstack.model_path_problem(str(model))
    assert said is not None and str(model) in said and "'bert' is not supported" in said
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    said = devstack.model_path_problem(str(model))
    assert said is not None and "config.json has no num_attention_heads" in said
    (model / "config.json").write_text("{not json")
    assert "config.json cannot be read" in devstack.model_path_problem(str(model))


@pytest.mark.parametrize("kind", ["missing", "not a model"])
def test_a_bad_model_path_stops_make_dev_at_once_naming_path_and_reason(
    tmp_path, kind: str
) -> None:
    path, reason = _bad_model_paths(tmp_path)[kind]
    data = tmp_path / "data"
    env = _stack_env(data, services.free_port()) | {"MODEL_PATH": str(path)}
    started = time.monotonic()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "deploy.devstack"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = launcher.communicate(timeout=30)
    except subprocess.TimeoutExpired as still_running:
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=90)
        raise AssertionError(
            f"make dev kept running with MODEL_PATH={path}:\n{output[-3000:]}"
        ) from still_running
    elapsed = time.monotonic() - started
    assert launcher.returncode == 2, output
    assert f"MODEL_PATH: model path {path} {reason}" in output, output
    assert "is running" not in output
    assert not (data / "logs").exists()  # no service was started
    print(f"{kind}: exited {launcher.returncode} in {elapsed:.1f} s")


def test_a_part_that_keeps_exiting_stops_the_stack_with_the_end_of_its_log(
    tmp_path, capsys
) -> None:
    crash = "import sys; print('cannot load the model: the reason is here'); sys.exit(2)"
    log = tmp_path / "logs" / "inference.log"
    start = partial(devstack.run_child, "inference worker", [sys.executable, "-c", crash], {}, log)
    worker = devstack.Supervised(start)
    deadline = time.monotonic() + 60
    while worker.check():
        assert time.monotonic() < deadline, "the crash loop was not noticed"
        time.sleep(0.1)
    stopped = capsys.readouterr().err
    assert "inference worker exited 6 times in 60 s" in stopped
    assert "cannot load the model: the reason is here" in stopped, stopped
