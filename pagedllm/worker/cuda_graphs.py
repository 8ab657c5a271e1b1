"""CUDA graphs for decode-only steps (vLLM's cuda_graph_sizes), padded up to a captured size.

A decode step launches a few hundred small kernels; replaying them as one graph removes the
launch overhead that dominates at small batches. Each captured graph reads its inputs from static
device buffers, so a step copies its inputs there (one pinned host -> device copy per buffer) and
replays the smallest graph whose batch size fits:

    7 decode requests, sizes [1, 2, 4, 8, 16] -> replay the 8 graph; row 7 is padding: a dummy
    request with seq_len 1 whose K/V write is skipped (slot -1) and whose output is dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedllm.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagedllm.worker.input_batch import StepInputs
    from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """[1, 2, 4, 8, 16, 24, ..., max_num_seqs] (multiples of 8 past 8, as vLLM), capped at 512."""
    top = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device = runner.device
        cfg = runner.config
        self.sizes = capture_sizes(cfg.scheduler_config.max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.max_blocks = -(-cfg.model_config.max_model_len // runner.block_size)
        self.max_seq_len = cfg.model_config.max_model_len
        b, dev = self.max_bs, self.device
        # Device buffers every graph reads; host twins are pinned so copies are truly async.
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros((b, self.max_blocks), dtype=torch.int32, device=dev)
        # Two sets of host buffers, used by alternate steps: with async scheduling the copies of
        # step N may still be queued while step N+1 is prepared, but step N-1's are done.
        self.h_tokens = torch.zeros((2, 3, b), dtype=torch.int64).pin_memory()  # ids, positions, slots
        self.h_seq_lens = torch.ones((2, b), dtype=torch.int32).pin_memory()
        self.h_block_table = torch.zeros((2, b, self.max_blocks), dtype=torch.int32).pin_memory()
        self.parity = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=bs,
            num_reqs=bs,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs],
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc_cpu=torch.arange(bs + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(bs, dtype=torch.int32),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        model = self.runner.model
        # Largest first, so smaller graphs reuse the big one's memory pool.
        for bs in reversed(self.sizes):
            md = self._metadata(bs)
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks algorithms
                model(self.input_ids[:bs], self.positions[:bs], md)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = model(self.input_ids[:bs], self.positions[:bs], md)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
            self.outputs[bs] = out
        # Replay each graph once now (all rows padding: nothing is written): the first launch of a
        # graph uploads it to the device, which would otherwise land on a serving step.
        for g in self.graphs.values():
            g.replay()
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs (batch sizes %s..%s) in %.1f s",
                    len(self.sizes), self.sizes[0], self.sizes[-1], time.monotonic() - t0)

    def can_run(self, inp: StepInputs) -> bool:
        num_reqs = len(inp.req_ids)
        return (
            0 < num_reqs <= self.max_bs
            and int(inp.query_start_loc[-1]) == num_reqs  # decode only: one token each
            and inp.block_table.shape[1] <= self.max_blocks
        )

    def run(self, inp: StepInputs, fill_pending: Callable[[torch.Tensor, StepInputs], None]) -> torch.Tensor:
        """Hidden states (num_reqs, hidden) of a decode-only step."""
        n = len(inp.req_ids)
        bs = next(s for s in self.sizes if s >= n)
        self.parity ^= 1
        h_tokens, h_seq, h_table = self.h_tokens[self.parity], self.h_seq_lens[self.parity], self.h_block_table[self.parity]
        tokens = h_tokens.numpy()
        tokens[0, :n] = inp.input_ids
        tokens[1, :n] = inp.positions
        tokens[2, :n] = inp.slot_mapping
        # Padding rows: token 0 at position 0, writing nothing (slot -1). The buffer may hold
        # anything there from earlier steps, e.g. the -1 of a token that was still in flight.
        tokens[:2, n:bs] = 0
        tokens[2, n:bs] = -1
        seq = h_seq.numpy()
        seq[:n] = inp.seq_lens
        seq[n:bs] = 1
        width = inp.block_table.shape[1]
        table = h_table.numpy()
        table[:n, :width] = inp.block_table
        table[n:bs, :width] = 0
        self.input_ids[:bs].copy_(h_tokens[0, :bs], non_blocking=True)
        fill_pending(self.input_ids, inp)
        self.positions[:bs].copy_(h_tokens[1, :bs], non_blocking=True)
        self.slot_mapping[:bs].copy_(h_tokens[2, :bs], non_blocking=True)
        self.seq_lens[:bs].copy_(h_seq[:bs], non_blocking=True)
        self.block_table[:bs, :width].copy_(h_table[:bs, :width], non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
