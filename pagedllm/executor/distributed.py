"""What the two multi-rank executors share: multiproc.py (worker processes) and ray_executor.py
(Ray actors). Both run every rank through RankWorker (rank_worker.py) and differ only in how bytes
reach the ranks and come back, so the rest is written once here:

    start-up   determine_num_available_blocks / initialize_cache / compile_or_warm_up_model: one
               collective_rpc each, one answer per rank (the block count: the minimum, in Executor)
    a step     execute_model: the SchedulerOutput encoded once and sent to every rank ("step");
               a step with constrained rows returns None and is answered by its sample_tokens
               ("sample": the grammar bitmask encoded once), which the last stage's ranks apply
    failure    WorkerDiedError; once the executor is dead every call raises at once

A subclass implements `collective_rpc` and `_send(kind, payload, answered)`: deliver the same
`payload` to every rank's `kind` call ("step" -> RankWorker.execute, "sample" -> RankWorker.sample)
without waiting for it, and when `answered` return the handle whose get() is the output rank's
answer. Sends are in order and each rank runs them in order, so a handle may be read late: with
pipeline parallelism the engine core launches the next step first (engine/batch_queue.py).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import pagedllm.envs as envs
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.executor.abstract import Executor, ModelRunnerOutputHandle
from pagedllm.executor.rank_worker import encode_grammar, encode_step, output_rank
from pagedllm.structured_output.bitmask import GrammarOutput

# Seconds a start-up call (loading, profiling, warm-up) may take on the slowest rank.
STARTUP_TIMEOUT_S = 600.0


def execute_model_timeout_s() -> float:
    """PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S (default 300): a step's output may be this late before the
    ranks count as hung."""
    return float(envs.PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S)


class WorkerDiedError(RuntimeError):
    """A rank exited, failed a step, or stopped answering: the engine cannot go on."""


class DistributedExecutorBase(Executor):
    def _init_ranks(self) -> None:
        """The layout every multi-rank executor starts from; call first in _init_executor."""
        pc = self.config.parallel_config
        self.world_size = pc.world_size
        self.output_rank = output_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        self._dead: str | None = None

    # -- what a subclass implements ----------------------------------------------------------------
    @abstractmethod
    def collective_rpc(self, method: str, *args: Any, timeout: float = STARTUP_TIMEOUT_S) -> list[Any]:
        """Call RankWorker start-up call `method` on every rank; the results in rank order."""

    @abstractmethod
    def _send(self, kind: str, payload: bytes, answered: bool) -> ModelRunnerOutputHandle | None:
        """Hand `payload` to every rank's `kind` call ("step" | "sample"); the answer's handle when
        `answered` (else None: the output rank answers the step's "sample" instead)."""

    # -- written once ------------------------------------------------------------------------------
    def determine_num_available_blocks(self) -> list[tuple[int, int]]:
        return [tuple(x) for x in self.collective_rpc("determine_num_available_blocks")]

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.collective_rpc("initialize_cache", num_gpu_blocks, num_cpu_blocks)

    def compile_or_warm_up_model(self) -> None:
        self.collective_rpc("compile_or_warm_up_model")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutputHandle | None:
        """Send the step and return at once. None when it has constrained rows: the last stage's
        ranks wait for `sample_tokens`, whose handle answers for the step."""
        self._raise_if_dead()
        constrained = scheduler_output.has_structured_output_requests
        handle = self._send("step", encode_step(scheduler_output), answered=not constrained)
        return None if constrained else handle

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutputHandle:
        self._raise_if_dead()
        handle = self._send("sample", encode_grammar(grammar_output), answered=True)
        assert handle is not None
        return handle

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(f"the distributed executor is dead: {self._dead}")
