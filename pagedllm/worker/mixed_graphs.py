"""CUDA graphs for steps that carry prefill chunks (vLLM's cudagraph_mode FULL_AND_PIECEWISE).

Why. Such a step runs the whole forward eagerly: a few hundred launches (GEMMs, Triton kernels,
tensor views), each paying Python and driver time. At 64 concurrent requests that host time was
~22 ms a step against ~3 ms for a decode step replayed from a graph, a third of the run
(BENCHMARKS.md, issue 16, "mixed steps"). A graph replays all of it in one launch.

How. A graph is captured per token count in `mixed_capture_sizes` (the step's tokens are padded up
to the next one) with a fixed number of request slots R = max_num_seqs. Every launch of the forward
reads only host ints that are fixed per graph: the token count T, R, and the static buffers'
shapes. The attention kernel's grid, T // BLOCK_Q + R query tiles (kernels/paged_attention.py),
covers any split of T tokens among up to R requests; the step's real layout lives on the device:

    3 requests of 5, 1 and 1 tokens, R = 4, graph T = 8:
        query_start_loc [0, 5, 6, 7, 7]     slot 3 is padding: 0 tokens, its programs exit at once
        seq_lens        [12, 30, 9, 1]
        slot_mapping    [s0 .. s6, -1]      token 7 is padding: no K/V write, its row is dropped
        positions       [7 .. 11, 29, 8, 0]

A padding token belongs to no request, so attention never reads or writes it; the GEMMs and norms
compute its row, which is dropped. Steps larger than the largest size run eagerly: that is the
token budget up to 8192 for small models and mixture-of-experts ones, less for large dense ones,
whose kernels outlast their eager launches anyway (`mixed_graph_token_cap`).

Not captured (the step runs eagerly as before): MLA layers (their prefill path plans on the host),
pipeline parallelism (stage sends stay outside graphs; the decode graphs handle them).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.cuda_graphs import capture_forward, describe_clock

if TYPE_CHECKING:
    from pagedllm.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)

# Above this many tokens a step's kernels take long enough that the eager launches hide behind
# them, and each larger graph would hold activations for that many tokens in the graph pool.
MAX_MIXED_GRAPH_TOKENS = 8192
# A graph only pays where the step's kernels are shorter than its eager launches (~20-25 ms for a
# dense model: with async scheduling, longer kernels hide the launches behind them). Sizes whose
# forward is above this many FLOPs (2 x parameters x tokens; ~40 ms of an H200's tensor cores) are
# not captured:
#     Qwen3-0.6B: every size up to 8192;  Llama-3.1-8B (8.0e9 parameters): up to 1536 tokens.
# Mixture-of-experts models capture every size: their eager launches outlast the kernels at all of
# them (the router, the align and the expert GEMMs are ~30 host calls a layer against a dense MLP's
# 3; Qwen3-30B-A3B at 8192 tokens on the H200: 132 ms of host launch for 112 ms of kernels, so the
# 18 such steps of W1 ran at 25% of their floor; BENCHMARKS.md, issue 24, branch h45).
MIXED_GRAPH_MAX_FLOPS = 2.5e13
MIN_MIXED_GRAPH_TOKENS = 512


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters a token's forward multiplies by: all of them, except that a mixture-of-experts
    layer counts top_k of its num_experts (Qwen3-30B-A3B: ~3.3e9 of 30.5e9)."""
    from pagedllm.layers.fused_moe.layer import FusedMoE

    total = 0.0
    for module in model.modules():
        own = sum(p.numel() for p in module.parameters(recurse=False))
        if isinstance(module, FusedMoE) and module.num_experts:
            own *= min(1.0, module.top_k / module.num_experts)
        total += own
    return int(total)


def has_experts(model: torch.nn.Module) -> bool:
    """Whether the model has a mixture-of-experts layer (FusedMoE)."""
    from pagedllm.layers.fused_moe.layer import FusedMoE

    return any(isinstance(m, FusedMoE) for m in model.modules())


