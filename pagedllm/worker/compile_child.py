"""A Triton compile process for the start-up's parallel compile (worker/precompile.py).

Triton's compile holds the GIL for most of its work, so threads of one process compile one after
another; processes do not. Each child is started early (worker/compile_pool.py), imports Triton
and the kernel modules while the parent loads the config and the model, then reads variants from
stdin, one JSON line each: {"module": ..., "qualname": ..., "spec": <Triton's specialization data>}, compiles each
through `JITFunction.preload` into the shared TRITON_CACHE_DIR and answers one line per variant
("ok" or "err <message>"). The parent's own preload of the same variant then finds it on disk.

Run as `python -m pagedllm.worker.compile_child`; the first stdin line names the device and its
compute capability, so no CUDA context is needed: Triton is told the target instead of asking the
driver (if that fails with another Triton, the child asks the device). Or forked from the engine
process before it touches CUDA (`serve_connection`: torch is imported already), the same lines
over a pipe.
"""

from __future__ import annotations

import importlib
import json
import select
import sys
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection

_IDLE_S = 300.0
_WARM_MODULES = ("paged_attention", "decode_attention", "qkv_prep", "rmsnorm", "activation", "gemv", "sampling",
                 "kv_cache_write", "split_k")


def _pin_target(device: int, capability: int) -> None:
    """Make Triton's driver answer device / target questions without a CUDA context."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    active = driver.active
    target = GPUTarget("cuda", capability, 32)
    active.get_current_device = lambda: device
    active.get_current_target = lambda: target


def _kernel(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _import_kernels() -> None:
    """The kernel modules and Triton's driver, before any variant arrives (they overlap the parent's
    config and model loading); the compiled variants go to the engine's Triton cache directory."""
    from pagedllm import envs

    envs.use_triton_cache_dir()  # the path the engine's worker uses (its TRITON_CACHE_DIR, set or derived)
    for name in _WARM_MODULES:
        importlib.import_module(f"pagedllm.kernels.{name}")
    try:  # Triton's driver (on a cold cache it builds its C helpers with the C compiler): no CUDA context yet
        from triton.runtime import driver

        driver.active.get_current_target  # noqa: B018 - touching it builds the driver
    except Exception:  # noqa: BLE001 - then it is built after the header, or the variants fail and the parent compiles
        pass


def compile_lines(header: str, lines: Iterable[str]) -> Iterator[str]:
    """Compile each variant line after the header line; one answer per variant, "ok" or "err ..."."""
    target = json.loads(header)
    try:
        _pin_target(int(target["device"]), int(target["capability"]))
    except Exception:  # noqa: BLE001 - another Triton's driver: ask the device (a CUDA context)
        try:
            import torch

            torch.cuda.set_device(int(target["device"]))
        except Exception as e:  # noqa: BLE001 - no target at all: every variant is left to the parent
            yield from ("err no compile target: " + f"{type(e).__name__}: {e}".replace("\n", " ")[:200]
                        for line in lines if line.strip())
            return
    for line in lines:
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            _kernel(item["module"], item["qualname"]).preload(item["spec"])
            yield "ok"
        except Exception as e:  # noqa: BLE001 - reported; the parent compiles that variant itself
            yield "err " + f"{type(e).__name__}: {e}".replace("\n", " ")[:300]


def main() -> None:
    _import_kernels()
    # A parent that never compiles (its engine runs in another process, a warm start that forgot
    # to end us) does not keep us: give up after _IDLE_S.
    if not select.select([sys.stdin], [], [], _IDLE_S)[0]:
        return
    header = sys.stdin.readline()
    if not header:
        return  # the parent ended without compiling (a warm start, a CPU run)
    for answer in compile_lines(header, sys.stdin):
        print(answer, flush=True)


def serve_connection(conn: Connection) -> None:
    """The same work for a child forked from the engine process (worker/compile_pool.py): the
    variants arrive as one message (the header line, then one line per variant), the answers go
    back as one message; EOF (the parent is gone or closed us) ends it."""
    _import_kernels()
    try:
        if not conn.poll(_IDLE_S):
            return
        header, _, rest = conn.recv_bytes().decode().partition("\n")
        conn.send_bytes("\n".join(compile_lines(header, rest.splitlines())).encode())
    except (EOFError, OSError):
        return

if __name__ == "__main__":
    main()
