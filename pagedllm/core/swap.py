"""Swap preemption (vLLM's preemption_mode="swap"), the scheduler's preemption policy
(core/preemption.py) that keeps KV: a preempted request's KV blocks move to a pinned CPU pool
instead of being dropped, and come back before it resumes.

The scheduler decides, the runner copies: each step's SchedulerOutput carries the (gpu, cpu) block
pairs to copy out and the (cpu, gpu) pairs to copy in, and the runner performs them before the
forward pass — after the step in flight, in stream order, so the copy sees every KV write.

    preempt A holding GPU blocks [7, 3, 9] with 40 computed tokens (block_size 16)
      -> CPU blocks [0, 1, 2]; swap_out [(7, 0), (3, 1), (9, 2)]; A.num_computed_tokens kept aside
    resume A: 3 new GPU blocks [4, 5, 6] -> swap_in [(0, 4), (1, 5), (2, 6)]; A continues at 40

A request whose blocks do not fit the free CPU pool falls back to recompute. Behind a sliding
window (core/kv_cache_manager.py) the positions freed before the window read -1: they get no CPU
block (-1 there too) and nothing is copied for them either way.
"""

from __future__ import annotations

from pagedllm.request import Request


class SwapManager:
    mode = "swap"

    def __init__(self, num_cpu_blocks: int, block_size: int) -> None:
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.free_cpu_blocks: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.swapped: dict[str, tuple[list[int], int]] = {}  # req id -> (cpu blocks, computed tokens)
        self._out: list[tuple[int, int]] = []
        self._in: list[tuple[int, int]] = []
        self.num_swapped_out = 0  # cumulative requests

    def preempt(self, req: Request, gpu_block_ids: list[int]) -> bool:
        """Reserve CPU blocks for the request's computed KV; False -> recompute instead."""
        n = -(-req.num_computed_tokens // self.block_size)
        gpu = gpu_block_ids[:n]
        num_real = sum(1 for g in gpu if g >= 0)
        if num_real == 0 or num_real > len(self.free_cpu_blocks):
            return False
        cpu = [self.free_cpu_blocks.pop() if g >= 0 else -1 for g in gpu]
        self._out.extend((g, c) for g, c in zip(gpu, cpu) if g >= 0)
        self.swapped[req.request_id] = (cpu, req.num_computed_tokens)
        self.num_swapped_out += 1
        return True

    def resume_point(self, req: Request) -> int | None:
        """The computed tokens kept on the CPU for this waiting request (it resumes there), or None."""
        entry = self.swapped.get(req.request_id)
        return entry[1] if entry else None

    def resume(self, req: Request, gpu_block_ids: list[int]) -> None:
        """The request got fresh GPU blocks for its kept tokens: copy them back in."""
        cpu, _ = self.swapped.pop(req.request_id)
        # A position skipped on resume (behind the window) reads -1 on the GPU side: not copied.
        self._in.extend((c, g) for c, g in zip(cpu, gpu_block_ids[: len(cpu)]) if c >= 0 and g >= 0)
        # Free now: a later swap-out reuses them only in a later step, whose copy runs after this one.
        self.free_cpu_blocks.extend(c for c in reversed(cpu) if c >= 0)

    def drop(self, req: Request) -> None:
        """A swapped-out request finished or was aborted: its CPU blocks go back."""
        entry = self.swapped.pop(req.request_id, None)
        if entry:
            self.free_cpu_blocks.extend(c for c in reversed(entry[0]) if c >= 0)

    def take_block_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (gpu, cpu) copies out and (cpu, gpu) copies in, for the SchedulerOutput."""
        out, inn = self._out, self._in
        self._out, self._in = [], []
        return out, inn

    def num_held_requests(self) -> int:
        return len(self.swapped)

    def check_invariants(self) -> None:
        held = sum(1 for cpu, _ in self.swapped.values() for c in cpu if c >= 0)
        assert held + len(self.free_cpu_blocks) == self.num_cpu_blocks, "CPU swap blocks leaked"
        assert len(set(self.free_cpu_blocks)) == len(self.free_cpu_blocks), "CPU block freed twice"