def mixed_graph_token_cap(num_params: int, experts: bool = False) -> int:
    """The largest step, in tokens, worth a graph for a model of num_params (active) parameters per
    rank; experts: the model has MoE layers (every size is worth one, see MIXED_GRAPH_MAX_FLOPS)."""
    if experts:
        return MAX_MIXED_GRAPH_TOKENS
    return max(MIN_MIXED_GRAPH_TOKENS, min(MAX_MIXED_GRAPH_TOKENS, int(MIXED_GRAPH_MAX_FLOPS / (2 * max(num_params, 1)))))


def mixed_capture_sizes(max_num_batched_tokens: int, max_tokens: int = MAX_MIXED_GRAPH_TOKENS) -> list[int]:
    """Token counts to capture: steps of 64 up to 512, then 4 sizes per doubling, so a step pads by
    at most ~25% (of its GEMM rows; attention skips the padding). They end at the token budget when
    it is at most max_tokens, else at the largest such size up to max_tokens.

        8192        -> [64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792,
                        2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192]
        300         -> [64, 128, 192, 256, 300]
        8192, 1562  -> [64, ..., 1024, 1280, 1536]
    """
    sizes, size = [], 64
    while size < min(max_num_batched_tokens, max_tokens + 1):
        sizes.append(size)
        size += max(64, 1 << max(size.bit_length() - 3, 0))  # 64 below 512, then size / 8 .. size / 4
    if max_num_batched_tokens <= max_tokens:
        sizes.append(max_num_batched_tokens)
    return sizes


