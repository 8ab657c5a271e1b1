"""CUDA graphs for decode-only steps (vLLM's cudagraph_capture_sizes), padded up to a captured size.

A decode step launches a few hundred small kernels; replaying them as one graph removes the
launch overhead that dominates at small batches. Each captured graph reads its inputs from static
device buffers, so a step copies its inputs there (one pinned host -> device copy per buffer) and
replays the smallest graph whose batch size fits:

    7 decode requests, sizes [1, 2, 4, 8, 16] -> replay the 8 graph; row 7 is padding: a dummy
    request with seq_len 1 whose K/V write is skipped (slot -1) and whose output is dropped.

Pipeline parallel: each stage captures its own graphs. A stage after the first also reads the
previous stage's activations from static buffers (hidden_states, residual: (max batch, hidden)),
received there before the replay; a stage before the last sends its graph's output rows after it.
The sends and receives stay outside the graph (NCCL point-to-point, stream-ordered with it); with
TP the all-reduces are inside it, as with one stage.

Each size is captured once per BLAS library (cuBLAS, cuBLASLt) and replayed; the faster capture is
kept, and a batch may run a larger size that replays clearly faster (worker/graph_plan.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

import pagedllm.envs as envs
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import GroupCoordinator, get_tp_group
from pagedllm.distributed.pipeline import recv_stage_inputs, send_stage_outputs, stage_input_buffers
from pagedllm.models.utils import IntermediateTensors
from pagedllm.worker import graph_plan

if TYPE_CHECKING:
    from pagedllm.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)


# Graphs of this many rows and more start their attention programs longest context first
# (AttentionMetadata.decode_order): the longest programs then start in the first wave. At 64 rows
# (one wave of programs) it gained nothing, so smaller graphs skip the sort and its copy
# (measured per batch size: BENCHMARKS.md, "Measurements behind code decisions").
ORDER_MIN_BATCH = 128


_capture_stream: torch.cuda.Stream | None = None


@contextlib.contextmanager
def _capturing(g: torch.cuda.CUDAGraph, pool: object) -> Iterator[None]:
    """`torch.cuda.graph(g, pool=pool)` without the `torch.cuda.empty_cache()` and pinned-host cache
    release it runs before every capture: with ~50 captures at start (decode and mixed-step sizes),
    each would hand the eager pass's cached blocks back to the driver for the next pass to allocate
    again (PAGEDLLM_CAPTURE_EMPTY_CACHE=1 keeps torch's way). The same capture otherwise: a side
    stream of its own, torch's default (global) capture mode."""
    global _capture_stream
    if _capture_stream is None:
        _capture_stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(_capture_stream):
        g.capture_begin(*(() if pool is None else (pool,)))
        try:
            yield
        finally:
            g.capture_end()


def capture_forward(forward: Callable[[], torch.Tensor], device: torch.device, pool: object = None,
                    clock: dict[str, float] | None = None, eager: bool = True
                    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """forward() captured as a CUDA graph in `pool` (None: a new pool, then `graph.pool()`), with its
    output tensor. The static buffers forward reads must hold padding only (nothing is written).

    One eager pass first, so nothing initialises lazily inside the capture: Triton variants load (or
    compile), the BLAS library picks its algorithms for these shapes (a second pass costs a forward
    per size at every start). The first replay uploads the graph to the device, which would
    otherwise land on a serving step. A new pool (a runner's first capture) starts from emptied
    caches, as torch.cuda.graph does. clock: seconds added up per part ("eager" pass and its sync,
    "capture", first "replay"), for the start-up log. eager=False: no eager pass, for a forward whose
    Triton variants and BLAS library an earlier eager pass of the same start met already."""
    empty_each = envs.PAGEDLLM_CAPTURE_EMPTY_CACHE
    t0 = time.monotonic()
    if pool is None and not empty_each:
        torch.cuda.empty_cache()
    if eager:
        forward()
    torch.cuda.synchronize(device)
    t1 = time.monotonic()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool) if empty_each else _capturing(g, pool):
        out = forward()
    t2 = time.monotonic()
    g.replay()
    if clock is not None:
        for part, seconds in (("eager", t1 - t0), ("capture", t2 - t1), ("replay", time.monotonic() - t2)):
            clock[part] = clock.get(part, 0.0) + seconds
    return g, out


def describe_clock(clock: dict[str, float]) -> str:
    """' (eager passes 0.41 s, captures 0.90 s, first replays 0.20 s)' for a capture's log line."""
    names = {"eager": "eager passes", "capture": "captures", "replay": "first replays"}
    return " (" + ", ".join(f"{names[k]} {v:.2f} s" for k, v in clock.items()) + ")" if clock else ""


class CudaGraphRunner:
    """capture_sizes: vLLM's cudagraph_capture_sizes, resolved in config.py (default 1, 2, 4, 8, ...,
    max_num_seqs); num_kv_heads decides which sizes attend alike (split-K or not); tuning: capture
    with both BLAS libraries and plan padding from replay times (PAGEDLLM_GRAPH_TUNING)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, capture_sizes: tuple[int, ...],
                 max_model_len: int, block_size: int, num_kv_heads: int, tuning: bool = True,
                 pp: GroupCoordinator | None = None) -> None:
        self.model = model
        self.pp = pp if pp is not None and pp.world_size > 1 else None  # None: the only stage
        self.tuning = tuning
        self.device = device
        self.num_kv_heads = num_kv_heads
        self.sizes = list(capture_sizes)
        self.max_bs = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.max_seq_len = max_model_len
        b, dev = self.max_bs, self.device
        # Device buffers every graph reads; host twins are pinned so copies are truly async.
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros((b, self.max_blocks), dtype=torch.int32, device=dev)
        self.decode_order = torch.arange(b, dtype=torch.int32, device=dev)  # longest context first
        # A later pipeline stage's inputs: the previous stage's rows land here before each replay.
        self.intermediate: IntermediateTensors | None = None
        if self.pp is not None and not self.pp.is_first_rank:
            hidden, residual = stage_input_buffers(model, b, dev)
            self.intermediate = IntermediateTensors({"hidden_states": hidden.zero_(), "residual": residual.zero_()})
        # Two sets of host buffers, used by alternate steps: with async scheduling the copies of
        # step N may still be queued while step N+1 is prepared, but step N-1's are done.
        self.h_tokens = torch.zeros((2, 3, b), dtype=torch.int64).pin_memory()  # ids, positions, slots
        self.h_seq_lens = torch.ones((2, b), dtype=torch.int32).pin_memory()
        self.h_order = torch.zeros((2, b), dtype=torch.int32).pin_memory()
        self.h_block_table = torch.zeros((2, b, self.max_blocks), dtype=torch.int32).pin_memory()
        self.parity = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replay_ms: dict[int, float] = {}  # per kept graph, dummy rows
        self.backends: dict[int, str] = {}  # BLAS library each kept graph was captured with
        self.dispatch: list[int] = []  # dispatch[n]: the size that runs a batch of n rows
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
            decode_order=self.decode_order[:bs] if bs >= ORDER_MIN_BATCH else None,
        )

    def _stage_inputs(self, bs: int) -> tuple:
        """The model's inputs for `bs` rows: ids, positions and, on a later pipeline stage, the
        static activation buffers."""
        if self.intermediate is None:
            return self.input_ids[:bs], self.positions[:bs]
        rows = IntermediateTensors({k: v[:bs] for k, v in self.intermediate.tensors.items()})
        return self.input_ids[:bs], self.positions[:bs], rows

    def _capture_one(self, bs: int, md: AttentionMetadata, clock: dict[str, float] | None = None,
                     eager: bool = True) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, pos, *rows = self._stage_inputs(bs)
        g, out = capture_forward(lambda: self.model(ids, pos, md, *rows), self.device, self.pool, clock, eager)
        if self.pool is None:
            self.pool = g.pool()
        return g, out

    def _plan_key(self) -> list[object]:
        """What the replay times depend on (graph_plan.plan_path): the GPU, the libraries' versions,
        the model's parameter shapes and dtypes, the sizes and the graphs' maximum length."""
        import pagedllm
        from pagedllm.envs import kernel_switches

        params = [(name, tuple(p.shape), str(p.dtype)) for name, p in self.model.named_parameters()]
        return [torch.cuda.get_device_name(self.device), torch.__version__, torch.version.cuda,
                getattr(pagedllm, "__version__", ""), kernel_switches(), params, self.sizes, self.max_seq_len,
                self.max_blocks, self.num_kv_heads]

    def variant_sizes(self) -> list[int]:
        """One capture size per way the sizes can differ to Triton: it specialises an integer
        argument on == 1 and on divisibility by 16, so a kernel argument k * bs (+ 1) depends on
        bs's low bits; beyond those, on whether the graph orders its programs and how it splits
        and tiles attention. Default sizes 1, 2, 4, 8, 16, 24, ..., 256 -> 1, 2, 4, 8, 16, 24 and
        the first sizes past each attention-kind and ordering boundary."""
        picked: dict[tuple, int] = {}
        for bs in self.sizes:
            picked.setdefault(self._variant_key(bs), bs)
        return sorted(picked.values())

    def _variant_key(self, bs: int) -> tuple:
        """What a batch size is to Triton's specialisation and the attention's choices (variant_sizes)."""
        from pagedllm.kernels.split_k import decode_kind  # Triton: GPU path only

        splits, few = decode_kind(bs, self.num_kv_heads, self.max_seq_len)
        return (bs == 1, tuple(bs % m == 0 for m in (2, 4, 8, 16)), (bs + 1) % 16 == 0, bs >= ORDER_MIN_BATCH,
                splits > 1, few)

    @torch.inference_mode()
    def dry_run(self) -> None:
        """One eager forward pass per `variant_sizes` size, as the capture runs them
        (worker/precompile.py collects the Triton variants they launch)."""
        for bs in reversed(self.variant_sizes()):
            self.model(self.input_ids[:bs], self.positions[:bs], self._metadata(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        default = torch.backends.cuda.preferred_blas_library()
        default_name = default.name.lower()
        # name -> value for torch.backends.cuda.preferred_blas_library; the default first.
        candidates: dict[str, object] = {default_name: default}
        if self.tuning and torch.version.cuda is not None:
            candidates.update((lib, lib) for lib in ("cublas", "cublaslt") if lib != default_name)
        plan_file = graph_plan.plan_path(self._plan_key()) if len(candidates) > 1 else None
        kept = graph_plan.load_plan(plan_file, self.sizes, list(candidates)) if plan_file else None
        captured: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        clock: dict[str, float] = {}
        # An eager pass only for the first size of each Triton variant and library (what it initialises
        # is then loaded for the others).
        met: set[tuple] = set()
        try:
            # Largest first, so smaller graphs reuse the big one's memory pool.
            for bs in reversed(self.sizes):
                md = self._metadata(bs)
                for lib, value in candidates.items():
                    if kept is not None and kept[bs][0] != lib:
                        continue  # a kept plan: the library it chose for this size only
                    torch.backends.cuda.preferred_blas_library(value)
                    key = (self._variant_key(bs), lib)
                    captured[bs, lib] = self._capture_one(bs, md, clock, eager=key not in met)
                    met.add(key)
        finally:
            torch.backends.cuda.preferred_blas_library(default)
        torch.cuda.synchronize(self.device)
        times = {}
        if len(candidates) > 1:
            times = ({(bs, lib): ms for bs, (lib, ms) in kept.items()} if kept is not None else
                     graph_plan.time_replays({key: g for key, (g, _) in captured.items()}))
        for bs in self.sizes:
            lib = default_name
            if kept is not None:
                lib = kept[bs][0]
            elif times:
                lib = graph_plan.pick_backend({k: times[bs, k] for k in candidates}, default_name)
            self.graphs[bs], self.outputs[bs] = captured.pop((bs, lib))
            self.replay_ms[bs] = times.get((bs, lib), 0.0)
            self.backends[bs] = lib
        del captured  # the other libraries' graphs
        if plan_file is not None and kept is None:
            graph_plan.save_plan(plan_file, {bs: (self.backends[bs], self.replay_ms[bs]) for bs in self.sizes})
        # A batch may pad up to a larger graph only where both attend the same way: with split-K (or
        # the key tile) differing, dummy-row replay times say nothing about real contexts.
        from pagedllm.kernels.split_k import decode_kind  # Triton: GPU path only (CPU installs lack it)

        attention_kind = {bs: decode_kind(bs, self.num_kv_heads, self.max_seq_len) for bs in self.sizes}
        # Untimed (one library), every replay_ms is 0.0: each batch keeps the smallest size that fits.
        self.dispatch = graph_plan.plan_dispatch(self.replay_ms, groups=attention_kind)
        tp = get_tp_group()
        if tp.world_size > 1:
            # The TP ranks' all-reduces are inside the graphs: every rank must replay the same size
            # for a batch, and each timed its own replays. TP rank 0's plan for all of them.
            plan = torch.tensor(self.dispatch, dtype=torch.int64, device=self.device)
            self.dispatch = tp.broadcast(plan, src=0).tolist()
        logger.info("captured %d CUDA graphs (batch sizes %s..%s) in %.1f s%s%s", len(self.sizes), self.sizes[0],
                    self.sizes[-1], time.monotonic() - t0, f" (plan kept in {plan_file})" if kept else "",
                    describe_clock(clock))
        if times:
            others = [bs for bs in self.sizes if self.backends[bs] != default_name]
            logger.info("decode graphs: %s for sizes %s (else %s); padded up: %s",
                        "/".join(c for c in candidates if c != default_name), others or "none", default_name,
                        graph_plan.describe(self.dispatch, self.sizes) or "none")
            logger.debug("decode graph replay ms (dummy rows): %s",
                         {f"{bs}/{lib}": round(t, 3) for (bs, lib), t in sorted(times.items())})

    def can_run(self, inp: StepInputs) -> bool:
        num_reqs = len(inp.req_ids)
        return (
            0 < num_reqs <= self.max_bs
            and int(inp.query_start_loc[-1]) == num_reqs  # decode only: one token each
            and inp.block_table.shape[1] <= self.max_blocks
        )

    def run(self, inp: StepInputs, fill_pending: Callable[[torch.Tensor, StepInputs], None]) -> torch.Tensor | None:
        """Hidden states (num_reqs, hidden) of a decode-only step; None on a pipeline stage before
        the last (its rows went to the next stage)."""
        n = len(inp.req_ids)
        bs = self.dispatch[n]
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
        if bs >= ORDER_MIN_BATCH:
            h_order = self.h_order[self.parity, :bs]
            h_order.numpy()[:] = np.argsort(-seq[:bs], kind="stable")  # padding rows (seq_len 1) last
            self.decode_order[:bs].copy_(h_order, non_blocking=True)
        self.block_table[:bs, :width].copy_(h_table[:bs, :width], non_blocking=True)
        if self.intermediate is not None:
            assert self.pp is not None
            # Rows [n, bs) keep whatever an earlier step left: padding, whose output is dropped.
            recv_stage_inputs(self.pp, self.intermediate["hidden_states"][:n], self.intermediate["residual"][:n])
        self.graphs[bs].replay()
        out = self.outputs[bs]
        if self.pp is not None and not self.pp.is_last_rank:
            send_stage_outputs(self.pp, out, n)
            return None
        return out[:n]
