"""MultiprocExecutor: one worker process per rank on this node (vLLM's "mp" backend).

    engine core (driver) --XPUB, one send per step--> rank 0 .. rank N-1   (multiproc_worker.py)
                         <--PULL-- the output rank (last PP stage, first TP rank); any rank's error

`execute_model` only publishes: the driver never waits for a step before launching the next, so
with pipeline parallelism stage 0 runs batch k+1 while stage 1 runs batch k (the engine core's
batch queue keeps them coming); the answers arrive, and are read, in launch order.

Each rank is `python -m pagedllm.executor.multiproc_worker`, started with the config pickled once on
its stdin (what multiprocessing's spawn does; a daemonic engine-core process may not use
multiprocessing to have children, so the processes are started with subprocess). Per step only
msgpack travels: the SchedulerOutput once to every rank through one ZMQ publish, the
ModelRunnerOutput back from one rank. The ranks talk among themselves through torch.distributed
(gloo on the CPU, NCCL on CUDA; pagedllm/distributed/).

Failure is never a hang: while waiting, the driver checks every 0.2 s that each rank is alive; a
rank that exits, reports an error, or does not answer within PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S
(a hung rank) kills every rank and raises, which ends the engine (the server answers 503 and
exits). Each rank exits by itself when the driver's process dies (EOF on its stdin).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import zmq

import pagedllm
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.executor.distributed import (
    STARTUP_TIMEOUT_S,
    DistributedExecutorBase,
    WorkerDiedError,
    execute_model_timeout_s,
)
from pagedllm.executor.multiproc_worker import WorkerStart
from pagedllm.executor.rank_worker import decode_output

logger = logging.getLogger(__name__)

__all__ = ["MultiprocExecutor", "WorkerDiedError"]

# Seconds to wait for a rank to stop after "shutdown" before it is killed.
SHUTDOWN_TIMEOUT_S = 5.0
_POLL_MS = 200


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _release(procs: list[subprocess.Popen], ipc_dir: str, ctx: zmq.Context, sockets: list[zmq.Socket]) -> None:
    """Everything the executor holds outside Python objects: the rank processes, the sockets and
    their context (closed explicitly: a context collected with open sockets would block in term())."""
    _kill_processes(procs, ipc_dir, 0.0)
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()


def _kill_processes(procs: list[subprocess.Popen], ipc_dir: str, timeout: float) -> None:
    """Stop every rank: wait up to `timeout` for a clean exit, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs:
        try:
            p.wait(2.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(2.0)
        if p.stdin is not None:
            try:
                p.stdin.close()
            except OSError:
                pass
    shutil.rmtree(ipc_dir, ignore_errors=True)


class _StepHandle:
    """A launched step; `get()` waits for the output rank's answer (steps answer in order)."""

    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        self._executor = executor
        self.seq = seq
        self.output: ModelRunnerOutput | None = None

    def get(self) -> ModelRunnerOutput:
        if self.output is None:
            self._executor._wait_for_step(self)
        assert self.output is not None
        return self.output


class MultiprocExecutor(DistributedExecutorBase):
    def _init_executor(self) -> None:
        self._init_ranks()
        self._seq = 0
        self._pending: deque[_StepHandle] = deque()
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedllm-mp-")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.LINGER, 0)
        pub_addr = f"ipc://{self._ipc_dir}/broadcast"
        self._pub.bind(pub_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        reply_addr = f"ipc://{self._ipc_dir}/reply"
        self._pull.bind(reply_addr)
        self._encoder = msgspec.msgpack.Encoder()

        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        env = dict(os.environ)  # the ranks' environment: this process's, handed over whole
        # The ranks import the same pagedllm as this process, wherever it was imported from.
        root = str(Path(pagedllm.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.processes: list[subprocess.Popen] = []
        for rank in range(self.world_size):
            start = WorkerStart(self.config, rank, rank, init_method, pub_addr, reply_addr, self.world_size,
                                logging.getLogger().getEffectiveLevel())
            proc = subprocess.Popen([sys.executable, "-m", "pagedllm.executor.multiproc_worker"],
                                    stdin=subprocess.PIPE, env=env)
            assert proc.stdin is not None
            pickle.dump(start, proc.stdin)
            proc.stdin.flush()
            self.processes.append(proc)
        # However the executor ends (shutdown, garbage collection, interpreter exit), no rank outlives it.
        self._finalizer = weakref.finalize(self, _release, self.processes, self._ipc_dir, self._ctx,
                                           [self._pub, self._pull])
        logger.info("started %d worker processes (pids %s)", self.world_size, [p.pid for p in self.processes])
        self._wait_for_ranks()
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    # -- start-up ----------------------------------------------------------------------------------
    def _wait_for_ranks(self) -> None:
        """Every rank subscribed to the broadcast (XPUB sees each subscription) and said hello:
        from here on a publish reaches all of them."""
        subscribed = hellos = 0
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        while subscribed < self.world_size or hellos < self.world_size:
            events = dict(poller.poll(_POLL_MS))
            if self._pub in events:
                if self._pub.recv()[:1] == b"\x01":
                    subscribed += 1
            if self._pull in events:
                rank, status, _, payload = self._pull.recv_multipart()
                if status != b"hello":
                    self._fail(f"rank {rank.decode()} answered {status!r} before starting: {payload.decode()}")
                hellos += 1
            self._check_alive(deadline, "start")

    def collective_rpc(self, method: str, *args: Any, timeout: float = STARTUP_TIMEOUT_S) -> list[Any]:
        """Call `method` on every rank; their results in rank order."""
        self._raise_if_dead()
        self._seq += 1
        seq = str(self._seq).encode()
        self._pub.send_multipart([b"call", seq, self._encoder.encode([method, list(args)])])
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            rank, status, got_seq, payload = self._recv(deadline, method)
            if status == b"error":
                self._fail_after_error(f"rank {rank} failed in {method}: {payload.decode()}", method)
            if got_seq == seq:
                results[rank] = msgspec.msgpack.decode(payload)
        return [results[r] for r in range(self.world_size)]

    # -- steps -------------------------------------------------------------------------------------
    def _send(self, kind: str, payload: bytes, answered: bool) -> _StepHandle | None:
        """One publish; the output rank's answers come back in publish order."""
        self._seq += 1
        self._pub.send_multipart([kind.encode(), str(self._seq).encode(), payload])
        if not answered:
            return None
        handle = _StepHandle(self, self._seq)
        self._pending.append(handle)
        return handle

    def _wait_for_step(self, handle: _StepHandle) -> None:
        deadline = time.monotonic() + execute_model_timeout_s()
        while handle.output is None:
            rank, status, seq, payload = self._recv(deadline, "execute_model")
            if status == b"error":
                self._fail_after_error(f"rank {rank} failed a step: {payload.decode()}", "execute_model")
            oldest = self._pending.popleft()
            if int(seq) != oldest.seq or rank != self.output_rank:
                self._fail(f"rank {rank} answered step {seq.decode()}, expected step {oldest.seq} from rank "
                           f"{self.output_rank}")
            oldest.output = decode_output(payload)

    # -- failure -----------------------------------------------------------------------------------
    def _recv(self, deadline: float, what: str) -> tuple[int, bytes, bytes, bytes]:
        while not self._pull.poll(_POLL_MS):
            self._check_alive(deadline, what)
        rank, status, seq, payload = self._pull.recv_multipart()
        return int(rank), status, seq, payload

    def _check_alive(self, deadline: float, what: str) -> None:
        for rank, p in enumerate(self.processes):
            code = p.poll()
            if code is not None:
                self._fail(f"worker rank {rank} (pid {p.pid}) exited with code {code} during {what}")
        if time.monotonic() > deadline:
            self._fail(f"the workers did not answer {what} in time (a rank is hung?)")

    def _fail_after_error(self, error: str, what: str) -> None:
        """A rank raised. When a peer died, the survivors' collectives fail first ("connection closed
        by peer"): give the dead one a moment to be seen, so the error names the rank that exited."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for rank, p in enumerate(self.processes):
                if p.poll() is not None:
                    self._fail(f"worker rank {rank} (pid {p.pid}) exited with code {p.returncode} during {what} "
                               f"(then {error[:300]})")
            time.sleep(0.05)
        self._fail(error)

    def _fail(self, why: str) -> None:
        """Mark the executor dead, stop every rank, raise."""
        self._dead = why
        logger.error("distributed executor failed: %s; stopping every worker", why)
        _kill_processes(self.processes, self._ipc_dir, 0.0)  # the sockets close at shutdown()
        raise WorkerDiedError(why)

    def check_health(self) -> None:
        self._raise_if_dead()
        for rank, p in enumerate(self.processes):
            if p.poll() is not None:
                self._fail(f"worker rank {rank} (pid {p.pid}) exited with code {p.returncode}")

    def shutdown(self) -> None:
        if not self._finalizer.alive:
            return
        if self._dead is None:
            try:
                self._pub.send_multipart([b"shutdown"], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._dead = "shut down"
            _kill_processes(self.processes, self._ipc_dir, SHUTDOWN_TIMEOUT_S)  # a clean exit first
        self._finalizer()  # whatever is left, killed; the sockets and the context closed
