"""Celery pool processes split the cores between them for torch."""

from __future__ import annotations

import os

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
