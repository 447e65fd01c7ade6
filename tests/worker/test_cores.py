"""Celery pool processes split the cores between them for torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from worker import celery


@pytest.fixture
def restore_threads():
    before, pool_size = torch.get_num_threads(), celery._pool_size
    yield
    torch.set_num_threads(before)
    celery._pool_size = pool_size


def test_each_pool_process_gets_its_share_of_the_cores(restore_threads, monkeypatch) -> None:
    monkeypatch.delenv("WORKER_TORCH_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    celery.remember_pool_size(options={"concurrency": 4})
    assert celery.share_cores() == 2 and torch.get_num_threads() == 2
    celery.remember_pool_size(options={"concurrency": 16})  # more processes than cores
    assert celery.share_cores() == 1 and torch.get_num_threads() == 1


def test_worker_torch_threads_overrides_the_share(restore_threads, monkeypatch) -> None:
    monkeypatch.setenv("WORKER_TORCH_THREADS", "3")
    celery.remember_pool_size(options={"concurrency": 2})
    assert celery.share_cores() == 3 and torch.get_num_threads() == 3


@pytest.mark.parametrize(("setting", "expected"), [("5", 5), ("0", 0), (None, 10)])
def test_pool_processes_give_way_to_inference(setting, expected) -> None:
    """Run in a child process: a niceness cannot be lowered back."""
    env = {k: v for k, v in os.environ.items() if k != "WORKER_NICE"}
    if setting is not None:
        env["WORKER_NICE"] = setting
    code = (
        "import os; from worker.celery import yield_to_inference; "
        "before = os.nice(0); after = yield_to_inference(); print(after - before)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == min(expected, 19 - os.nice(0))
