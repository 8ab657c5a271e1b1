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

import logging
import mmap
import os
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


def shm_path(name: str) -> str:
    """POSIX shared memory lives under /dev/shm on Linux (multiprocessing.shared_memory's names)."""
    return "/dev/shm/" + name.lstrip("/")


class GrammarWorker:
    def __init__(self, conn: Connection, init: tuple) -> None:
        import numpy as np
        import torch
        import xgrammar as xgr

        from pagedllm.structured_output.backend_xgrammar import XgrammarBackend

        _, info_json, vocab_size, max_threads, shm_name, num_buffers, rows, words = init
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
            self._mmap = mmap.mmap(fd, size + FLAG_WORDS * 4)
        finally:
            os.close(fd)
        flat = np.frombuffer(self._mmap, dtype=np.int32, count=size // 4).reshape(num_buffers, rows, words)
        self.buffers = [torch.from_numpy(flat[i]) for i in range(num_buffers)]  # (rows, words) each
        # Gated sampling, after the buffers (FLAG_WORDS int32 words): word i is worker i's flag, words
        # ERROR_WORDS.. the workers' error words.
        self.flags = np.frombuffer(self._mmap, dtype=np.int32, count=FLAG_WORDS, offset=size)
        self.gated = [0, 0.0, 0.0]  # gated jobs since the engine last asked ("stats"): count, accept s, fill s

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
        conn, backend = self.conn, self.backend
        while True:
            try:
                msg = conn.recv()
                t_recv = time.perf_counter()  # CLOCK_MONOTONIC: the engine's clock too (its hand-over times)
            except (EOFError, OSError):
                return  # the engine is gone
            kind = msg[0]
            if kind == "step" and msg[8] is not None:
                # A gated job: no reply (the step loop reads none). Refusals are logged here, a
                # failure also marks this worker's error word, which the loop checks at its next job.
                word, seq = msg[8]
                try:
                    refused, accept_s, fill_s, _ = self.step(msg)
                except Exception:  # noqa: BLE001 - reported through the error word
                    self.flags[ERROR_WORDS + word] = seq  # before the flag: the loop looks once the gate is open
                    self.flags[word] = seq
                    logger.exception("grammar worker: gated step failed")
                    continue
                self.flags[word] = seq  # after the fill's stores: the device may copy the rows now
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
                conn.send(reply)
            elif kind == "stats":
                conn.send(("stats", *self.gated))
                self.gated = [0, 0.0, 0.0]
            elif kind == "add":
                _, slot, params, stop_ids = msg
                self.matchers[slot] = self.pool.submit(backend.compile_grammar, params, stop_ids)
            elif kind == "close":
                return

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.buffers = []
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view still alive; the mapping goes with the process


def main() -> None:
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
