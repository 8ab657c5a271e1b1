"""Time GPU work inside a CUDA graph (no launch overhead in the figure), for the sweep scripts."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_us(fns: list[Callable[[], object]], reps: int = 5) -> float:
    """Microseconds per call: `fns` captured once into one graph (after a warm-up on a side stream),
    the best of `reps` replays divided by len(fns). Repeat one fn in the list to average it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / len(fns))
    return best
