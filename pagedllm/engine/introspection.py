"""A read-only view of the scheduler under vLLM V0's attribute names, for monitoring code.

Code written for vLLM reads the engine's state directly (seed article §3.3 / §7.2):

    engine = llm.llm_engine
    len(engine.scheduler.running), len(engine.scheduler.waiting), engine.scheduler.max_num_seqs
    engine.cache_config.gpu_memory_utilization

`LLMEngine.scheduler` returns this view: a snapshot of the queues at each read (tuples, so
monitoring code cannot reorder the scheduler's own deque) and the limits from SchedulerConfig.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class SchedulerView:
    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    @property
    def running(self) -> Sequence[Any]:
        return tuple(self._scheduler.running)

    @property
    def waiting(self) -> Sequence[Any]:
        return tuple(self._scheduler.waiting)

    @property
    def swapped(self) -> Sequence[Any]:
        # V0 kept swapped-out requests in their own queue; here a swapped request waits in `waiting`.
        return ()

    @property
    def max_num_seqs(self) -> int:
        return self._scheduler.config.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self._scheduler.config.max_num_batched_tokens

    @property
    def max_model_len(self) -> int:
        return self._scheduler.config.max_model_len

    @property
    def num_preemptions(self) -> int:
        return self._scheduler.num_preemptions

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self._scheduler.running) + len(self._scheduler.waiting)

    def get_num_unfinished_requests(self) -> int:
        return self._scheduler.get_num_unfinished_requests()

    def get_kv_cache_usage(self) -> float:
        return self._scheduler.make_stats().kv_cache_usage
