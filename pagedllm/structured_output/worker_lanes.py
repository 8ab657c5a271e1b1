"""The grammar worker processes as the engine core's ProcessBackend (backend_process.py) talks to
them: a grammar is a slot in one worker (ProcessGrammar), a worker is a lane (its socket, its job
area in the shared block, what is queued for its next message), a step's job waits for every lane's
reply (WorkerJob), and the processes with their shared block are released together (_Workers).

    ProcessBackend --send_step--> _Lane (one per worker) --STEP message / job area--> grammar_worker.py
                   <--wait_step-- reply: (refused slots, accept s, fill s, live matchers, times)
"""

from __future__ import annotations

import collections
import logging
import pickle
import subprocess
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Protocol

import numpy as np
import torch

from pagedllm.structured_output.backend_types import GrammarBackendError, StructuredOutputGrammar
from pagedllm.structured_output.grammar_worker import JOB_ARRAYS, JOB_HEADER


class ProcessBackend(Protocol):
    """What the lanes use of their owner, backend_process.ProcessBackend (named here, not imported:
    that module imports this one)."""

    stats: dict[str, float]
    refused_slots: list[int]
    _lanes: list[_Lane]

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor, rows: list[int]) -> None: ...

    def _send_step(self, fill_slots: list[int], buffer: int) -> list[_Lane]: ...


logger = logging.getLogger(__name__)
# The job channel: a job goes through the worker's area only while its spin deadline is this far
# ahead (the engine may lose the GIL between the look and the write; a job written after the
# worker stopped spinning runs when the watchdog pokes it, within backend_process.WATCHDOG_PERIOD_S).
SPIN_MARGIN_S = 0.02


class ProcessGrammar(StructuredOutputGrammar):
    """A request's grammar in a worker: its slot there, and what the engine must know locally
    (its stop ids, whether it ended). Accepting only queues the tokens for the next job; the
    worker reports a refused one (never expected: the bitmask allowed it) in its reply."""

    def __init__(self, slot: int, stop_ids: frozenset[int], lane: _Lane) -> None:
        self.slot = slot
        self.stop_ids = stop_ids
        self._lane = lane
        self._terminated = False

    def accept_tokens(self, tokens: list[int]) -> bool:
        self._lane.more.append((self.slot, list(tokens)))
        # An xgrammar matcher ends exactly when it accepts one of its stop tokens (and accepts one
        # only where the grammar may end, which the bitmask the token was sampled under said).
        if not self._terminated and not self.stop_ids.isdisjoint(tokens):
            self._terminated = True
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._lane.backend.fill_bitmasks([self], bitmask, [row])

    def is_terminated(self) -> bool:
        return self._terminated


class WorkerJob:
    """One step's job: `send()` starts it, `wait()` reads the replies; calling it does both (the
    manager's synchronous path)."""

    __slots__ = ("_backend", "_fill_slots", "_buffer", "_sent")

    def __init__(self, backend: ProcessBackend, fill_slots: list[int], buffer: int) -> None:
        self._backend, self._fill_slots, self._buffer, self._sent = backend, fill_slots, buffer, []

    def send(self) -> None:
        self._sent = self._backend._send_step(self._fill_slots, self._buffer)

    def wait(self) -> None:
        sent, self._sent = self._sent, []
        for lane in sent:
            lane.wait_step()

    def __call__(self) -> None:
        self.send()
        self.wait()


