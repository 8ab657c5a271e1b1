"""One rank's side of a multi-worker executor, shared by the multiprocess and the Ray executors.

`RankWorker` wraps the seam's `Worker` with what a rank outside the engine's process needs: joining
the torch.distributed world and the TP / PP groups before the model is built, answering the
executor's start-up calls, and running steps from encoded `SchedulerOutput`s.

What travels per step, both ways, is msgpack (msgspec), never pickle:

    driver -> every rank   encode_step(SchedulerOutput)           once per step, the same bytes
    driver -> every rank   encode_grammar(GrammarOutput)          steps with constrained rows: the
                           bitmask, which the last stage's ranks apply before sampling
    output rank -> driver  encode_output(ModelRunnerOutput)       the last PP stage's first TP rank

Every rank runs every step (each keeps its own copy of the request state); only the output rank's
result is read. Start-up calls ("init_device", "load_model", ...) answer from every rank.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any

import msgspec
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.structured_output.bitmask import GrammarOutput

logger = logging.getLogger(__name__)

_step_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)


def encode_step(so: SchedulerOutput) -> bytes:
    return _step_encoder.encode(so)


def decode_step(data: bytes) -> SchedulerOutput:
    return _step_decoder.decode(data)


def encode_output(out: ModelRunnerOutput) -> bytes:
    return _step_encoder.encode(out)


def decode_output(data: bytes) -> ModelRunnerOutput:
    return _output_decoder.decode(data)


def encode_grammar(go: GrammarOutput | None) -> bytes:
    """A step's grammar bitmask for the ranks that sample: the request ids, the int32 (k, W) words."""
    if go is None:
        return b""
    bm = go.grammar_bitmask.to(torch.int32).contiguous()
    return _step_encoder.encode([go.structured_output_request_ids, list(bm.shape), bm.numpy().tobytes()])


def decode_grammar(data: bytes) -> GrammarOutput | None:
    if not data:
        return None
    ids, shape, words = msgspec.msgpack.decode(data)
    bitmask = torch.frombuffer(bytearray(words), dtype=torch.int32).reshape(shape)
    return GrammarOutput(ids, bitmask)


def output_rank(tp_size: int, pp_size: int) -> int:
    """World rank whose step output the driver reads: the last stage's first TP rank.
    tp 2, pp 2 -> 2 (ranks [0, 1] are stage 0, [2, 3] stage 1)."""
    return (pp_size - 1) * tp_size


def default_cpu_threads(config: EngineConfig, ranks_on_this_node: int) -> int | None:
    """Torch threads per rank on the CPU when the user set none: the node's cores shared evenly (two
    ranks each at every core would only fight over them). None on a GPU: torch's default."""
    if config.device_config.device != "cpu" or config.device_config.cpu_threads is not None:
        return config.device_config.cpu_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(ranks_on_this_node, 1))


class RankWorker:
    """The Worker of world rank `rank`, with its place in the TP x PP groups."""

    # Start-up calls the executor may make, in this order (the Worker's own methods).
    CALLS = ("init_device", "load_model", "determine_num_available_blocks", "initialize_cache",
             "compile_or_warm_up_model", "check_health", "comm_bytes", "step_times")

    def __init__(self, config: EngineConfig, rank: int, local_rank: int, distributed_init_method: str,
                 ranks_on_this_node: int) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        pc = config.parallel_config
        self.is_output_rank = rank == output_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        threads = default_cpu_threads(config, ranks_on_this_node)
        if threads is not None:
            torch.set_num_threads(threads)
        self.worker: Any = None
        self.deferred = False  # a step waits for `sample` (its grammar bitmask)
        self._deferred_start = 0.0
        # (start, end) of this rank's newest steps, time.monotonic() (one clock for every process of
        # a node): whether pipeline stages overlap is read from them (tests, scripts/pp_overlap.py).
        self._step_times: deque[tuple[float, float]] = deque(maxlen=4096)

    def init_device(self) -> None:
        from pagedllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from pagedllm.worker.worker import Worker

        pc = self.config.parallel_config
        init_distributed_environment(pc.world_size, self.rank, self.local_rank, self.distributed_init_method,
                                     self.config.device_config.device)
        initialize_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        self.worker = Worker(self.config, self.rank, self.local_rank, self.distributed_init_method,
                             is_driver_worker=self.is_output_rank)
        self.worker.init_device()

    def call(self, method: str, args: list[Any]) -> Any:
        """Run start-up call `method` (one of CALLS) with `args`; its result must be msgpack-able."""
        if method not in self.CALLS:
            raise ValueError(f"unknown worker call {method!r}; known: {', '.join(self.CALLS)}")
        if method == "init_device":
            return self.init_device()
        if method == "comm_bytes":
            return self.comm_bytes(*args)
        if method == "step_times":
            return list(self._step_times)
        return getattr(self.worker, method)(*args)

    def execute(self, step: bytes) -> bytes | None:
        """Run one encoded step; the encoded output on the output rank, None elsewhere and when
        the step waits for its grammar bitmask (`sample`; the last stage's ranks, constrained rows).

        Every rank waits for its own step's samples (`get()`): the runner takes them into its
        request state at the next step, and a rank that did not would fall behind.
        """
        t0 = time.monotonic()
        so = decode_step(step)
        pending = self.worker.execute_model(so)
        if pending is None:
            self.deferred, self._deferred_start = True, t0
            return None
        out = pending.get()
        self._step_times.append((t0, time.monotonic()))
        return encode_output(out) if self.is_output_rank else None

    def sample(self, grammar: bytes) -> bytes | None:
        """Sample the deferred step under the encoded bitmask (every TP rank of the last stage
        masks and samples alike, so they draw the same token); the output on the output rank.
        Ranks of earlier stages deferred nothing: they ignore it."""
        if not self.deferred:
            return None
        self.deferred = False
        out = self.worker.sample_tokens(decode_grammar(grammar)).get()
        self._step_times.append((self._deferred_start, time.monotonic()))
        return encode_output(out) if self.is_output_rank else None

    def comm_bytes(self, reset: bool = False) -> dict[str, int]:
        """Bytes this rank has sent through its TP and PP groups (docs/DISTRIBUTED.md's measurement)."""
        from pagedllm.distributed.parallel_state import get_pp_group, get_tp_group, reset_bytes_sent

        counts = {"rank": self.rank, "tp": get_tp_group().bytes_sent, "pp": get_pp_group().bytes_sent}
        if reset:
            reset_bytes_sent()
        return counts

    def shutdown(self) -> None:
        from pagedllm.distributed.parallel_state import destroy_model_parallel

        if self.worker is not None:
            self.worker.shutdown()
        destroy_model_parallel()
