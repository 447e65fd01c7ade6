"""Kernel-launching operators a run dispatches, on every thread it uses, on any device.

A pass's host time on a GPU is mostly its launches (~5,000 small operators in a 4,096-token
reuse on an H100, ~200 ms of host time over ~50 ms of GPU work), so the count is what fused
paths are measured by: ``ops_per_layer`` in ``kvservice.bench``'s rows.

Counted with a dispatch mode (``TorchDispatchMode``): what it sees are the operators that
run a kernel of their own, composite ones (``linear``, ``reshape``) already split into them,
and nothing a kernel calls inside itself; views and bare allocations (``view``, ``slice``,
``empty``: no kernel runs) are left out. A mode sees only the thread it is entered on, so
the KV loader's fetch threads enter one too while counting (``loader.task_context``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvservice.store import loader

_NO_KERNEL = {
    "empty",
    "empty_strided",
    "empty_like",
    "resize_",
    "set_",
    "lift_fresh",
    "_local_scalar_dense",
    "detach",
    "detach_",
    "alias",
    "record_stream",
}


@functools.cache
def launches_kernel(name: str) -> bool:
    """Whether operator ``namespace::name`` runs a kernel (not a view, not an allocation)."""
    namespace, _, short = name.partition("::")
    if not short or short in _NO_KERNEL:
        return False
    packet = getattr(getattr(torch.ops, namespace, None), short, None)
    if packet is None:
        return False
    overloads = [getattr(packet, o) for o in packet.overloads()]
    return not any(getattr(o, "is_view", False) for o in overloads)


@dataclass
class OpCount:
    total: int
    layers: int
    by_name: dict[str, int] = field(default_factory=dict)

    @property
    def per_layer(self) -> float:
        return self.total / max(self.layers, 1)

    def top(self, n: int = 12) -> list[tuple[str, int]]:
        return collections.Counter(self.by_name).most_common(n)


class _Counting(TorchDispatchMode):
    """Counts the kernel-launching operators dispatched on the thread it is entered on into
    a counter shared by every thread of the run."""

    def __init__(self, counts: collections.Counter[str], lock: threading.Lock) -> None:
        super().__init__()
        self.counts, self.lock = counts, lock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if launches_kernel(name):
            with self.lock:
                self.counts[name.removeprefix("aten::")] += 1
        return func(*args, **(kwargs or {}))


def count_ops(run: Callable[[], Any], layers: int) -> OpCount:
    """Run ``run`` once and count the kernel-launching operators it dispatches, on this
    thread and on the KV loader's."""
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    @contextlib.contextmanager
    def counting() -> Iterator[None]:
        with _Counting(counts, lock):
            yield

    before, loader.task_context = loader.task_context, counting
    try:
        with counting():
            run()
    finally:
        loader.task_context = before
    return OpCount(sum(counts.values()), layers, dict(counts))
