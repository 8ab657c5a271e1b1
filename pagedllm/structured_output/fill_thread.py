"""The bitmask thread: one persistent thread that runs a step's bitmask fill beside the step loop.

    step loop:  ... prepare job | submit ......................................... | wait | sample
    thread:                       [wake] fill (xgrammar's C++, GIL released) [GIL] | done

Why its own thread and raw locks, not a thread pool: the step loop holds the GIL while it runs
Python, and a thread that needs the GIL gets it only when the loop releases it (a blocking call)
or after the switch interval (5 ms). So the hand-off must cost the loop as little Python as
possible and must let the thread reach the GIL-free C call at once: `submit` releases `go` and
blocks on `started` (the GIL is free while it blocks), the thread takes the job, releases
`started` and calls the job, whose first Python line is the C call. Locks from `_thread` are
acquired and released in C; a ThreadPoolExecutor's submit, its Future and an Event cost ~20 Python
calls and two Condition round trips a step (BENCHMARKS.md, issue 22, branch h34).

`wait` blocks on `done` until the thread has finished the job (its line after the C call runs
when the loop blocks there, or earlier if the loop releases the GIL). One job at a time.
"""

from __future__ import annotations

import _thread
import threading
from collections.abc import Callable


class FillThread:
    def __init__(self, name: str = "pagedllm-bitmask") -> None:
        self._go = _thread.allocate_lock()
        self._started = _thread.allocate_lock()
        self._done = _thread.allocate_lock()
        for lock in (self._go, self._started, self._done):
            lock.acquire()  # all three start taken: release = signal, acquire = wait
        self._job: Callable[[], None] | None = None
        self._error: BaseException | None = None
        self.busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        go, started, done = self._go, self._started, self._done
        while True:
            go.acquire()
            job = self._job
            started.release()
            if job is None:
                return
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's wait()
                self._error = e
            done.release()

    def submit(self, job: Callable[[], None]) -> None:
        """Start `job` on the thread; returns once the thread is running it."""
        if self.busy or self._closed:
            raise RuntimeError("the bitmask thread is busy or closed: wait() for the job first")
        self._job = job
        self.busy = True
        self._go.release()
        self._started.acquire()

    def wait(self) -> None:
        """Until the submitted job has finished (at once if none); re-raises its exception."""
        if not self.busy:
            return
        self._done.acquire()
        self.busy = False
        self._job = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Finish a running job, then stop the thread."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._job = None
            self._go.release()
            # Bounded: at interpreter exit (an LLM dropped by __del__) daemon threads no longer
            # run, and an unbounded acquire here never returned.
            if self._started.acquire(timeout=1.0):
                self._thread.join(timeout=1.0)
