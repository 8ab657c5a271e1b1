"""OutputPump: the engine client's replies, handed from its threads to the event loop, in order.

    engine client thread (receiver, or the in-process engine thread)      event loop
    ----------------------------------------------------------------      ----------
    put(StepOutputs) ... put(StepOutputs) ... put(EngineFailed)  ------>  handle([items]): what is
                                                                          queued, in order, once per
                                                                          loop iteration

Why on the loop and not on an output thread of its own (vLLM's output_handler is a task on the loop
too): detokenizing and building outputs is Python work that holds the GIL, so a second thread adds
no CPU to the process; it only makes the loop wait for the GIL after every socket write (the thread
holds it for up to the 5 ms switch interval each time). Measured with the model-less executor:
BENCHMARKS.md, issue 16. One batch per loop iteration keeps the loop's own work (HTTP writes, new
requests) between batches. A batch holds one step while the loop keeps up, and every step queued
when it does not (at most MAX_PENDING_BATCHES, the engine's backpressure): the handler then builds
one output per request for all of them, so each stream writes once for several tokens, and the
frontend's cost per token falls exactly when it is the bottleneck (BENCHMARKS.md, issue 16, h39).

`put` is safe from any thread and wakes the loop once per batch of items, not once per item. A
handler that raises loses that batch (logged), never the pump: the batches after it are delivered.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

class OutputPump:
    def __init__(self, handle: Callable[[list[Any]], None]) -> None:
        self._handle = handle
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self._scheduled = False  # a drain is queued on the loop (or running)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver to `loop` from now on (items put before this wait for it)."""
        with self._lock:
            self._loop = loop
            wake = bool(self._items) and not self._scheduled
            self._scheduled = self._scheduled or wake
        if wake:
            loop.call_soon_threadsafe(self._drain)

    def put(self, item: Any) -> None:
        with self._lock:
            if self._closed:
                return
            self._items.append(item)
            if self._scheduled or self._loop is None:
                return
            self._scheduled = True
            loop = self._loop
        try:
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            pass  # the loop closed under us (interpreter shutdown)

    def close(self) -> None:
        """Drop what is queued and everything put later."""
        with self._lock:
            self._closed = True
            self._items.clear()

    def _drain(self) -> None:
        with self._lock:
            if not self._items:
                self._scheduled = False
                return
            items = list(self._items)  # everything queued now, in order
            self._items.clear()
        try:
            self._handle(items)
        except Exception:  # noqa: BLE001 - left to propagate, it would leave _scheduled set: no drain again
            logger.exception("the engine output handler failed on %d item(s)", len(items))
        with self._lock:
            if not self._items:
                self._scheduled = False
                return
        assert self._loop is not None
        self._loop.call_soon(self._drain)
