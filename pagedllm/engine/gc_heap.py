"""The cyclic garbage collector and the engine's long-lived heap: frozen at engine start, given back
when a frontend drops its engine. Process-wide state (gc.freeze is), so here rather than in
EngineCore: the engine freezes, the frontends (entrypoints/llm.py, core_client.py) unfreeze.
"""

from __future__ import annotations

import atexit
import functools
import gc


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)  # once per process, however many engines


def freeze_gc_heap() -> None:
    """Move every live object out of the cyclic collector's sight (vLLM freezes its heap too).

    The model, its buffers and the start-up garbage are long-lived; otherwise each full collection
    while serving walks them again (a few percent of a W1 run: BENCHMARKS.md, "Measurements behind
    code decisions"). Frozen objects are
    never collected, so a frontend that drops its engine calls `unfreeze_gc_heap` (below); at exit
    the heap is given back too, so interpreter shutdown still collects it (extension modules such
    as Triton's report frozen objects as leaks otherwise).
    """
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


def unfreeze_gc_heap() -> None:
    """Give frozen objects back to the collector: an engine's reference cycles (and the GPU memory
    they hold) are freed by the next `gc.collect()`. Other live engines only lose the speed-up
    until the next engine start freezes again."""
    gc.unfreeze()
