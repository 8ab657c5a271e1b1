"""The CPU side of swap preemption: one KV tensor per layer in (pinned) host memory, and the
block copies the scheduler asks for (see core/swap.py).

The host caches take the device cache's dtype (kv_cache_dtype), so a block swaps out and back in
bit for bit."""

from __future__ import annotations

import math

import torch


class CpuSwapSpace:
    def __init__(self, num_cpu_blocks: int, gpu_caches: list[torch.Tensor]) -> None:
        # fp8 caches move as their bytes: torch has no CPU index kernels for float8.
        self.gpu_caches = [c.view(torch.uint8) if c.is_floating_point() and c.element_size() == 1 else c
                           for c in gpu_caches]
        gpu_caches = self.gpu_caches
        pin = gpu_caches[0].is_cuda if gpu_caches else False
        # Same layout as the device cache: (2, num_blocks, block_size, num_kv_heads, head_dim). Blocks
        # must hold finite numbers (a masked slot still meets a 0 weight in the torch reference): zeros.
        # A large unpinned torch.empty is a fresh anonymous mapping the OS zero-fills on first touch, so
        # the default 4 GiB costs neither a start-up memset (~2 s) nor memory until blocks are swapped.
        def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            fresh = not pin and math.prod(shape) * dtype.itemsize > 64 * (1 << 20)
            return torch.empty(shape, dtype=dtype) if fresh else torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.cpu_caches = [alloc((c.shape[0], num_cpu_blocks, *c.shape[2:]), c.dtype) for c in gpu_caches]

    @staticmethod
    def _index(ids: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=device)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block) pairs: copy device -> host. Waits for the copy (rare event)."""
        gpu_idx = self._index([g for g, _ in pairs], self.gpu_caches[0].device)
        cpu_idx = self._index([c for _, c in pairs], torch.device("cpu"))
        for gpu, cpu in zip(self.gpu_caches, self.cpu_caches):
            cpu[:, cpu_idx] = gpu[:, gpu_idx].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block) pairs: copy host -> device, queued before this step's forward."""
        device = self.gpu_caches[0].device
        cpu_idx = self._index([c for c, _ in pairs], torch.device("cpu"))
        gpu_idx = self._index([g for _, g in pairs], device)
        for gpu, cpu in zip(self.gpu_caches, self.cpu_caches):
            gpu[:, gpu_idx] = cpu[:, cpu_idx].to(device)
