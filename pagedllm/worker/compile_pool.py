"""The compile processes of the start-up's parallel Triton compile (worker/precompile.py).

Started as early as the engine knows it will run on a GPU (EngineArgs.create_engine_config, again
at Worker.init_device if not yet), so that each child's imports (torch, Triton, the kernel
modules: seconds) overlap the config and model loading. The children are plain subprocesses of
`python -m pagedllm.worker.compile_child` (not multiprocessing: a spawned child would re-import
the user's main script), fed over stdin.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

logger = logging.getLogger(__name__)

_MAX_PROCESSES = 8
_POOL_TIMEOUT_S = 180.0  # a child that hangs must not hang the start: the engine then compiles itself


class CompilePool:
    """Compile processes (worker/compile_child.py), started early so their imports overlap the
    model load. `compile` hands each a share of the variants and waits; `close` ends them."""

    def __init__(self, processes: int) -> None:
        import pagedllm
        from pagedllm import envs

        root = os.path.dirname(os.path.dirname(os.path.abspath(pagedllm.__file__)))
        env = envs.child_environment(python_path=root)
        self.children = [
            subprocess.Popen([sys.executable, "-m", "pagedllm.worker.compile_child"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            for _ in range(processes)
        ]

    def compile(self, items: list[tuple[str, str, str]], device_index: int, capability: int) -> int:
        """items: (module, qualname, specialization data) for the device `device_index` of compute
        capability `capability` (e.g. 90); -> how many failed."""
        shares = [items[i::len(self.children)] for i in range(len(self.children))]
        header = json.dumps({"device": device_index, "capability": capability}) + "\n"
        for child, share in zip(self.children, shares):
            assert child.stdin is not None
            child.stdin.write(header + "".join(json.dumps({"module": m, "qualname": q, "spec": s}) + "\n" for m, q, s in share))
            child.stdin.close()
            child.stdin = None  # closed: communicate() below only reads
        failed = 0
        deadline = time.monotonic() + _POOL_TIMEOUT_S
        for child, share in zip(self.children, shares):
            out, _ = child.communicate(timeout=max(deadline - time.monotonic(), 1.0))  # TimeoutExpired: caller
            failed += len(share) - sum(line == "ok" for line in out.splitlines())
        return failed

    def close(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
                child.wait()


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
        _pool = CompilePool(min(_MAX_PROCESSES, max((os.cpu_count() or 1) - 1, 1)))
    except Exception as e:  # noqa: BLE001
        logger.info("Triton compile processes not started (%s); compiling in this process", e)


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


