"""The compile processes of the start-up's parallel Triton compile (worker/precompile.py).

Started as early as the engine knows it will run on a GPU, so that each child's imports (Triton,
the kernel modules, torch for a new interpreter: seconds) overlap the config and model loading:
forked from the prestarted engine process as it starts (`fork_compile_pool`: it has torch
imported and no CUDA context yet), else plain subprocesses of `python -m
pagedllm.worker.compile_child` fed over stdin (EngineArgs.create_engine_config, again at
Worker.init_device if not yet; not multiprocessing: a spawned child would re-import the user's
main script).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time

logger = logging.getLogger(__name__)

_MAX_PROCESSES = 8
# A child that hangs must not hang the start: past 20 s + 2 s per variant of the largest share the
# engine compiles what is left itself (16 variants over 8 processes took 3.9 s on the H200 host: BENCHMARKS.md, h16).
_POOL_TIMEOUT_S = 20.0
_POOL_TIMEOUT_PER_VARIANT_S = 2.0


class _SubprocessChild:
    """`python -m pagedllm.worker.compile_child`, fed over stdin: it imports torch itself."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedllm.worker.compile_child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def submit(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.close()
        self.proc.stdin = None  # closed: communicate() below only reads

    def answers(self, timeout: float) -> list[str]:
        out, _ = self.proc.communicate(timeout=timeout)  # TimeoutExpired: the caller's
        return out.splitlines()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class _ForkedChild:
    """A child forked from this process (compile_child.serve_connection over a pipe): torch is
    imported already, so it is ready within the second its kernel imports take, not the seconds of
    a new interpreter's. Only forked from a single-threaded process without a CUDA context (the
    engine process as it starts: `fork_compile_pool`)."""

    def __init__(self, close_in_child: tuple[int, ...] = ()) -> None:
        parent, child = multiprocessing.Pipe()
        pid = os.fork()
        if pid == 0:  # the child: compile, then leave without running the parent's exit handlers
            code = 0
            try:
                parent.close()
                for fd in close_in_child:  # e.g. the engine's pipes: its frontend must see them close with it
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                from pagedllm.worker.compile_child import serve_connection

                serve_connection(child)
            except BaseException:  # noqa: BLE001 - the parent counts what it did not answer
                code = 1
            finally:
                os._exit(code)
        child.close()
        self.pid, self.conn = pid, parent

    def submit(self, text: str) -> None:
        self.conn.send_bytes(text.encode())

    def answers(self, timeout: float) -> list[str]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"compile process {self.pid} gave no answer in {timeout:.0f} s")
        return self.conn.recv_bytes().decode().splitlines()

    def close(self) -> None:
        self.conn.close()
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


class CompilePool:
    """Compile processes (worker/compile_child.py), started early so their imports overlap the
    model load. `compile` hands each a share of the variants and waits; `close` ends them.
    fork: children forked from this process (`_ForkedChild`), else new interpreters."""

    def __init__(self, processes: int, fork: bool = False, close_in_child: tuple[int, ...] = ()) -> None:
        self.children: list[_SubprocessChild | _ForkedChild]
        if fork:
            self.children = [_ForkedChild(close_in_child) for _ in range(processes)]
            return
        import pagedllm
        from pagedllm import envs

        root = os.path.dirname(os.path.dirname(os.path.abspath(pagedllm.__file__)))
        env = envs.child_environment(python_path=root)
        self.children = [_SubprocessChild(env) for _ in range(processes)]

    def compile(self, items: list[tuple[str, str, str]], device_index: int, capability: int) -> int:
        """items: (module, qualname, specialization data) for the device `device_index` of compute
        capability `capability` (e.g. 90); -> how many failed."""
        shares = [items[i::len(self.children)] for i in range(len(self.children))]
        header = json.dumps({"device": device_index, "capability": capability}) + "\n"
        for child, share in zip(self.children, shares):
            child.submit(header + "".join(json.dumps({"module": m, "qualname": q, "spec": s}) + "\n"
                                          for m, q, s in share))
        failed = 0
        deadline = time.monotonic() + _POOL_TIMEOUT_S + _POOL_TIMEOUT_PER_VARIANT_S * max(map(len, shares), default=0)
        for child, share in zip(self.children, shares):
            answers = child.answers(max(deadline - time.monotonic(), 1.0))
            failed += len(share) - sum(line == "ok" for line in answers)
        return failed

    def close(self) -> None:
        for child in self.children:
            child.close()


_pool: CompilePool | None = None
_elsewhere = False  # this process runs no worker: its engine process compiles (leave_to_engine_process)


def leave_to_engine_process() -> None:
    """This process's engine runs in another process, which starts its own compile processes: start
    none here (the server's frontend, whose create_engine_config would)."""
    global _elsewhere
    _elsewhere = True
    close_compile_pool()


def start_compile_pool(early: bool = False) -> None:
    """Start the compile processes now, once per process (later calls do nothing while they run);
    a failure to start them only means this process compiles instead. early: before the engine
    knows its start-up's variants (the config, the device's start), so only on a Triton cache that
    holds no start's variants yet (no warm marker, worker/precompile.py: a fresh machine): a warm
    start would only lose CPU to their imports; a new configuration on a used cache starts them
    once the worker finds its marker missing."""
    global _pool
    if _pool is not None or _elsewhere:
        return
    if early and _has_warm_markers():
        return
    try:
        _pool = CompilePool(_processes())
    except Exception as e:  # noqa: BLE001
        logger.info("Triton compile processes not started (%s); compiling in this process", e)


def _processes() -> int:
    return min(_MAX_PROCESSES, max((os.cpu_count() or 1) - 1, 1))


def fork_compile_pool(close_in_child: tuple[int, ...] = ()) -> None:
    """The prestarted engine process's first act (one CUDA device), unless PAGEDLLM_PARALLEL_COMPILE=0,
    on a Triton cache no start has completed on: fork the compile processes now, while this process is
    still a single-threaded copy of its fork server (torch imported, no CUDA context, no threads),
    so they skip a new interpreter's imports (engine/core_proc.py). close_in_child: descriptors the
    children must not keep open (the engine's pipes to its frontend)."""
    global _pool
    from pagedllm import envs

    if _pool is not None or _elsewhere or envs.PAGEDLLM_PARALLEL_COMPILE is False or _has_warm_markers():
        return
    try:
        _pool = CompilePool(_processes(), fork=True, close_in_child=close_in_child)
    except Exception as e:  # noqa: BLE001 - start_compile_pool starts them the other way later
        logger.info("Triton compile processes not forked (%s)", e)


def _has_warm_markers() -> bool:
    from pagedllm import envs

    try:
        return any((envs.triton_cache_dir() / "pagedllm-warm").iterdir())
    except OSError:
        return False


def current() -> CompilePool | None:
    return _pool


def close_compile_pool() -> None:
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


