"""The grammar worker process: holds every constrained request's xgrammar matcher, and per step
advances them by the accepted tokens and fills the next step's bitmask into shared memory.

    engine core (step loop)                          grammar worker (this file, its own GIL)
    collect step k, queue accepted tokens
    STEP (removed, slots+tokens, more, rows, buf) -> batch accept | per-row accepts | batch fill
    return outputs, schedule step k+1                   into shared bitmask buffer `buf`, rows 0..n-1
    wait: recv reply  <------------------------------  (refused slots, accept s, fill s)
    sample step k+1 with bitmask buffer `buf`

Why a process (backend_process.py's docstring has the numbers): in the engine's process xgrammar's
accept and fill release the GIL, but every hand-over between the step loop and a thread waits for
the loop to block, and the accept's result must come back to Python before the fill can start; here
the whole job runs beside the loop, which only pickles one small message a step and reads one.

Messages (multiprocessing Connection over a socket pair; fd in argv, the first message pickled):
    ("init", tokenizer_info_json, vocab_size, max_threads, shm_name, num_buffers, rows, words)
    ("add", slot, StructuredOutputsParams, stop_token_ids)      compiled on this process's pool
    ("step", removed_slots, one_slots, one_tokens, more, fill_slots, fill_rows | None, buffer, flag | None)
        -> ("ok", refused_slots, accept_s, fill_s, live_matchers, t_received, t_done) | ("error", message)
    ("close",)
flag: (word, seq) of a gated job (gate.py): after the fill, flag word `word` (after the buffers in
the shared block) is set to seq; the device samples the step once every worker's word is >= seq.
A gated job gets no reply (a failure sets error word ERROR_WORDS + word; "stats" -> ("stats", jobs, accept_s, fill_s)
sums the gated jobs' times since the last "stats"). A slot is the engine's number for one request's grammar (never reused). With several workers
(PAGEDLLM_GRAMMAR_WORKERS) slot s lives in worker s % n, which fills its rows of the shared buffer
(fill_rows); with one, fill_rows is None (rows 0..n-1). The worker ends on
"close" or when the engine's end of the socket closes (EOF): it never outlives the engine.
"""

from __future__ import annotations

import faulthandler
import logging
import mmap
import os
import signal
import socket
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)
# Gated sampling (gate.py): after the bitmask buffers, FLAG_WORDS int32 words: word i worker i's flag
# (set to a gated job's sequence number once its rows are filled; the device waits until every
# worker's word has it), words ERROR_WORDS.. the workers' error words (set when a job failed).
FLAG_WORDS = 16
ERROR_WORDS = 8
# With several workers and jobs that ask for it (their job areas), worker 0 raises this word once
# every worker's word has the job's seq: the device then waits on one word (gate.FlagWords).
COMBINED_WORD = 7
COMBINE_TIMEOUT_S = 120.0  # worker 0 stops waiting for the others' words (the engine's watchdog opens the gate)


def combine_flags(flags: memoryview, num_workers: int, seq: int, timeout_s: float = COMBINE_TIMEOUT_S) -> bool:
    """Worker 0, after its own word: wait (spinning: the others end within microseconds of it, their
    fills being the same size) until every worker's word is >= seq, then raise COMBINED_WORD to seq.
    Returns False, leaving it, if the combined word was raised by someone else (the watchdog) or the
    others did not come within timeout_s. x86 keeps stores in one order for every observer, so once
    a worker's word is seen here its bitmask rows are visible to the device too."""
    spins = 0
    deadline = 0.0
    while flags[COMBINED_WORD] < seq:
        for i in range(1, num_workers):
            if flags[i] < seq:
                break
        else:
            flags[COMBINED_WORD] = seq
            return True
        spins += 1
        if not spins & 4095:
            now = time.monotonic()
            if not deadline:
                deadline = now + timeout_s
            elif now > deadline:
                return False
    return False
# The job channel (gated jobs without a socket write, PAGEDLLM_GRAMMAR_SPIN): after the flag words,
# one area per worker of JOB_HEADER int32 words and five int32 arrays of `rows` entries:
#   header  [job, n_removed, n_one, n_fill, buffer, gate seq, flag word, layout], then a float64
#           (words 8-9): the monotonic time until which the worker polls the area (its spin deadline)
#   arrays  removed slots | batch-accept slots | their tokens | slots to fill | their bitmask rows
# The engine writes the arrays, then the header's counts, then `job` (a new value per job) last: the
# worker, polling `job`, reads a complete job (x86 keeps stores in order). The fill arrays are
# rewritten only when `layout` changes (the same rows step after step: not rewritten).
JOB_HEADER = 16
JOB_ARRAYS = 5
SPIN_S = 0.05  # after a gated job that asks for it, the worker polls its area this long


def job_area_words(rows: int) -> int:
    return JOB_HEADER + JOB_ARRAYS * rows


