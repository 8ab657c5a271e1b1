"""UniProcExecutor: one Worker in the engine core's own process (world size 1). Every call is a
direct method call; `execute_model` hands back the worker's PendingOutput as the handle."""

from __future__ import annotations

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.structured_output.bitmask import GrammarOutput
from pagedllm.worker.model_runner import PendingOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    shares_scheduler_output = True

    def _init_executor(self) -> None:
        if self.config.parallel_config.world_size != 1:
            raise ValueError(
                f"UniProcExecutor runs one worker; world size is {self.config.parallel_config.world_size}."
            )
        self.driver_worker = Worker(self.config, rank=0, local_rank=0, distributed_init_method=None)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def determine_num_available_blocks(self) -> list[tuple[int, int]]:
        return [self.driver_worker.determine_num_available_blocks()]

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.driver_worker.initialize_cache(num_gpu_blocks, num_cpu_blocks)

    def compile_or_warm_up_model(self) -> None:
        self.driver_worker.compile_or_warm_up_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingOutput | None:
        return self.driver_worker.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingOutput:
        return self.driver_worker.sample_tokens(grammar_output)

    def check_health(self) -> None:
        self.driver_worker.check_health()

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
