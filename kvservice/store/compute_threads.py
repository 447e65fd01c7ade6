"""Which threads run torch with more than one core: only the engine's batcher thread.

torch's CPU ops run through OpenMP, and every thread that runs a parallel op becomes the
master of its own OpenMP team, whose worker threads live as long as that thread does. Once a
second team exists on a 2-core machine, libgomp sees more threads than cores and throttles
its spin-wait, so every small parallel region pays a futex wake: blend through the engine took
0.98-1.05 s instead of 0.67-0.69 s and reuse 0.30 s instead of 0.15 s when the model had been
set up in the main thread (docs/kernels.md). So a process that serves with the engine

- sets the model up in a thread that ends (:func:`run_in_passing_thread`), taking its team
  with it;
- gives the batcher thread the process's thread count (:func:`use_threads`, at its start);
- and runs torch single-threaded everywhere else (:func:`single_threaded`: the main thread
  after set-up, Celery's threads, the KV loader's threads), which also becomes the count of
  threads started afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def run_in_passing_thread(fn: Callable[[], T], name: str = "setup") -> T:
    """``fn()`` in a new thread that ends when it returns; its result, or its exception."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as err:  # re-raised in the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def use_threads(count: int) -> None:
    """This thread's torch ops use ``count`` threads (the compute thread's start)."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


def single_threaded() -> None:
    """This thread's torch ops, and those of threads started after it, run on one core."""
    use_threads(1)
