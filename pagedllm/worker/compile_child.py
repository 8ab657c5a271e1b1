"""A Triton compile process for the start-up's parallel compile (worker/precompile.py).

Triton's compile holds the GIL for most of its work, so threads of one process compile one after
another; processes do not. Each child is started early (worker/compile_pool.py), imports Triton
and the kernel modules while the parent loads the config and the model, then reads variants from
stdin, one JSON line each: {"module": ..., "qualname": ..., "spec": <Triton's specialization data>}, compiles each
through `JITFunction.preload` into the shared TRITON_CACHE_DIR and answers one line per variant
("ok" or "err <message>"). The parent's own preload of the same variant then finds it on disk.

Run as `python -m pagedllm.worker.compile_child`; the first stdin line names the device and its
compute capability, so no CUDA context is needed: Triton is told the target instead of asking the
driver (if that fails with another Triton, the child asks the device).
"""

from __future__ import annotations

import importlib
import json
import select
import sys

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


def main() -> None:
    # Imports first (they overlap the parent's config and model loading), then the header line
    # {"device": index, "capability": e.g. 90} that the parent sends with the variants.
    for name in _WARM_MODULES:
        importlib.import_module(f"pagedllm.kernels.{name}")
    try:  # Triton's driver (on a cold cache it builds its C helpers with the C compiler): no CUDA context yet
        from triton.runtime import driver

        driver.active.get_current_target  # noqa: B018 - touching it builds the driver
    except Exception:  # noqa: BLE001 - then it is built after the header, or the variants fail and the parent compiles
        pass
    # A parent that never compiles (its engine runs in another process, a warm start that forgot
    # to end us) does not keep us: give up after _IDLE_S.
    if not select.select([sys.stdin], [], [], _IDLE_S)[0]:
        return
    header = sys.stdin.readline()
    if not header:
        return  # the parent ended without compiling (a warm start, a CPU run)
    target = json.loads(header)
    try:
        _pin_target(int(target["device"]), int(target["capability"]))
    except Exception:  # noqa: BLE001 - another Triton's driver: ask the device (a CUDA context)
        import torch

        torch.cuda.set_device(int(target["device"]))
    for line in sys.stdin:
        try:
            item = json.loads(line)
            _kernel(item["module"], item["qualname"]).preload(item["spec"])
            print("ok", flush=True)
        except Exception as e:  # noqa: BLE001 - reported; the parent compiles that variant itself
            print("err " + f"{type(e).__name__}: {e}".replace("\n", " ")[:300], flush=True)


if __name__ == "__main__":
    main()
