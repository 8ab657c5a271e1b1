"""The grammar side of EngineCore's step (structured outputs): requests held back while their grammar
compiles, the bitmask job and the sampling that waits for it (deferred to the next step, or gated on
the device: structured_output/gate.py), and a grammar backend that fails meanwhile.

A mixin of EngineCore (engine_core.py), whose state it reads and writes (declared below; set in
EngineCore.__init__). Methods rather than functions taking the core: the A/B scripts and tests put
their own `_step_gated` / `_sample_deferred` in place on the class or the instance, and a function
typed with EngineCore would import engine_core back (a cycle, TYPE_CHECKING or not).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.request import RequestStatus
from pagedllm.structured_output.backend_types import GrammarBackendError
from pagedllm.structured_output.manager import BitmaskJob

if TYPE_CHECKING:
    from pagedllm.core.sched_output import SchedulerOutput
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.executor.abstract import Executor, ModelRunnerOutputHandle
    from pagedllm.request import Request
    from pagedllm.structured_output.bitmask import GrammarOutput
    from pagedllm.structured_output.gate import GrammarGate
    from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class GrammarStepMixin:
    # EngineCore's state used here (EngineCore.__init__ says what each holds).
    scheduler: Scheduler
    model_executor: Executor
    structured_output_manager: StructuredOutputManager
    step_count: int
    inflight: tuple[SchedulerOutput, ModelRunnerOutputHandle] | None
    deferred_sample: tuple[SchedulerOutput, BitmaskJob] | None
    waiting_for_grammar: dict[str, Request]
    _grammar_aborted: dict[str, EngineCoreOutput]
    _collect_inflight: Callable[[], list[EngineCoreOutput]]

    def _release_compiled(self) -> list[EngineCoreOutput]:
        """Hand requests whose grammar finished compiling to the scheduler (a failed compile, which
        the frontend's check makes unexpected, finishes its request as aborted)."""
        outputs: list[EngineCoreOutput] = []
        manager = self.structured_output_manager
        for rid, req in list(self.waiting_for_grammar.items()):
            sor = manager.requests[rid]
            if not sor.ready:
                continue
            del self.waiting_for_grammar[rid]
            if sor.future.exception() is not None:
                logger.error("request %s: grammar compilation failed: %s", rid, sor.future.exception())
                manager.remove([rid])
                outputs.append(EngineCoreOutput(rid, [], finish_reason="abort"))
                continue
            self.scheduler.add_request(req)
        return outputs

    def _wait_for_a_grammar(self) -> None:
        """Nothing to run but grammars compiling: sleep until one is done instead of spinning."""
        futures = [self.structured_output_manager.requests[r].future for r in self.waiting_for_grammar]
        concurrent.futures.wait(futures, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)

    def _grammar_job(self, so: SchedulerOutput) -> BitmaskJob:
        """manager.submit_grammar_bitmask; a failed grammar backend: no job (the step samples unmasked,
        its constrained rows aborted)."""
        try:
            return self.structured_output_manager.submit_grammar_bitmask(so)
        except GrammarBackendError as e:
            self._grammar_failed(e)
            return BitmaskJob(None, None)

    def _grammar_result(self, job: BitmaskJob | None, so: SchedulerOutput | None = None) -> GrammarOutput | None:
        """The job's bitmask (or, with `so`, the step's bitmask computed now); None when the grammar
        backend failed meanwhile (_grammar_failed: the constrained rows are aborted, their tokens dropped)."""
        try:
            return job.result() if job is not None else self.structured_output_manager.grammar_bitmask(so)
        except GrammarBackendError as e:
            self._grammar_failed(e)
            return None

    def _sample_deferred(self) -> None:
        """Sample the step whose bitmask job ran since the last step; it becomes the step in flight."""
        assert self.deferred_sample is not None and self.inflight is None
        so, job = self.deferred_sample
        self.deferred_sample = None
        self.inflight = (so, self.model_executor.sample_tokens(self._grammar_result(job)))

    def _step_gated(self, so: SchedulerOutput, gate: GrammarGate) -> list[EngineCoreOutput]:
        """Launch the forward of a gated step, collect the step in flight (its tokens advance the
        grammars), submit the bitmask job, whose filler opens the gate, and only then launch the
        step's sampling, which waits on the device for the gate:

            step k:  schedule k | launch forward k | collect k-1 | submit fill k | launch gate k + sample k | return
            filler:                                              [accept k-1, fill k] -> open k
            device:  ... forward k | (waits for gate k) | sample k | forward k+1 ...

        Why the job goes before the wait (gate.py says more): once the wait is queued, a host call
        that synchronizes the device (a kernel's first load, a cudaMalloc...) waits for the gate; with
        the job not yet posted it would wait for a fill that this thread posts only after it: the
        device and the host each waiting for the other, for good. Queued after the post, such a call
        waits only for the fill. The gate is opened whatever fails here (manager.submit_gate too),
        never left shut."""
        so.grammar_gate = gate
        outputs: list[EngineCoreOutput] = []
        try:
            pending = self.model_executor.execute_model(so)  # None: its sampling waits for the call below
            self.step_count += 1
            if self.inflight is not None:
                outputs = self._collect_inflight()
        except BaseException:
            gate.open()
            raise
        try:
            self.structured_output_manager.submit_gate(gate)  # (opens the gate itself if it fails)
        except GrammarBackendError as e:
            self._grammar_failed(e)
        if pending is None:
            pending = self.model_executor.sample_tokens(gate)
        self.inflight = (so, pending)
        return outputs

    def _grammar_failed(self, error: BaseException) -> None:
        """manager.fail_over, and the constrained requests finished as aborted (returned by `step`)."""
        logger.error("structured outputs: %s; the constrained requests in flight are aborted, later ones use "
                     "the in-process bitmask thread", error)
        ids = self.structured_output_manager.fail_over()
        for rid in ids:
            self.waiting_for_grammar.pop(rid, None)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self._grammar_aborted[rid] = EngineCoreOutput(rid, [], finish_reason="abort")
