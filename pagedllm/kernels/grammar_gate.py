"""A kernel that holds its stream until a flag word in mapped host memory equals a value: gated
sampling's wait (structured_output/gate.py) where the driver refuses `cuStreamWaitValue32`.

    flag  int32 (1,) host memory mapped into the device's address space (its device address)
    one program: re-read it (a volatile load over the bus, ~1-2 us) until it equals target

The plain reference is `structured_output.gate.host_wait` (the same condition, polled on the host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _spin_kernel(flag_ptr, target):
    value = tl.load(flag_ptr, volatile=True)
    while value != target:
        value = tl.load(flag_ptr, volatile=True)


class _Address:
    """What Triton's launcher reads of a pointer argument: an address and an element type."""

    dtype = torch.int32

    def __init__(self, address: int) -> None:
        self._address = address

    def data_ptr(self) -> int:
        return self._address


def spin_until_equal(device_address: int, target: int, stream: torch.cuda.Stream) -> None:
    """Queue on `stream` one program that returns once the int32 word at `device_address` equals
    `target` (a uint32 value, compared as the int32 of the same bits)."""
    with torch.cuda.stream(stream):
        _spin_kernel[(1,)](_Address(device_address), target - (1 << 32) if target >= 1 << 31 else target, num_warps=1)
