"""What happens to a preempted request's KV cache: one policy object the scheduler consults, chosen
by vLLM's preemption_mode.

    "recompute"  RecomputePreemption (here): the blocks are freed; the request starts over from its
                 prompt and outputs when readmitted (its prefix may still hit the prefix cache).
    "swap"       SwapManager (core/swap.py): the blocks are copied to a CPU pool and copied back in
                 when the request resumes, which it does where it stopped.

The scheduler calls the same five hooks either way: `preempt` (before the blocks are freed),
`resume_point` / `resume` (admitting a waiting request), `drop` (a request ends) and
`take_block_copies` (each step's copies for the worker), plus `check_invariants` under
PAGEDLLM_DEBUG_BLOCKS.
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.core.swap import SwapManager
from pagedllm.request import Request

BlockCopies = list[tuple[int, int]]  # (source block, destination block)


class PreemptionPolicy(Protocol):
    mode: str

    def preempt(self, req: Request, gpu_block_ids: list[int]) -> bool:
        """Keep what resuming needs before the request's blocks are freed; False: nothing kept."""
        ...

    def resume_point(self, req: Request) -> int | None:
        """Computed tokens kept for a waiting request (it resumes after them), or None: start over."""
        ...

    def resume(self, req: Request, gpu_block_ids: list[int]) -> None:
        """The request was readmitted from its resume point into these blocks."""
        ...

    def drop(self, req: Request) -> None:
        """The request ended (finished or aborted): let go of anything kept for it."""
        ...

    def take_block_copies(self) -> tuple[BlockCopies, BlockCopies]:
        """(copies out, copies in) the worker performs before this step's forward pass."""
        ...

    def check_invariants(self) -> None: ...


class RecomputePreemption:
    mode = "recompute"

    def preempt(self, req: Request, gpu_block_ids: list[int]) -> bool:
        return False

    def resume_point(self, req: Request) -> int | None:
        return None

    def resume(self, req: Request, gpu_block_ids: list[int]) -> None:
        raise AssertionError("recompute keeps nothing to resume from")

    def drop(self, req: Request) -> None:
        pass

    def take_block_copies(self) -> tuple[BlockCopies, BlockCopies]:
        return [], []

    def check_invariants(self) -> None:
        pass


def make_preemption_policy(mode: str, num_cpu_blocks: int, block_size: int) -> PreemptionPolicy:
    if mode == "recompute":
        return RecomputePreemption()
    if mode == "swap":
        return SwapManager(num_cpu_blocks, block_size)
    raise ValueError(f"preemption_mode must be recompute or swap, got {mode!r}.")