class MixedGraphRunner:
    """Graphs of whole forward passes for steps with prefill chunks, one per `sizes` token count.

    max_num_seqs: the request slots every graph has (R above). capture=False keeps the same
    padded static-buffer path but runs the model eagerly on it (no graphs): the CPU tests hold
    that path to the plain forward."""

    def __init__(self, model: torch.nn.Module, device: torch.device, sizes: list[int], max_num_seqs: int,
                 max_model_len: int, block_size: int, pool: object = None, capture: bool = True) -> None:
        self.model = model
        self.device = device
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        self.max_reqs = max_num_seqs
        self.max_blocks = -(-max_model_len // block_size)
        self.max_seq_len = max_model_len
        self.use_graphs = capture
        self.pool = pool
        t, r, dev = self.max_tokens, self.max_reqs, device
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.zeros(r + 1, dtype=torch.int32, device=dev)  # no request holds a token
        self.seq_lens = torch.ones(r, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros((r, self.max_blocks), dtype=torch.int32, device=dev)
        pin = dev.type == "cuda"
        # Two host sets used by alternate steps, as the decode graphs (cuda_graphs.py says why).
        self.h_tokens = torch.zeros((2, 3, t), dtype=torch.int64)  # ids, positions, slots
        self.h_qsl = torch.zeros((2, r + 1), dtype=torch.int32)
        self.h_seq = torch.ones((2, r), dtype=torch.int32)
        self.h_table = torch.zeros((2, r, self.max_blocks), dtype=torch.int32)
        if pin:
            self.h_tokens, self.h_qsl, self.h_seq, self.h_table = (
                x.pin_memory() for x in (self.h_tokens, self.h_qsl, self.h_seq, self.h_table))
        self.parity = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, size: int, parity: int | None = None) -> AttentionMetadata:
        """size tokens over all R request slots. max_query_len > 1 keeps every layer on its mixed
        path; max_seq_len is the graphs' maximum (nothing in a mixed step's launches reads it)."""
        p = self.parity if parity is None else parity
        return AttentionMetadata(
            num_actual_tokens=size,
            num_reqs=self.max_reqs,
            max_query_len=max(2, size),
            max_seq_len=self.max_seq_len,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            slot_mapping=self.slot_mapping[:size],
            # Host copies for the torch reference path (capture=False on the CPU); graph launches
            # never read them.
            query_start_loc_cpu=self.h_qsl[p],
            seq_lens_cpu=self.h_seq[p],
        )

    def _size_for(self, num_tokens: int) -> int:
        """The smallest captured size that holds num_tokens."""
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, so smaller graphs reuse the big one's memory (and the decode graphs' pool,
        when given)."""
        if not self.use_graphs:
            return
        t0 = time.monotonic()
        before = torch.cuda.memory_reserved(self.device)
        clock: dict[str, float] = {}
        # An eager pass for the first size of each Triton specialisation of the token count only (== 1,
        # divisibility by 16: every default size is a multiple of 64, so one pass), as the decode graphs do.
        met: set[tuple[bool, bool]] = set()
        for size in reversed(self.sizes):
            ids, pos, md = self.input_ids[:size], self.positions[:size], self._metadata(size)
            key = (size == 1, size % 16 == 0)
            # The buffers hold no request's token yet: the passes write nothing.
            g, out = capture_forward(lambda ids=ids, pos=pos, md=md: self.model(ids, pos, md), self.device, self.pool,
                                     clock, eager=key not in met)
            met.add(key)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[size], self.outputs[size] = g, out
        torch.cuda.synchronize(self.device)
        logger.info("captured %d mixed-step CUDA graphs (%d..%d tokens, %d request slots) in %.1f s, %.2f GiB%s",
                    len(self.sizes), self.sizes[0], self.sizes[-1], self.max_reqs, time.monotonic() - t0,
                    (torch.cuda.memory_reserved(self.device) - before) / 2**30, describe_clock(clock))

    def can_run(self, inp: StepInputs) -> bool:
        return (
            (bool(self.graphs) or not self.use_graphs)  # captured, or the eager path of capture=False
            and 0 < len(inp.req_ids) <= self.max_reqs
            and len(inp.input_ids) <= self.max_tokens
            and inp.block_table.shape[1] <= self.max_blocks
        )

    @torch.inference_mode()
    def run(self, inp: StepInputs, fill_pending: Callable[[torch.Tensor, StepInputs], None]) -> torch.Tensor:
        """Hidden states (num_tokens, hidden) of the step's tokens (padding rows cut off)."""
        n, r = len(inp.input_ids), len(inp.req_ids)
        size = self._size_for(n)
        self.parity ^= 1
        p = self.parity
        tokens = self.h_tokens[p].numpy()
        tokens[0, :n] = inp.input_ids
        tokens[1, :n] = inp.positions
        tokens[2, :n] = inp.slot_mapping
        tokens[:2, n:size] = 0
        tokens[2, n:size] = -1  # padding writes no K/V
        qsl = self.h_qsl[p].numpy()
        qsl[: r + 1] = inp.query_start_loc
        qsl[r + 1:] = n  # empty request slots
        seq = self.h_seq[p].numpy()
        seq[:r] = inp.seq_lens
        seq[r:] = 1
        width = inp.block_table.shape[1]
        table = self.h_table[p].numpy()
        table[:r, :width] = inp.block_table
        h_tokens = self.h_tokens[p]
        self.input_ids[:size].copy_(h_tokens[0, :size], non_blocking=True)
        fill_pending(self.input_ids, inp)
        self.positions[:size].copy_(h_tokens[1, :size], non_blocking=True)
        self.slot_mapping[:size].copy_(h_tokens[2, :size], non_blocking=True)
        self.query_start_loc.copy_(self.h_qsl[p], non_blocking=True)
        self.seq_lens.copy_(self.h_seq[p], non_blocking=True)
        # Rows past r keep stale block ids: their requests hold no tokens, so nothing reads them.
        self.block_table[:r, :width].copy_(self.h_table[p, :r, :width], non_blocking=True)
        if self.use_graphs:
            self.graphs[size].replay()
            out = self.outputs[size]
        else:
            out = self.model(self.input_ids[:size], self.positions[:size], self._metadata(size, p))
        return out[:n]
