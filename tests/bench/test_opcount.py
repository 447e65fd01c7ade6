"""bench.opcount: kernel-launching operators, on every thread a run uses, views left out."""

from __future__ import annotations

import contextlib
import threading

import torch

from bench.opcount import count_ops, launches_kernel
from kvservice.store import loader


def test_views_and_allocations_launch_nothing_and_arithmetic_does() -> None:
    assert launches_kernel("aten::add") and launches_kernel("aten::copy_")
    assert launches_kernel("mkldnn::_linear_pointwise")
    for name in ("aten::view", "aten::slice", "aten::transpose", "aten::empty", "aten::expand"):
        assert not launches_kernel(name), name
    assert not launches_kernel("a scope")


def test_a_run_is_counted_once_per_kernel_on_its_thread_and_the_loaders() -> None:
    a, b = torch.randn(8, 8), torch.randn(8, 8)

    def on_a_fetch_thread() -> None:
        with loader.task_context() if loader.task_context else contextlib.nullcontext():
            torch.mm(a, b)

    def run() -> None:
        c = (a + b).view(-1)[:32].reshape(4, 8)  # add; views
        c.t().contiguous().mul_(2)  # a copy into contiguous memory, a multiply
        torch.nn.functional.linear(c, a)  # composite: counted as what it runs
        side = threading.Thread(target=on_a_fetch_thread)
        side.start()
        side.join()

    ops = count_ops(run, layers=2)
    assert ops.by_name == {"add": 1, "clone": 1, "mul_": 1, "mm": 2}, ops.by_name
    assert ops.total == 5 and ops.per_layer == 2.5
    assert loader.task_context is None  # put back
    untouched = threading.Thread(target=lambda: torch.mm(a, b))  # not a fetch task
    assert count_ops(lambda: (untouched.start(), untouched.join()), layers=1).total == 0
