"""A kernel that holds its stream until flag words in mapped host memory reach a value: gated
sampling's wait (structured_output/gate.py) where the driver refuses `cuStreamWaitValue32`.

    flags int32 (n,) host memory mapped into the device's address space (its device address)
    one program: for each word, re-read it (a volatile load over the bus, ~1-2 us) until >= target

The plain reference is `structured_output.gate.host_wait` (the same condition, polled on the host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _spin_kernel(flags_ptr, num_flags, target):
    for i in range(num_flags):
        value = tl.load(flags_ptr + i, volatile=True)
        while value < target:
            value = tl.load(flags_ptr + i, volatile=True)


class _Address:
    """What Triton's launcher reads of a pointer argument: an address and an element type."""

    dtype = torch.int32

    def __init__(self, address: int) -> None:
        self._address = address

    def data_ptr(self) -> int:
        return self._address


def spin_until_geq(device_address: int, num_flags: int, target: int, stream: torch.cuda.Stream) -> None:
    """Queue on `stream` one program that returns once every int32 word at `device_address`
    (num_flags of them) is >= target."""
    with torch.cuda.stream(stream):
        _spin_kernel[(1,)](_Address(device_address), num_flags, target, num_warps=1)
