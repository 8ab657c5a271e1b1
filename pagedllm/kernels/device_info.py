"""Facts about a CUDA device that the kernel dispatch asks on every call, asked of CUDA once per device.

`torch.cuda.get_device_capability` costs a driver query each time; the int4 and block-FP8 dispatches
run once per linear per step, so they read the answer from here.
"""

from __future__ import annotations

import torch

__all__ = ["device_index", "is_sm90"]

_SM90: dict[int, bool] = {}  # device index -> whether its compute capability is exactly 9.0 (H100, H200)


def device_index(t: torch.Tensor) -> int:
    """The CUDA device index of a CUDA tensor (the current device for an index-less `cuda` device)."""
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def is_sm90(index: int) -> bool:
    """Whether CUDA device `index` is sm_90 (Hopper: wgmma, cuBLASLt's block-scaled FP8). sm_90a code does
    not run on later architectures, so 10.x and 12.x answer False too."""
    known = _SM90.get(index)
    if known is None:
        known = _SM90[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return known