class _Lane:
    """One worker process, its socket, and what is queued for its next job: slots to drop
    (appended from any thread), the batch accept's slots and tokens, the other rows' tokens."""

    def __init__(self, backend: ProcessBackend, proc: subprocess.Popen, conn: Connection) -> None:
        self.backend, self.proc, self.conn = backend, proc, conn
        self.send_lock = threading.Lock()  # adds come from the compile pool, steps from the loop
        self.removed: collections.deque[int] = collections.deque()
        self.one_slots: list[int] = []
        self.one_tokens: list[int] = []
        self.more: list[tuple[int, list[int]]] = []
        self.t_sent = 0.0
        self.live = 0  # matchers in the worker after its last job
        self.area: tuple | None = None  # the job channel (set_area), when the workers poll
        self.area_layout: object = None  # the fill arrays last written there (their list object)

    def set_area(self, block: memoryview, offset: int, rows: int) -> None:
        area = np.ndarray((JOB_HEADER + JOB_ARRAYS * rows,), dtype=np.int32, buffer=block, offset=offset)
        header = memoryview(area[:JOB_HEADER]).cast("B").cast("i")
        spin_until = np.ndarray((1,), dtype=np.float64, buffer=block, offset=offset + 32)
        self.area = (header, area[JOB_HEADER:].reshape(JOB_ARRAYS, rows), spin_until, rows)

    def write_gated(self, fill_slots: list[int], fill_rows: list[int], buffer: int, word: int, seq: int) -> bool:
        """A gated job through the job area, if the worker polls it now (else False: the caller
        sends it on the socket). Arrays first, `job` last (grammar_worker.py's job channel)."""
        header, arrays, spin_until, rows = self.area
        removed = self.removed
        if self.more or len(removed) > rows or time.monotonic() > spin_until[0] - SPIN_MARGIN_S:
            return False
        n_removed = len(removed)
        if n_removed:
            arrays[0, :n_removed] = [removed.popleft() for _ in range(n_removed)]
        n_one = len(self.one_slots)
        if n_one:
            arrays[1, :n_one] = self.one_slots
            arrays[2, :n_one] = self.one_tokens
            self.one_slots, self.one_tokens = [], []
        if self.area_layout is not fill_slots:
            n = len(fill_slots)
            arrays[3, :n] = fill_slots
            arrays[4, :n] = fill_rows
            self.area_layout = fill_slots
        header[1], header[2], header[3], header[4], header[5], header[6] = (
            n_removed, n_one, len(fill_slots), buffer, seq, word)
        self.t_sent = time.perf_counter()
        header[0] = seq  # last: the worker reads the job once this changes
        return True

    def send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)
        self.t_sent = time.perf_counter()
        try:
            with self.send_lock:
                self.conn.send_bytes(data)
        except OSError:
            raise GrammarBackendError(f"the grammar worker exited (code {self.proc.poll()})") from None

    def send_step(self, fill_slots: list[int], fill_rows: list[int] | None, buffer: int,
                  flag: tuple[int, int] | None = None) -> None:
        """flag: (word, seq, spin) of a gated job: the worker sets flag word `word` to `seq` after its
        fill, and with `spin` then polls its job area for the next job (grammar_worker.py)."""
        removed = self.removed
        gone = [removed.popleft() for _ in range(len(removed))] if removed else []
        msg = ("step", gone, self.one_slots, self.one_tokens, self.more, fill_slots, fill_rows, buffer, flag)
        self.one_slots, self.one_tokens, self.more = [], [], []
        self.send(msg)

    def wait_step(self) -> None:
        t_wait = time.perf_counter()
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            raise GrammarBackendError(f"the grammar worker exited (code {self.proc.poll()})") from None
        if reply[0] != "ok":
            raise GrammarBackendError(f"the grammar worker failed a step: {reply[1]}")
        t_got = time.perf_counter()
        _, refused, accept_s, fill_s, live, t_received, t_done = reply
        stats = self.backend.stats
        stats["jobs"] += 1
        self.live = live
        stats["live"] = sum(lane.live for lane in self.backend._lanes)
        stats["accept_s"] += accept_s
        stats["fill_s"] += fill_s
        # The hand-overs (one clock for both processes): send -> the worker has it, and its reply
        # -> this thread has it (from when it was both sent and waited for).
        stats["wake_s"] += t_received - self.t_sent
        stats["back_s"] += t_got - max(t_done, t_wait)
        for slot in refused:
            logger.error("grammar slot %d: the grammar worker refused a sampled token", slot)
        if refused:
            self.backend.refused_slots.extend(refused)  # the manager ends their requests (take_refused)


class _Workers:
    """The processes, their sockets and the shared block; `release` is also the weakref
    finalizer, so nothing outlives the backend (shutdown, garbage collection, interpreter exit)."""

    def __init__(self, shm: SharedMemory, registered: int | None) -> None:
        self.shm, self.registered = shm, registered
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []

    def release(self) -> None:
        conns, self.conns = self.conns, []
        for conn in conns:
            try:
                conn.send(("close",))
            except OSError:
                pass
            conn.close()
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.registered is not None:
            ptr, self.registered = self.registered, None
            try:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            except RuntimeError:
                pass  # CUDA already torn down (interpreter exit): the mapping goes with the process
        if self.shm is not None:
            shm, self.shm = self.shm, None
            try:
                shm.close()
            except BufferError:
                pass  # the manager's views still point into it; the mapping goes with them
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


def _pin(buffer: torch.Tensor) -> int | None:
    """Register the shared block with CUDA as pinned memory (its copies then need no staging);
    None when there is no GPU or the driver refuses (the copy then pins by copying, as before)."""
    if not torch.cuda.is_available():
        return None
    ptr = buffer.data_ptr()
    try:
        # Portable | mapped (3): the gate's flag words are read by the device at their mapped address.
        err = torch.cuda.cudart().cudaHostRegister(ptr, buffer.numel() * buffer.element_size(), 3)
        failed = int(getattr(err, "value", err)) != 0
    except (AttributeError, RuntimeError, TypeError) as e:  # a torch without the binding
        err, failed = e, True
    if failed:
        logger.warning("cudaHostRegister of the grammar bitmask buffer failed (%s); its copies pin by copying", err)
        return None
    return ptr
