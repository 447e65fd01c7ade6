"""Recording a piece of work as a CUDA graph, the one way the engine does it (its passes:
``kvservice.blend.graphs``; its decode steps: ``kvservice.model.decode_graph``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def record(
    run: Callable[[], Any], device: torch.device, pool=None
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``run()`` recorded as a CUDA graph, after two runs on a side stream (what CUDA graphs
    need before a recording): the graph, and what ``run`` returned, the outputs each replay
    rewrites. Only this thread is kept off the device meanwhile (the loader's threads go
    on). ``pool``: a memory pool shared with other graphs replayed one at a time.

    ``device`` is where ``run`` computes: anywhere but CUDA this raises (a host model's work
    recorded on a machine with a GPU would give an empty graph whose replays do nothing)."""
    if torch.device(device).type != "cuda":
        raise RuntimeError(f"only work on a CUDA device can be recorded, not on {device}")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        outputs = run()
    return graph, outputs
