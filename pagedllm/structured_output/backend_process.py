"""The engine core's side of the grammar worker process (grammar_worker.py): a backend whose
grammars are handles to matchers in that process, and whose bitmask job is one message there and
one reply back, so that xgrammar's accept and fill run beside the step loop, not inside its GIL.

    loop, step k:  collect k-1 -> manager queues tokens -> ProcessBackend: send STEP (the tokens,
                   the rows to fill, the buffer) -> return, schedule k+1 -> wait for the reply
                   (at once when the worker is done) -> sample k+1 from the shared buffer

What stays in the engine: the request bookkeeping (manager.py, request.py: reasoning, a grammar's
end at its stop token), one local compile per request (so that a bad grammar fails here, and the
scheduler gets the request once it compiled; the worker compiles the same grammar beside it, from
its own cache), and the bitmask buffers: two (max_num_seqs, ceil(V / 32)) int32 buffers in one
POSIX shared-memory block, registered with CUDA as pinned memory on a GPU so that their copy to the
device needs no staging. The block is unlinked at shutdown (or when the engine's process exits: the
resource tracker), and the worker exits when the engine closes the socket or dies.

The thread path (XgrammarBackend + fill_thread.py) stays: PAGEDLLM_GRAMMAR_WORKER=0 picks it.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np
import torch

from pagedllm.structured_output import gate as gate_mod
from pagedllm.structured_output.backend_types import (
    GrammarBackendError,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)
from pagedllm.structured_output.backend_xgrammar import XgrammarBackend
from pagedllm.structured_output.gate import FlagWords
from pagedllm.structured_output.grammar_worker import (
    COMBINED_WORD,
    ERROR_WORDS,
    FLAG_WORDS,
    job_area_offset,
    shared_block_size,
)
from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.structured_output.worker_lanes import ProcessGrammar, WorkerJob, _Lane, _pin, _Workers

logger = logging.getLogger(__name__)
WATCHDOG_PERIOD_S = 0.2  # gated sampling: how often the watchdog looks for a dead worker
START_TIMEOUT_S = 120.0  # the worker imports torch and xgrammar: seconds on a loaded host
NUM_BUFFERS = 2  # the manager's bitmasks, used in turn (manager._take_bitmask says why two)


@dataclass
class _WatchState:
    dead: int | None = None
    stuck: int = 0
    retired: bool = False


class ProcessBackend(StructuredOutputBackend):
    remote = True

    def __init__(self, tokenizer, vocab_size: int, max_threads: int, rows: int, pin_memory: bool,
                 num_workers: int = 1, spin: bool = False) -> None:
        self.vocab_size = vocab_size
        self.local = XgrammarBackend(tokenizer, vocab_size, max_threads=max_threads)
        self.rows, self.words = rows, (vocab_size + 31) // 32
        # The workers' own times (summed over their jobs) and matchers after the last jobs.
        # Slots whose grammar refused a token, from the workers' replies (gated jobs send none: logged
        # there); the manager's take_refused reads them.
        self.refused_slots: list[int] = []
        self.stats = {"steps": 0, "jobs": 0, "accept_s": 0.0, "fill_s": 0.0, "wake_s": 0.0, "back_s": 0.0, "live": 0}
        if num_workers > ERROR_WORDS:
            raise ValueError(f"at most {ERROR_WORDS} grammar workers, not {num_workers}")
        self.num_workers = num_workers
        # Gated jobs through the workers' job areas (grammar_worker.py), not the socket; may be
        # changed between steps (a benchmark's A/B): a worker polls its area only when asked.
        self.spin = spin
        size = NUM_BUFFERS * rows * self.words * 4
        shm = SharedMemory(create=True, size=shared_block_size(NUM_BUFFERS, rows, self.words, num_workers))
        self.buffers: list[torch.Tensor] = []
        workers = None
        try:
            flat = np.ndarray((NUM_BUFFERS, rows, self.words), dtype=np.int32, buffer=shm.buf)
            flat.fill(-1)
            whole = torch.from_numpy(np.ndarray((size // 4 + FLAG_WORDS,), dtype=np.int32, buffer=shm.buf))
            workers = _Workers(shm, _pin(whole) if pin_memory else None)
            self.buffers = [torch.from_numpy(flat[i]) for i in range(NUM_BUFFERS)]
            # Gated sampling: the workers' flag words (one each) and their error words.
            self._flag_block = whole[size // 4: size // 4 + FLAG_WORDS]
            self._flag_block.numpy()[:ERROR_WORDS].fill(0)
            self.flags = self._flag_block[:num_workers]
            errors = whole[size // 4 + ERROR_WORDS: size // 4 + ERROR_WORDS + num_workers]
            errors.numpy().fill(0)
            self._errors = memoryview(errors.numpy()).cast("B").cast("i")  # read per step: no numpy call
            self._lanes: list[_Lane] = []
            # All started first, then each one's "ready" read: they import torch and xgrammar side by side.
            info = self.local.tokenizer_info.serialize_json()
            for i in range(num_workers):
                proc, conn = self._spawn(max_threads, shm.name, info, i)
                workers.procs.append(proc)
                workers.conns.append(conn)
            for i, (proc, conn) in enumerate(zip(workers.procs, workers.conns, strict=True)):
                self._await_ready(proc, conn)
                lane = _Lane(self, proc, conn)
                lane.set_area(shm.buf, job_area_offset(NUM_BUFFERS, rows, self.words, i), rows)
                self._lanes.append(lane)
        except BaseException:
            self.buffers = []
            if workers is not None:
                workers.release()
            else:
                shm.close()
                shm.unlink()
            raise
        self._workers = workers
        self._finalizer = weakref.finalize(self, workers.release)
        self._next_slot = 0
        self._slot_lock = threading.Lock()
        self._next_buffer = 0
        # Gated sampling: a worker that dies leaves its flag word short of the step the device waits
        # for, and the step loop blocked in that step's collect; the watchdog then opens the gates
        # (the loop's next send raises "the grammar worker exited", before the step's tokens leave).
        self._watchdog: threading.Thread | None = None
        # What the watchdog found: a worker's exit code (dead), the gate it opened because the workers
        # left it shut (stuck, 0: none); retired: retire() ended the workers after a failure.
        self._watch = _WatchState()

    def watch_gates(self, flags: FlagWords) -> None:
        """Start the watchdog over the gates of `flags` (the manager's, on this backend's flag words).
        Every WATCHDOG_PERIOD_S: once a worker is dead it forces every gate issued open
        (`FlagWords.force_open`: the engine core aborts the constrained rows of those steps at their
        collect), and keeps doing so until the backend is retired (the engine may issue more gates
        before it notices); a gate still shut one period later gets its workers poked (a job written
        into a job area as the worker stopped polling it runs then); when the workers fill nothing
        for gate.GATE_TIMEOUT_S with a gate shut, they count as stuck, the same way (a worker alive
        but stuck must not stop the device's stream for good, nor its unfilled rows be emitted)."""
        if self._watchdog is not None:
            return
        procs, finalizer, lanes = list(self._workers.procs), self._finalizer, list(self._lanes)
        state = self._watch  # not `self`: the thread must not keep the backend alive

        def watch() -> None:
            filled, since = -1, 0.0  # the lowest worker word (the last gate filled), and since when
            while finalizer.alive and not state.retired:
                if state.dead is None:
                    state.dead = next((code for p in procs if (code := p.poll()) is not None), None)
                    if state.dead is not None:
                        logger.error("gated sampling: a grammar worker exited (code %s); its gates are forced "
                                     "open and their constrained requests aborted", state.dead)
                if state.dead is not None or state.stuck:
                    # Every gate issued so far opened, again each period: until the engine fails over
                    # (retire) it may issue more (a job written into a dead worker's job area raises
                    # nothing by itself).
                    flags.force_open(flags.failure or f"the grammar worker exited (code {state.dead})")
                    time.sleep(WATCHDOG_PERIOD_S / 4)
                    continue
                if flags.pending():
                    low, now = int(flags.words[: flags.fillers].min()), time.monotonic()
                    if low != filled:
                        filled, since = low, now  # progress, or the first look at this shut gate
                    else:
                        for lane in lanes:
                            try:
                                lane.send(("poke",))
                            except GrammarBackendError:
                                pass  # exited: the next period opens the gates
                        if now - since > gate_mod.GATE_TIMEOUT_S:
                            state.stuck = low + 1
                            reason = (f"the grammar workers did not fill gated step {low + 1} within "
                                      f"{gate_mod.GATE_TIMEOUT_S:.0f} s")
                            logger.error("gated sampling: %s; it is forced open and its constrained requests "
                                         "aborted", reason)
                            flags.force_open(reason)
                            continue
                time.sleep(WATCHDOG_PERIOD_S)
            if state.retired:
                # Nothing fills them any more (the workers are ended); a gate forced open stays so.
                if flags.failure is not None:
                    flags.force_open(flags.failure)
                else:
                    flags.open_all()

        self._watchdog = threading.Thread(target=watch, name="pagedllm-grammar-watchdog", daemon=True)
        self._watchdog.start()

    def _spawn(self, max_threads: int, shm_name: str, info_json: str,
               index: int) -> tuple[subprocess.Popen, Connection]:
        """One worker process, started and sent its "init" (`_await_ready` reads its answer)."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)  # the worker gets this process's environment, handed over whole
        root = str(Path(__file__).resolve().parents[2])  # the worker imports this process's pagedllm
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pagedllm.structured_output.grammar_worker", str(theirs.fileno()),
                 str(logging.getLogger().getEffectiveLevel())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        try:
            conn.send(("init", info_json, self.vocab_size, max_threads, shm_name, NUM_BUFFERS, self.rows, self.words,
                       index, self.num_workers))
        except BaseException:
            conn.close()
            proc.kill()
            proc.wait()
            raise
        return proc, conn

    @staticmethod
    def _await_ready(proc: subprocess.Popen, conn: Connection) -> None:
        """The worker's "ready" (it stops the start on anything else; the caller's cleanup ends it)."""
        if not conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"the grammar worker did not start within {START_TIMEOUT_S:.0f} s")
        reply = conn.recv()
        if reply[0] != "ready":
            raise RuntimeError(f"the grammar worker failed to start: {reply[1]}")
        logger.info("grammar worker started (pid %d)", proc.pid)

    # -- requests -------------------------------------------------------------------------------
    def validate(self, params: StructuredOutputsParams) -> None:
        self.local.validate(params)

    def _lane_of(self, slot: int) -> _Lane:
        lanes = self._lanes
        return lanes[slot % len(lanes)]

    def compile_grammar(self, params: StructuredOutputsParams, stop_token_ids: list[int]) -> ProcessGrammar:
        with self._slot_lock:
            slot = self._next_slot
            self._next_slot += 1
        # The worker compiles first (in its pool, from its cache) while this thread compiles the
        # same grammar: the error (a 400 upstream) and the stop ids come from here.
        lane = self._lane_of(slot)
        lane.send(("add", slot, params, list(stop_token_ids)))
        try:
            local = self.local.compile_grammar(params, stop_token_ids)
        except BaseException:
            lane.removed.append(slot)
            raise
        assert local.stop_ids is not None, "the grammar worker needs xgrammar's GrammarMatcher.stop_token_ids"
        return ProcessGrammar(slot, local.stop_ids, lane)

    def release(self, grammar: StructuredOutputGrammar) -> None:
        """The request is done: its matcher goes with the next job (any thread may call this)."""
        grammar._lane.removed.append(grammar.slot)

    # -- steps ----------------------------------------------------------------------------------
    def accept_tokens_batch(self, grammars: list[StructuredOutputGrammar], tokens: list[int]) -> list[bool] | None:
        # Queued for the next job; the manager passes no stop token here (its one-token fast path).
        if len(self._lanes) == 1:
            lane = self._lanes[0]
            lane.one_slots += [g.slot for g in grammars]
            lane.one_tokens += tokens
            return None
        for g, token in zip(grammars, tokens, strict=True):
            lane = g._lane
            lane.one_slots.append(g.slot)
            lane.one_tokens.append(token)
        return None

    def allocate_bitmask(self, num_rows: int, pin_memory: bool = False) -> torch.Tensor:
        """The shared buffers in turn (the manager takes two); every token allowed."""
        if num_rows > self.rows:
            raise ValueError(f"{num_rows} bitmask rows asked of a grammar worker sized for {self.rows}")
        buf = self.buffers[self._next_buffer % NUM_BUFFERS]
        self._next_buffer += 1
        buf.numpy().fill(-1)
        return buf

    def _buffer_of(self, bitmask: torch.Tensor) -> int:
        ptr = bitmask.data_ptr()
        for i, buf in enumerate(self.buffers):
            if buf.data_ptr() == ptr:
                return i
        raise ValueError("a grammar worker fills only its own shared buffers (from allocate_bitmask), from row 0")

    def fill_job(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor) -> WorkerJob:
        return WorkerJob(self, [g.slot for g in grammars], self._buffer_of(bitmask))

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        # Not the manager's path (it sends fill_job's jobs): a one-off fill into `bitmask`, through
        # the buffer that `bitmask` is not (the caller holds no job in flight, as for any fill).
        buf = 1 if bitmask.data_ptr() == self.buffers[0].data_ptr() else 0
        WorkerJob(self, [g.slot for g in grammars], buf)()
        bitmask[rows] = self.buffers[buf][: len(rows)]

    def _send_step(self, fill_slots: list[int], buffer: int) -> list[_Lane]:
        """Send each worker its part of the job; the lanes whose replies the job waits for."""
        self.stats["steps"] += 1
        lanes = self._lanes
        if len(lanes) == 1:
            lanes[0].send_step(fill_slots, None, buffer)
            return lanes
        n = len(lanes)
        slots: list[list[int]] = [[] for _ in range(n)]
        rows: list[list[int]] = [[] for _ in range(n)]
        for row, slot in enumerate(fill_slots):  # slot s lives in worker s % n
            slots[slot % n].append(slot)
            rows[slot % n].append(row)
        for i, lane in enumerate(lanes):
            lane.send_step(slots[i], rows[i], buffer)
        return lanes

    # -- gated sampling (gate.py) ------------------------------------------------------------------
    def gate_flags(self, device: torch.device | None) -> FlagWords:
        """The gates' flag words in the shared block (registered with CUDA as mapped memory on a GPU):
        one per worker, and with several workers the combined word (grammar_worker.COMBINED_WORD) that
        jobs sent with `spin` raise."""
        n = self.num_workers
        if n == 1:
            return FlagWords(self.flags, device)
        return FlagWords(self._flag_block[: COMBINED_WORD + 1], device, fillers=n, combined=COMBINED_WORD)

    @property
    def combined_gates(self) -> bool:
        """Whether the next gate waits on the combined word (its job goes with `spin`)."""
        return self.spin and self.num_workers > 1

    def gate_job(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor, rows: list[int],
                 seq: int) -> tuple[Callable[[], None], list[tuple[list[int], list[int]]]]:
        """Send a gated job now: every worker accepts its queued tokens, fills its rows of `rows`
        (bitmask row of each grammar) and then sets its flag word to `seq`, whether or not it has rows. No reply comes back; the returned call (the manager makes it
        before its next job) raises if a worker failed the job. Also returns the rows' layout, per
        worker (slots, rows), which `send_gated` takes for a next step of the same rows."""
        n = len(self._lanes)
        layout: list[tuple[list[int], list[int]]] = [([], []) for _ in range(n)]
        for row, g in zip(rows, grammars, strict=True):
            slots_i, rows_i = layout[g.slot % n]  # slot s lives in worker s % n
            slots_i.append(g.slot)
            rows_i.append(row)
        return self.send_gated(layout, bitmask, seq), layout

    def send_gated(self, layout: list[tuple[list[int], list[int]]], bitmask: torch.Tensor,
                   seq: int) -> Callable[[], None]:
        """`gate_job`'s send, from a layout it returned."""
        buffer = self._buffer_of(bitmask)
        self.stats["steps"] += 1
        spin = self.spin
        for i, (lane, (slots_i, rows_i)) in enumerate(zip(self._lanes, layout, strict=True)):
            if not (spin and lane.write_gated(slots_i, rows_i, buffer, i, seq)):
                lane.send_step(slots_i, rows_i, buffer, (i, seq, spin))
        return self._check_gated

    def _check_gated(self) -> None:
        """A gated job gets no reply: its failure shows in the worker's error word (and its log)."""
        state = self._watch
        if state.dead is not None:
            raise GrammarBackendError(f"the grammar worker exited (code {state.dead})")
        if state.stuck:
            raise GrammarBackendError(f"the grammar workers did not fill gated step {state.stuck} within "
                                      f"{gate_mod.GATE_TIMEOUT_S:.0f} s")
        if any(self._errors):
            failed = [i for i, seq in enumerate(self._errors) if seq]
            for i in failed:
                self._errors[i] = 0
            raise GrammarBackendError(f"the grammar worker(s) {failed} failed a gated step (their log has the error)")

    def gated_stats(self) -> dict[str, float]:
        """The gated jobs' times in the workers since the last call (each worker's jobs summed; the
        call resets them): asked outside steps (a benchmark's), one round trip per worker."""
        out = {"jobs": 0, "accept_s": 0.0, "fill_s": 0.0, "area_jobs": 0}
        for lane in self._lanes:
            lane.send(("stats",))
            reply = lane.conn.recv()
            if reply[0] != "stats":  # a reply left unread would mean the loop and the worker disagree
                raise RuntimeError(f"the grammar worker answered {reply[0]!r} to a stats request")
            out["jobs"] = max(out["jobs"], reply[1])
            out["accept_s"] += reply[2]
            out["fill_s"] += reply[3]
            out["area_jobs"] = max(out["area_jobs"], reply[4])  # of the jobs, through the job area
        return out

    def retire(self) -> None:
        """After a failure (manager.fail_over): end the worker processes now, so that nothing writes
        the shared block any more, and stop the watchdog (it opens every gate once more). The block
        stays mapped until `shutdown`: a gated step in flight may still read its bitmask or flags."""
        self._watch.retired = True
        for proc in self._workers.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def shutdown(self) -> None:
        self.buffers = []
        self._finalizer()
