"""Host -> device copies that never make the host wait for queued GPU work.

CUDA documents a copy from pageable host memory (`torch.from_numpy(a).to("cuda",
non_blocking=True)`, a plain `torch.tensor(list)` moved to the GPU) as possibly synchronous: the
driver stages it and may first wait for the work queued on the stream. In a step path under async
scheduling such a wait would undo the overlap (the host blocks until step N ends, then the GPU
idles while step N+1 is launched). Staging through pinned memory keeps the copy queued whatever
the driver does; torch's caching host allocator keeps the pinned source alive until the copy's
stream has run it. (On the H200 the step path's small pageable copies did not wait, before or
after this module: BENCHMARKS.md; tests/worker/test_step_launch_cuda.py guards it.)

    ids = host_tensor([3, 7, 9], torch.int64, device)        # list -> device
    table = to_device_async(torch.from_numpy(array), device)   # numpy / CPU tensor -> device

On the CPU both return host tensors (no copy for a CPU tensor).
"""

from __future__ import annotations

import torch


def needs_pinning(device: torch.device) -> bool:
    """Whether host buffers bound for `device` should be pinned (CUDA: copies then queue)."""
    return device.type == "cuda"


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> `device` without a host sync: pinned memory + non_blocking on CUDA.

    The source is pinned by copying (unless it is already); later writes to `t` therefore
    cannot reach the queued copy.
    """
    if device.type == "cpu":
        return t
    if not needs_pinning(device):
        return t.to(device)
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def host_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A Python list as a tensor on `device`, through pinned memory when that is an accelerator."""
    return to_device_async(torch.tensor(values, dtype=dtype, pin_memory=needs_pinning(device)), device)
