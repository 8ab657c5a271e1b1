"""The process of one rank of MultiprocExecutor: `python -m pagedllm.executor.multiproc_worker`.

    driver (engine core)                               this process (rank r)
    --------------------                               ---------------------
    stdin:  the start message (pickled once, as        read it, then watch stdin: EOF = the driver
            multiprocessing's spawn would), then        is gone -> exit at once
            held open for the worker's life
    XPUB  -- [b"call", msgpack([method, args])] -->    SUB: RankWorker.call -> [r, b"ok", seq, result]
          -- [b"step", seq, SchedulerOutput]  -->      RankWorker.execute -> the output rank answers
                                                        (not when the step waits for its bitmask)
          -- [b"sample", seq, GrammarOutput]  -->      RankWorker.sample -> the output rank answers
          -- [b"shutdown"]                     -->      stop the worker, leave the groups, exit 0
    PULL  <-- [rank, b"ok" | b"error", seq, payload] -- PUSH

A step that raises is reported as [r, b"error", seq, text] and the rank waits for "shutdown": the
driver declares the engine dead and stops every rank. SIGINT is ignored (a terminal's Ctrl-C reaches
the whole process group; the driver decides when ranks stop).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerStart:
    """What a rank needs to start (the one pickled message, at process start)."""

    config: Any  # EngineConfig
    rank: int
    local_rank: int
    distributed_init_method: str
    broadcast_address: str  # the driver's XPUB
    reply_address: str  # the driver's PULL
    ranks_on_this_node: int
    log_level: int


def _exit_when_driver_dies() -> None:
    """The driver holds our stdin open; EOF means it exited (even by SIGKILL): so do we, without
    waiting for a collective that will never finish."""
    try:
        while os.read(0, 4096):  # the raw fd: no buffered reader's lock held at interpreter exit
            pass
    finally:
        os._exit(1)


def run_worker(start: WorkerStart) -> None:
    from pagedllm.executor.rank_worker import RankWorker

    rank = start.rank
    rank_b = str(rank).encode()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(start.broadcast_address)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(start.reply_address)
    push.send_multipart([rank_b, b"hello", b"0", b""])
    worker = RankWorker(start.config, rank, start.local_rank, start.distributed_init_method,
                        start.ranks_on_this_node)
    encoder = msgspec.msgpack.Encoder()
    try:
        while True:
            frames = sub.recv_multipart()
            kind = frames[0]
            if kind == b"shutdown":
                break
            seq = frames[1]
            try:
                if kind in (b"step", b"sample"):
                    out = worker.execute(frames[2]) if kind == b"step" else worker.sample(frames[2])
                    if out is not None:
                        push.send_multipart([rank_b, b"ok", seq, out])
                elif kind == b"call":
                    method, args = msgspec.msgpack.decode(frames[2])
                    push.send_multipart([rank_b, b"ok", seq, encoder.encode(worker.call(method, args))])
                else:
                    raise ValueError(f"unknown message kind {kind!r}")
            except Exception as e:  # noqa: BLE001 - reported to the driver, which fails the engine
                logger.error("rank %d failed:\n%s", rank, traceback.format_exc())
                push.send_multipart([rank_b, b"error", seq, f"{type(e).__name__}: {e}".encode()])
    finally:
        try:
            worker.shutdown()
        finally:
            sub.close(0)
            push.close()
            ctx.term()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start: WorkerStart = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=start.log_level,
                        format=f"%(asctime)s %(levelname)s [rank {start.rank}] %(name)s: %(message)s")
    threading.Thread(target=_exit_when_driver_dies, name="pagedllm-driver-watch", daemon=True).start()
    run_worker(start)


if __name__ == "__main__":
    main()
