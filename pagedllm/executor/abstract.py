"""The Executor interface: the one seam between the engine core and its workers (vLLM's v1 shape).

    EngineCore --initialize()------------------> every worker: profile, size, allocate, warm up
               <-- KVCacheInfo (the minimum over workers)
               --execute_model(SchedulerOutput)-> every worker runs the step
               <-- a handle; .get() -> ModelRunnerOutput (from the driver worker)

The core calls nothing else on the worker side. `execute_model` returns as soon as the step is
launched, so the core can schedule the next step while this one runs (async scheduling); `.get()`
waits. A subclass decides where workers live:

    "uni"  UniProcExecutor (uniproc.py): one Worker in this process
    "mp"   one worker process per rank (multiproc.py): the driver broadcasts each SchedulerOutput
           once; the output comes back from the last pipeline stage's first tensor rank
    "ray"  Ray actors, one per rank (ray_executor.py)

"mp" and "ray" share their start-up calls and step plumbing (distributed.py); they differ only in
how bytes reach the ranks.

`initialize` is written once here on top of four per-worker calls a subclass implements for all
its workers at once (each returns one value per worker, in rank order, where it returns any).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from pagedllm.config import EngineConfig, ParallelConfig, is_executor_qualname
from pagedllm.core.kv_cache_manager import max_blocks_per_request
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.structured_output.bitmask import GrammarOutput


@dataclass(frozen=True)
class KVCacheInfo:
    """What start-up found (never written back into the frozen config): blocks on the device for
    every worker, CPU blocks for swap preemption (0 without it), and their size."""

    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int


class ModelRunnerOutputHandle(Protocol):
    """A launched step. `get()` waits for it; calling it again returns the same output, and reading
    it changes no worker state."""

    def get(self) -> ModelRunnerOutput: ...


# distributed_executor_backend -> (module, class). The "mp" and "ray" executors are built on their
# own branch; until their modules exist get_class says so.
_BACKENDS = {
    "uni": ("pagedllm.executor.uniproc", "UniProcExecutor"),
    "mp": ("pagedllm.executor.multiproc", "MultiprocExecutor"),
    "ray": ("pagedllm.executor.ray_executor", "RayDistributedExecutor"),
}


def _import_executor(qualname: str) -> type[Executor]:
    """The Executor subclass a fully qualified name points at, or a ValueError saying why not."""
    module_name, _, class_name = qualname.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"distributed_executor_backend={qualname!r} cannot be imported: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise ValueError(f"distributed_executor_backend={qualname!r} is not an Executor subclass.")
    return cls


class Executor(ABC):
    # The worker runs in this process and gets the engine core's SchedulerOutput object itself, so a
    # step can carry host memory the runner reads later (gated sampling: structured_output/gate.py).
    shares_scheduler_output = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @staticmethod
    def get_class(parallel_config: ParallelConfig) -> type[Executor]:
        backend = parallel_config.distributed_executor_backend or "uni"
        if is_executor_qualname(backend) and backend not in _BACKENDS:
            return _import_executor(backend)
        if backend not in _BACKENDS:
            raise ValueError(f"unknown distributed_executor_backend {backend!r}; choose one of {', '.join(_BACKENDS)}.")
        module_name, class_name = _BACKENDS[backend]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise  # the module exists but something it imports does not
            raise ValueError(
                f"distributed_executor_backend={backend!r} is not available in this build ({module_name} is "
                f"missing); only 'uni' (one worker, tensor_parallel_size=pipeline_parallel_size=1) is."
            ) from None
        return getattr(module, class_name)

    # -- what a subclass implements ----------------------------------------------------------------
    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers: device up and model loaded on each (Worker.init_device, load_model)."""

    @abstractmethod
    def determine_num_available_blocks(self) -> list[tuple[int, int]]:
        """(num_gpu_blocks, num_cpu_blocks) that fit, one pair per worker."""

    @abstractmethod
    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate (and bind) the same number of blocks on every worker."""

    @abstractmethod
    def compile_or_warm_up_model(self) -> None:
        """Warm up the kernels and capture CUDA graphs on every worker."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutputHandle:
        """Launch one step on every worker; the handle's get() returns the driver worker's output."""

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutputHandle:
        """Sample the step `execute_model` left unsampled (it returns None when the step has
        constrained requests), under the grammar bitmask (vLLM's split; structured_output/)."""
        raise NotImplementedError(f"{type(self).__name__} does not run constrained (structured output) requests.")

    @abstractmethod
    def check_health(self) -> None:
        """Raise if a worker is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free what they hold. Idempotent."""

    # -- written once ------------------------------------------------------------------------------
    def initialize(self) -> KVCacheInfo:
        """Profile every worker, take the minimum number of blocks, allocate, warm up, capture."""
        per_worker = self.determine_num_available_blocks()
        num_gpu_blocks = min(g for g, _ in per_worker)
        num_cpu_blocks = min(c for _, c in per_worker)
        bs = self.config.cache_config.block_size
        max_len = self.config.model_config.max_model_len
        # Behind a sliding window on every layer a request holds only its window's blocks (core/).
        needed = max_blocks_per_request(max_len, bs, self.config.model_config.kv_sliding_window,
                                        self.config.scheduler_config.max_num_batched_tokens)
        if num_gpu_blocks < needed:
            raise ValueError(
                f"The model's max_model_len ({max_len}) is larger than the {num_gpu_blocks * bs} tokens "
                f"({num_gpu_blocks} blocks of {bs}) that fit in the KV cache. Increase gpu_memory_utilization / "
                f"cpu_kvcache_space / num_gpu_blocks_override, or set max_model_len <= {num_gpu_blocks * bs}."
            )
        self.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        self.compile_or_warm_up_model()
        return KVCacheInfo(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, block_size=bs)