def job_area_offset(num_buffers: int, rows: int, words: int, worker: int) -> int:
    """Byte offset of worker `worker`'s job area in the shared block (the areas start at a 64-byte
    boundary after the flag words, so that each header's float64 is aligned)."""
    base = 4 * (num_buffers * rows * words + FLAG_WORDS)
    base = (base + 63) // 64 * 64
    return base + 4 * worker * ((job_area_words(rows) + 15) // 16 * 16)


def shared_block_size(num_buffers: int, rows: int, words: int, num_workers: int) -> int:
    """Bytes of the shared block: the bitmask buffers, the flag words, the workers' job areas."""
    return job_area_offset(num_buffers, rows, words, num_workers)


def shm_path(name: str) -> str:
    """POSIX shared memory lives under /dev/shm on Linux (multiprocessing.shared_memory's names)."""
    return "/dev/shm/" + name.lstrip("/")


class GrammarWorker:
    def __init__(self, conn: Connection, init: tuple) -> None:
        import numpy as np
        import torch
        import xgrammar as xgr

        from pagedllm.structured_output.backend_xgrammar import XgrammarBackend

        _, info_json, vocab_size, max_threads, shm_name, num_buffers, rows, words, index, num_workers = init
        self.conn = conn
        info = xgr.TokenizerInfo.deserialize_json(info_json)
        self.backend = XgrammarBackend(None, vocab_size, max_threads=max_threads, tokenizer_info=info)
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="pagedllm-grammar-worker")
        self.matchers: dict[int, Future] = {}  # slot -> Future[XgrammarGrammar]
        self.compiled: dict[int, object] = {}  # slot -> XgrammarGrammar, once its future is done
        # The engine created the buffer; mapping the file (not SharedMemory(name)) keeps this
        # process out of the resource tracker, which would unlink the buffer when this process ends.
        fd = os.open(shm_path(shm_name), os.O_RDWR)
        size = num_buffers * rows * words * 4
        try:
            self._mmap = mmap.mmap(fd, shared_block_size(num_buffers, rows, words, num_workers))
        finally:
            os.close(fd)
        flat = np.frombuffer(self._mmap, dtype=np.int32, count=size // 4).reshape(num_buffers, rows, words)
        self.buffers = [torch.from_numpy(flat[i]) for i in range(num_buffers)]  # (rows, words) each
        # Gated sampling, after the buffers (FLAG_WORDS int32 words): word i is worker i's flag, words
        # ERROR_WORDS.. the workers' error words.
        self.flags = np.frombuffer(self._mmap, dtype=np.int32, count=FLAG_WORDS, offset=size)
        self.flag_view = memoryview(self.flags).cast("B").cast("i")  # per-spin reads: no numpy call
        self.combiner = index == 0 and num_workers > 1
        self.num_workers = num_workers
        self.gated = [0, 0.0, 0.0]  # gated jobs since the engine last asked ("stats"): count, accept s, fill s
        # The job channel (module doc): this worker's area, polled until `spin_until` (a gated job
        # that asks for it moves it on; the engine writes the area only while it is ahead).
        offset = job_area_offset(num_buffers, rows, words, index)
        area = np.frombuffer(self._mmap, dtype=np.int32, count=job_area_words(rows), offset=offset)
        self.job_header = memoryview(area[:JOB_HEADER]).cast("B").cast("i")  # per-poll reads: no numpy call
        self.job_arrays = area[JOB_HEADER:].reshape(JOB_ARRAYS, rows)
        self.spin_until = np.frombuffer(self._mmap, dtype=np.float64, count=1, offset=offset + 32)
        self.spin_until[0] = 0.0
        self.job_seen = self.job_header[0]
        self.shm_jobs = 0

    def _grammar(self, slot: int):
        g = self.compiled.get(slot)
        if g is None:
            # Compiled by now unless this process's compile is slower than the engine's (the engine
            # schedules a request once its own compile of the same grammar is done).
            g = self.compiled[slot] = self.matchers[slot].result()
        return g

    def step(self, msg: tuple) -> tuple[list[int], float, float, int]:
        _, removed, one_slots, one_tokens, more, fill_slots, fill_rows, buf, _flag = msg
        t0 = time.perf_counter()
        refused: list[int] = []
        get, slow = self.compiled.get, self._grammar
        if one_slots:
            grammars = [get(s) or slow(s) for s in one_slots]
            oks = self.backend.accept_tokens_batch(grammars, one_tokens)
            if oks is not None:
                refused += [s for s, ok in zip(one_slots, oks, strict=True) if not ok]
        for slot, tokens in more:
            if not slow(slot).accept_tokens(tokens):
                refused.append(slot)
        for slot in removed:  # after the accepts: a request finishes after its last token
            self.matchers.pop(slot, None)
            self.compiled.pop(slot, None)
        t1 = time.perf_counter()
        if fill_slots:
            # rows None: rows 0..n-1 (the only worker); else this worker's rows of the batch.
            bitmask = self.buffers[buf] if fill_rows is not None else self.buffers[buf][: len(fill_slots)]
            self.backend.fill_job([get(s) or slow(s) for s in fill_slots], bitmask, fill_rows)()
        return refused, t1 - t0, time.perf_counter() - t1, len(self.matchers)

    def serve(self) -> None:
        conn = self.conn
        while True:
            if time.monotonic() < self.spin_until[0]:
                got = self.poll_jobs()
                if got is False:
                    return  # "close" (or EOF) while draining the socket
                if got is None:
                    continue  # a job from the area ran (and moved the spin deadline on)
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # the engine is gone
            if not self.handle(msg):
                return
            if self.job_header[0] != self.job_seen:
                # A job written as the spin ended (the engine's watchdog pokes then): it runs now.
                if self.poll_jobs() is False:
                    return

    def poll_jobs(self) -> bool | None:
        """Poll the job area (and the socket, every 64 looks) until the spin deadline: None once a
        job from the area ran, True on a socket message or the deadline (the caller reads the
        socket), False on "close". Before an area job every message already on the socket is
        handled: it was sent before the job (an "add" of a slot the job fills)."""
        header, conn = self.job_header, self.conn
        n = 0
        while True:
            if header[0] != self.job_seen:
                self.job_seen = header[0]
                while conn.poll(0):
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        return False
                    if not self.handle(msg):
                        return False
                self.run_area_job()
                return None
            n += 1
            if not n & 63 and (conn.poll(0) or time.monotonic() >= self.spin_until[0]):
                return True

    def run_area_job(self) -> None:
        h, a = self.job_header, self.job_arrays
        n_removed, n_one, n_fill, buf, seq, word = h[1], h[2], h[3], h[4], h[5], h[6]
        msg = ("step", a[0, :n_removed].tolist(), a[1, :n_one].tolist(), a[2, :n_one].tolist(), [],
               a[3, :n_fill].tolist(), a[4, :n_fill].tolist(), buf, (word, seq, True))
        self.shm_jobs += 1
        self.handle(msg)

    def handle(self, msg: tuple) -> bool:
        """One message; False when the worker should end ("close")."""
        t_recv = time.perf_counter()  # CLOCK_MONOTONIC: the engine's clock too (its hand-over times)
        kind = msg[0]
        if kind == "step" and msg[8] is not None:
            # A gated job: no reply (the step loop reads none). Refusals are logged here, a
            # failure also marks this worker's error word, which the loop checks at its next job.
            word, seq, spin = msg[8]
            try:
                refused, accept_s, fill_s, _ = self.step(msg)
            except Exception:  # noqa: BLE001 - reported through the error word
                self.flags[ERROR_WORDS + word] = seq  # before the flag: the loop looks once the gate is open
                self.flags[word] = seq
                logger.exception("grammar worker: gated step failed")
                if spin and self.combiner:
                    combine_flags(self.flag_view, self.num_workers, seq)
                return True
            self.flags[word] = seq  # after the fill's stores: the device may copy the rows now
            if spin:  # the device waits on the combined word; the next job may come through the area
                if self.combiner:
                    combine_flags(self.flag_view, self.num_workers, seq)
                self.spin_until[0] = time.monotonic() + SPIN_S
            self.gated[0] += 1
            self.gated[1] += accept_s
            self.gated[2] += fill_s
            for slot in refused:
                logger.error("grammar slot %d: a sampled token was refused", slot)
        elif kind == "step":
            try:
                reply = ("ok", *self.step(msg), t_recv, time.perf_counter())
            except Exception as e:  # noqa: BLE001 - the engine raises it in its step loop
                logger.exception("grammar worker: step failed")
                reply = ("error", f"{type(e).__name__}: {e}")
            self.conn.send(reply)
        elif kind == "stats":
            self.conn.send(("stats", *self.gated, self.shm_jobs))
            self.gated = [0, 0.0, 0.0]
            self.shm_jobs = 0
        elif kind == "add":
            _, slot, params, stop_ids = msg
            self.matchers[slot] = self.pool.submit(self.backend.compile_grammar, params, stop_ids)
        elif kind == "close":
            return False
        # "poke" (the engine's watchdog: a gate stays shut): nothing; the caller looks at the area next
        return True

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.buffers = []
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view still alive; the mapping goes with the process


def main() -> None:
    # SIGUSR1 prints every thread's stack to stderr (the engine's): a hang's diagnosis
    # (scripts/gpu_gate_check.py's watchdog sends it), without stopping the worker.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    fd = int(sys.argv[1])
    logging.basicConfig(level=int(sys.argv[2]) if len(sys.argv) > 2 else logging.WARNING,
                        format="%(asctime)s %(levelname)s [grammar worker] %(name)s: %(message)s")
    conn = Connection(socket.socket(fileno=fd).detach())
    try:
        init = conn.recv()
    except (EOFError, OSError):
        return
    try:
        worker = GrammarWorker(conn, init)
    except Exception as e:  # noqa: BLE001 - reported to the engine, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    try:
        worker.serve()
    finally:
        worker.close()


if __name__ == "__main__":
    main()
