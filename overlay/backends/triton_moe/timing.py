"""GPU timing for the tuner and the benchmark: CUDA-graph replays after warm-up, median."""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable

import torch


def graph_replay_seconds(fn: Callable[[], object], replays: int = 10, warmup_s: float = 0.025,
                         min_timed_s: float = 0.02) -> float:
    """Median seconds of one replay of a CUDA graph that holds one call of `fn`.

    `fn` runs once eagerly first (compiles kernels, settles allocations), so it must be safe
    to call repeatedly. Graph replays keep launch gaps out of small problems' times. The
    warm-up replays for at least `warmup_s` of wall time, so that the clocks have settled
    (a few replays of a 60 us graph left them low), and at least `replays` replays, more for
    short graphs (`min_timed_s` in all), are timed.
    """
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    batch = 1
    while True:  # batches of doubling size, back to back on the GPU, until one lasts warmup_s
        started = time.perf_counter()
        for _ in range(batch):
            graph.replay()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        if elapsed >= warmup_s:
            break
        batch *= 2
    replays = max(replays, math.ceil(min_timed_s / (elapsed / batch)))
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in marks:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in marks) / 1e3


def kernel_seconds(fn: Callable[[], object], calls: int = 5) -> dict[str, float]:
    """GPU seconds a call of `fn` spends in each kernel it launches, most first: where a layer's
    time goes (torch's profiler over `calls` eager calls, after one that warms up)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return per_call(((e.name, e.device_time) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA), calls)


def per_call(kernel_us: Iterable[tuple[str, float]], calls: int) -> dict[str, float]:
    """(kernel, microseconds) of each launch over `calls` calls -> seconds a call by kernel, most
    first."""
    totals: Counter[str] = Counter()
    for name, us in kernel_us:
        totals[name] += us
    return {name: us / calls / 1e6 for name, us in totals.most_common()}
