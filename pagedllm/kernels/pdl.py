"""Programmatic dependent launch (PDL, sm_90+): a kernel starts while the one before it finishes.

A decode step is a chain of short kernels (a batch-1 int4 Llama-3.1-8B layer: qkv GEMV, attention,
its split merge, o GEMV, gate_up GEMV, down GEMV), each of a few microseconds, and each waits for the
one before it to end before its programs are even placed on the SMs: the launch and the last wave's
tail are paid at every boundary. Launched with PDL, the next kernel's programs are placed as soon as
every program of the one before has said so (`griddepcontrol.launch_dependents`), run what does not
depend on it (index math; the weights' prefetch into L2: constants), and wait
(`griddepcontrol.wait`) until it has ended and its writes are visible before touching anything it
wrote, or anything it reads:

    kernel A  [....... A's programs ..........]
    kernel B          [B placed, prefetch | wait ]---[B's work .......]

Contract of a kernel launched with `launch_kwargs()` (USE_PDL true): nothing before its `wait` reads
memory another kernel writes, and nothing before it writes memory at all. A kernel launched without
PDL after one with PDL, or the other way round, keeps stream order (the driver's implicit trigger at
a kernel's end), so kernels may take PDL one at a time.

Where: CUDA devices of compute capability 9 and up, Triton's compiler (not its interpreter, which runs
no PTX); PAGEDLLM_PDL=0 turns it off (A/B timings). CUDA graphs capture the programmatic edges.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm import envs
from pagedllm.envs import environment_variables

__all__ = ["ENABLED", "launch_kwargs", "pdl_launch_dependents", "pdl_wait", "prefetch_l2", "uses_pdl"]

ENABLED = environment_variables["PAGEDLLM_PDL"]() and not envs.TRITON_INTERPRET


def _triton_has_pdl() -> bool:
    """Whether this Triton compiles `launch_pdl` and the griddepcontrol helpers (Triton >= 3.3)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and hasattr(tl.extra.cuda, "gdc_wait")


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and _triton_has_pdl()


def uses_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL (the USE_PDL constexpr to pass)."""
    return ENABLED and device.type == "cuda" and _capable(device.index if device.index is not None
                                                         else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict[str, object]:
    """A PDL kernel's launch options: `kernel[grid](..., USE_PDL=..., **launch_kwargs(dev))`; both from
    `uses_pdl`, so a kernel is never launched early without its wait compiled in."""
    use = uses_pdl(device)
    return {"USE_PDL": use, "launch_pdl": True} if use else {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the kernel before this one has ended and its memory is visible (no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel's programs be placed once every program of this one got here (no-op without
    PDL). Called right after `pdl_wait`: by then every program of this kernel is on an SM or done, so the
    next kernel's early programs never keep this one's from starting."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask, USE_PDL: tl.constexpr):
    """Ask L2 for the lines of `ptrs` (any shape) where mask holds, without waiting for them: constant
    data (weights) a PDL kernel fetches before its wait, so its loads after it hit L2. One PTX
    `prefetch.global.L2` per element; give one pointer per 128-byte line."""
    if USE_PDL:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )
