"""GPU timing for the tuner and the benchmark: CUDA-graph replays after warm-up, median."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_replay_seconds(fn: Callable[[], object], replays: int = 10, warmup: int = 3) -> float:
    """Median seconds of one replay of a CUDA graph that holds one call of `fn`.

    `fn` runs once eagerly first (compiles kernels, settles allocations), so it must be safe
    to call repeatedly. Graph replays keep launch gaps out of small problems' times.
    """
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in marks:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in marks) / 1e3
