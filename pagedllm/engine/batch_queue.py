"""The engine core's batch queue for pipeline parallelism (vLLM's virtual engines / V1 batch queue).

With P pipeline stages one batch at a time leaves P - 1 stages idle: stage 0 finishes batch k and
waits while the later stages compute it. The core keeps up to P batches in flight instead:

    time ->   stage 0:  k   k+1 k+2 k+3             (launch order = finish order)
              stage 1:      k   k+1 k+2 k+3

Batch k+1 holds other requests than k (a request whose sampled token is still in the pipeline is
not scheduled: the stages before the last could not know its token), so the batches are
independent; outputs are applied in launch order. Each stage runs its batches in order, so KV
blocks written by batch k (a prefill chunk, a prefix another request hits) are written before
batch k+1 reads them at that stage, and a block freed while k is in flight is reused only by
later batches, which reach every stage after k has left it.
"""

from __future__ import annotations

from collections import Counter, deque

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.executor.abstract import ModelRunnerOutputHandle


class BatchQueue:
    """Launched batches, oldest first, at most `size` (pipeline_parallel_size)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a batch queue holds at least one batch, got size {size}.")
        self.size = size
        self._batches: deque[tuple[SchedulerOutput, ModelRunnerOutputHandle]] = deque()
        # How many launches found the queue at each depth once pushed (the measure of overlap:
        # depth 2 means two batches were in the pipeline at once). {1: 10, 2: 54}
        self.depth_counts: Counter[int] = Counter()

    @property
    def full(self) -> bool:
        return len(self._batches) >= self.size

    def __len__(self) -> int:
        return len(self._batches)

    def push(self, so: SchedulerOutput, handle: ModelRunnerOutputHandle) -> None:
        assert not self.full, "the batch queue is full"
        self._batches.append((so, handle))
        self.depth_counts[len(self._batches)] += 1

    def pop(self) -> tuple[SchedulerOutput, ModelRunnerOutputHandle]:
        """The oldest batch: the next to finish."""
        return self._batches.popleft()
