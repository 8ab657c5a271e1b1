"""Which captured decode graph serves a batch, and which BLAS library each graph was captured with,
decided from replay times measured at start-up.

Why measure. cuBLAS picks a GEMM kernel per shape, and its choice is not monotone in the row count:
on the H200 a Llama-3.1-8B decode graph of 120 rows replayed slower than the one of 128 rows (dummy
rows, so attention is nearly free and the GEMMs dominate), and cuBLASLt's heuristic picks
differently again, faster at some sizes and slower at others (the figures: BENCHMARKS.md,
"Measurements behind code decisions"). So every capture size
is captured with each candidate library and replayed; the faster capture is kept (`pick_backend`),
and a batch runs the graph of the smallest size that fits it unless a larger size replays clearly
faster (`plan_dispatch`). Padding rows cost nothing worth counting (seq_len 1, no cache write).

Both choices need a clear win (`MARGIN`), so near-ties keep the default: the plan stays the same
from one start to the next unless two timings sit right at the margin. A different graph for a
batch size can change the last bits of the logits, as any change of batch size does.

Kept between starts. Measuring means capturing every size once per library (about half the
capture time), so the outcome is written to $PAGEDLLM_CACHE_ROOT/graph_plans/<key>.json, the key
naming everything the timings depend on (GPU, torch and CUDA versions, the model's parameter
shapes and dtypes, the capture sizes, the graphs' maximum length); a later start with the same key
captures each size with its kept library only and plans from the kept times (`load_plan`).

Example: sizes [8, 16, 24] replaying in [1.00, 1.20, 1.05] ms, margin 2%:
    batches 1-8 -> 8; 9-16 -> 24 (1.05 < 1.20 * 0.98); 17-24 -> 24.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Hashable
from pathlib import Path
from typing import Any

MARGIN = 0.02  # an alternative must be this much faster (fraction of the default's time)

# PAGEDLLM_GRAPH_TUNING=0 (pagedllm/envs.py, read once at start): capture with the default library
# only and run every batch on the smallest size that fits (the plan before measurement; for A/B runs).


def pick_backend(times: dict[str, float], default: str, margin: float = MARGIN) -> str:
    """The library whose capture to keep: the fastest, if it beats `default` by `margin`.

    >>> pick_backend({"cublas": 5.0, "cublaslt": 4.8}, "cublas")
    'cublaslt'
    >>> pick_backend({"cublas": 5.0, "cublaslt": 4.95}, "cublas")
    'cublas'
    """
    if default not in times:
        raise ValueError(f"default library {default!r} was not timed: {sorted(times)}")
    best = min(times, key=lambda lib: (times[lib], lib != default))
    return best if times[best] < times[default] * (1 - margin) else default


def time_replays(graphs: dict[Hashable, Any], rounds: int = 3) -> dict[Hashable, float]:
    """Milliseconds per replay of each CUDA graph: the best of `rounds`, taken round-robin after one
    warm-up pass over all of them, so that clock ramps and other drift spread over every graph."""
    import torch

    for g in graphs.values():
        g.replay()
    best = {key: float("inf") for key in graphs}
    for _ in range(rounds):
        for key, g in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            best[key] = min(best[key], start.elapsed_time(end))
    return best


def plan_dispatch(times: dict[int, float], margin: float = MARGIN, groups: dict[int, Hashable] | None = None
                  ) -> list[int]:
    """dispatch[n] = the capture size that runs a batch of n rows (index 0 unused, = 0).

    Start from the smallest size >= n; move to a larger size only when it replays faster than the
    current pick by `margin`, and (given `groups`) only within the same group: sizes whose graphs
    do not compute alike (e.g. split-K attention or not) are not compared. times: capture size ->
    replay time (any unit).
    """
    if not times or any(s < 1 for s in times):
        raise ValueError(f"capture sizes must be >= 1, got {sorted(times)}")
    sizes = sorted(times)
    dispatch = [0] * (sizes[-1] + 1)
    for i, size in enumerate(sizes):
        best = size
        for larger in sizes[i + 1:]:
            if groups is not None and groups[larger] != groups[size]:
                continue
            if times[larger] < times[best] * (1 - margin):
                best = larger
        lo = sizes[i - 1] + 1 if i else 1
        for n in range(lo, size + 1):
            dispatch[n] = best
    return dispatch


def describe(dispatch: list[int], sizes: list[int]) -> str:
    """Batch ranges that run a larger graph than the smallest that fits, e.g. '9-16 -> 24' ('' if none)."""
    sizes = sorted(sizes)
    parts = []
    for i, size in enumerate(sizes):
        lo = sizes[i - 1] + 1 if i else 1
        if dispatch[size] != size:  # the whole range lo..size shares the pick of its natural size
            parts.append(f"{lo}-{size} -> {dispatch[size]}")
    return ", ".join(parts)


def plan_path(key_parts: list[object]) -> Path:
    """Where the plan for these key parts is kept (module doc)."""
    from pagedllm import envs

    digest = hashlib.sha256(json.dumps([str(p) for p in key_parts]).encode()).hexdigest()[:24]
    return envs.PAGEDLLM_CACHE_ROOT / "graph_plans" / f"{digest}.json"


def load_plan(path: Path, sizes: list[int], libraries: list[str]) -> dict[int, tuple[str, float]] | None:
    """size -> (library, replay ms) as saved for exactly these sizes, or None (no file, another
    size list, a library not offered now, anything unreadable: then the start measures again)."""
    try:
        saved = json.loads(path.read_text())
        plan = {int(size): (str(lib), float(ms)) for size, (lib, ms) in saved.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    if sorted(plan) != sorted(sizes) or any(lib not in libraries for lib, _ in plan.values()):
        return None
    return plan


def save_plan(path: Path, plan: dict[int, tuple[str, float]]) -> None:
    """Write the plan atomically (a concurrent start reads the old file or the new, never half);
    a cache directory that cannot be written only costs the next start its measurement."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({str(size): [lib, ms] for size, (lib, ms) in sorted(plan.items())}, f)
        os.replace(tmp, path)
    except OSError:
        pass
