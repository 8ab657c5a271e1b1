"""EngineCore: schedule -> execute -> update, the one step loop. No sockets, no asyncio, no text.

The frontends (LLMEngine for `LLM`, AsyncLLM for the server) own tokenization, detokenization and
stop strings; the core sees token ids only. It reaches the model only through its Executor
(pagedllm/executor/): `initialize()` at start, `execute_model()` each step. The grammar side of the
step (structured outputs: requests whose grammar compiles, the bitmask job, deferred and gated
sampling) is grammar_step.py's mixin.
"""

from __future__ import annotations

import logging
import time

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler, SchedulerStats
from pagedllm.engine.batch_queue import BatchQueue
from pagedllm.engine.gc_heap import freeze_gc_heap
from pagedllm.engine.grammar_step import GrammarStepMixin
from pagedllm.executor.abstract import Executor, ModelRunnerOutputHandle
from pagedllm.request import Request, RequestStatus
from pagedllm.structured_output.backend_types import GrammarBackendError
from pagedllm.structured_output.manager import BitmaskJob, StructuredOutputManager
from pagedllm.structured_output.sample_check import conflicting_masks

logger = logging.getLogger(__name__)


class EngineCore(GrammarStepMixin):
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        t0 = time.monotonic()
        if executor_class is None:
            executor_class = Executor.get_class(config.parallel_config)
        self.model_executor = executor_class(config)
        try:
            kv = self.model_executor.initialize()
        except BaseException:
            # A cache that does not fit, a failed warm-up: the executor's worker processes or Ray
            # actors are stopped now, not when the garbage collector finds the executor.
            self.model_executor.shutdown()
            raise
        self.num_gpu_blocks = kv.num_gpu_blocks
        # Pipeline parallel: up to pipeline_parallel_size batches in flight, one per stage (vLLM's
        # max_concurrent_batches / batch queue); engine/batch_queue.py.
        pp = config.parallel_config.pipeline_parallel_size
        self.batch_queue = BatchQueue(pp) if pp > 1 else None
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, kv.num_gpu_blocks, config.preemption_mode,
            kv.num_cpu_blocks, pipeline_parallel_size=pp, sliding_window=config.model_config.kv_sliding_window,
        )
        if self.scheduler.kv_cache_manager.sliding_window is not None:
            logger.info("every attention layer has a sliding window (%d tokens): KV blocks behind it are freed "
                        "during a request", self.scheduler.kv_cache_manager.sliding_window)
        elif getattr(config.model_config.hf_config, "sliding_window", None):
            logger.info("layers mix sliding-window and global attention (or use_sliding_window is off): every KV "
                        "block of a request is kept (the global layers read them all)")
        self.step_count = 0
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.inflight: tuple[SchedulerOutput, ModelRunnerOutputHandle] | None = None
        # Async scheduling, constrained rows: a launched step whose bitmask is being filled on the
        # structured-output manager's thread; the next step() samples it first.
        self.deferred_sample: tuple[SchedulerOutput, BitmaskJob] | None = None
        # Async scheduling, constrained rows: submit the bitmask job before this step's launch (its
        # fill then overlaps the launch too; the step in flight is collected first) or after it.
        self.submit_before_launch = False
        # Async scheduling, constrained rows whose grammars are active: the step samples with its
        # launch and the device waits for the bitmask (structured_output/gate.py); needs the runner
        # in this process (it reads the gate's host memory). PAGEDLLM_GRAMMAR_GATE unset: on for CUDA, where
        # it was as fast as the ungated path or faster in every measured pair (BENCHMARKS.md, issue 22,
        # fifteenth session); off on the CPU, where the model and the fillers share the few cores.
        gate_choice = envs.PAGEDLLM_GRAMMAR_GATE
        if gate_choice is None:
            gate_choice = config.device_config.device == "cuda"
        self.gate_sampling = (self.async_scheduling and self.batch_queue is None
                              and self.model_executor.shares_scheduler_output and gate_choice)
        self.structured_output_manager = StructuredOutputManager(config)
        # Constrained requests whose grammar is still compiling: they reach the scheduler when it is.
        self.waiting_for_grammar: dict[str, Request] = {}
        self._grammar_aborted: dict[str, EngineCoreOutput] = {}  # _grammar_failed's, returned by step()
        freeze_gc_heap()
        logger.info(
            "engine ready in %.1f s: %d KV blocks of %d tokens (%d tokens), %s on %s",
            time.monotonic() - t0, kv.num_gpu_blocks, kv.block_size, kv.num_gpu_blocks * kv.block_size,
            config.model_config.dtype, config.device_config.device,
        )

    def add_request(self, request: Request) -> None:
        """Validate and queue; raises ValueError (nothing queued) when the request can never run."""
        if request.sampling_params.structured_outputs is not None:
            # The grammar lives here; every executor's sample_tokens takes the bitmask to the
            # ranks that sample (with several ranks: every TP rank of the last stage).
            self.structured_output_manager.add_request(request)
            self.waiting_for_grammar[request.request_id] = request
            return
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.waiting_for_grammar.pop(rid, None)
        self.structured_output_manager.remove(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, stops: dict[str, str]) -> None:
        """Finish requests whose text hit a stop string (found by the frontend's detokenizer)."""
        for req_id, stop_str in stops.items():
            self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_STOPPED, stop_reason=stop_str)
        self.structured_output_manager.remove(stops)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch one step; return the outputs of the step that just completed (see
        `_step`). When the grammar workers fail during it (GrammarBackendError), the constrained
        requests are finished as aborted, their tokens of this step left out (a bitmask may have been
        left unfilled), and later constrained requests run on the in-process bitmask thread."""
        outputs = self._step()
        if self.structured_output_manager.refused_ids:
            # A grammar refused a token it was fed (never expected: sample_check.py catches the rows
            # that other masks left without a token before their token is emitted): ended with an error
            # rather than run on unconstrained; this step's tokens of theirs are left out.
            for rid in self.structured_output_manager.take_refused():
                self._grammar_aborted[rid] = self._end_with_error(
                    rid, "structured outputs: the request's grammar refused a sampled token; the request was ended")
        if self._grammar_aborted:
            aborted, self._grammar_aborted = self._grammar_aborted, {}
            outputs = [o for o in outputs if o.request_id not in aborted] + list(aborted.values())
        return outputs

    def _end_with_error(self, rid: str, message: str) -> EngineCoreOutput:
        """Finish a request with finish_reason "error" and `message` (its blocks freed, its grammar
        dropped); the frontends turn it into an error for the client (a 400, or a stream's error event)."""
        self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR)
        self.structured_output_manager.remove([rid])
        return EngineCoreOutput(rid, [], finish_reason="error", stop_reason=message)

    def _update_from_output(self, so: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """scheduler.update_from_output, and the grammars advanced by its tokens. A constrained row whose
        token its bitmask forbids (its other masks left no token the grammar allows: sample_check.py)
        ends its request with an error first, so the scheduler drops that token: it is never emitted."""
        manager = self.structured_output_manager
        refused = manager.refused_samples(so, result)
        ended = []
        for rid, token in refused.items():
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            ended.append(self._end_with_error(rid, (
                f"structured outputs: the request's grammar and its {conflicting_masks(req.sampling_params)} "
                f"leave no token to sample at output token {req.num_output_tokens + 1}; the request was ended "
                f"there (the sampler's token {token} breaks the grammar and was dropped)")))
        outputs = self.scheduler.update_from_output(so, result)
        manager.advance(outputs)  # the one place grammars advance
        return outputs + ended if ended else outputs

    def _step(self) -> list[EngineCoreOutput]:
        """Schedule and launch one step; return the outputs of the step that just completed.

        Synchronous: that is this step. With async scheduling the previous step's results are
        collected after this step is launched, so the host prepares step N+1 while the device
        runs step N. A batch whose sampling reads past outputs (penalties, min_tokens) first
        collects the step in flight, so the runner holds every token. A batch with constrained
        rows (structured outputs) launches its forward pass, then collects the step in flight (its
        tokens advance the grammars) and has the bitmask filled; with async scheduling on the
        manager's thread, and the next step() samples it once it has scheduled (the host's
        scheduling and the caller's output processing overlap the fill), else at once.

            step k:   schedule k | sample k-1 | launch forward k | collect k-1 | advance, submit fill k | return
            thread:                                                                       [fill k ........]
            step k+1: schedule k+1 | sample k (waits for the fill) | launch forward k+1 | ...
        """
        if self.batch_queue is not None:
            return self.step_with_batch_queue(self.batch_queue)
        outputs: list[EngineCoreOutput] = []
        if self.waiting_for_grammar:
            outputs += self._release_compiled()
        so = self.scheduler.schedule() if self.scheduler.has_unfinished_requests() else None
        if so is not None and so.is_empty:
            so = None
        if self.deferred_sample is not None:
            self._sample_deferred()  # before anything is collected or launched
        if self.inflight is not None and (so is None or not self.async_scheduling or so.needs_output_history):
            outputs += self._collect_inflight()
        if so is None and self.waiting_for_grammar and self.inflight is None:
            self._wait_for_a_grammar()
        if so is not None:
            manager = self.structured_output_manager
            if self.gate_sampling and not self.submit_before_launch and manager.requests:
                gate = manager.gate_step(so)
                if gate is not None:
                    return outputs + self._step_gated(so, gate)
            so.has_structured_output_requests = bool(manager.sampling_request_ids(so))
            job = None
            if self.submit_before_launch and so.has_structured_output_requests and self.async_scheduling:
                # The bitmask job first, so that its fill also runs beside this step's launch (the
                # step in flight is read first: its last kernels were queued just above).
                if self.inflight is not None:
                    outputs += self._collect_inflight()
                job = self._grammar_job(so)
            pending = self.model_executor.execute_model(so)
            self.step_count += 1
            if self.inflight is not None:
                # Constrained rows need the tokens of the step in flight for their bitmask; the
                # device runs this step's forward meanwhile.
                outputs += self._collect_inflight()
            if pending is None and self.async_scheduling:
                # The bitmask job runs on the manager's thread while this thread returns the
                # outputs and schedules the next step; that step's start samples this one.
                self.deferred_sample = (so, job if job is not None else self._grammar_job(so))
                return outputs
            if job is not None:
                self._grammar_result(job)  # an executor that sampled anyway: the job's grammars are free again
            if pending is None:
                pending = self.model_executor.sample_tokens(self._grammar_result(None, so))
            self.inflight = (so, pending)
            if not self.async_scheduling:
                outputs += self._collect_inflight()
        return outputs

    def step_with_batch_queue(self, queue: BatchQueue) -> list[EngineCoreOutput]:
        """Pipeline parallel (vLLM's step_with_batch_queue): launch a new batch while the queue
        has room and the scheduler finds work; return at once while the pipeline fills; otherwise
        wait for the oldest batch and apply its output (batches finish in launch order).

        The scheduler leaves out requests whose token is in flight (Scheduler.use_pp), so the
        batches in flight are disjoint in their sampling requests, and a constrained request's
        grammar is current when its batch is launched: its bitmask is filled right away.
        """
        outputs: list[EngineCoreOutput] = []
        if self.waiting_for_grammar:
            outputs += self._release_compiled()
        launched = False
        if not queue.full and self.scheduler.has_unfinished_requests():
            so = self.scheduler.schedule()
            if not so.is_empty:
                manager = self.structured_output_manager
                so.has_structured_output_requests = bool(manager.sampling_request_ids(so))
                pending = self.model_executor.execute_model(so)
                if pending is None:
                    pending = self.model_executor.sample_tokens(self._grammar_result(None, so))
                queue.push(so, pending)
                self.step_count += 1
                launched = True
        if launched and not queue.full:
            return outputs  # filling the pipeline comes before reading outputs
        if queue:
            so, pending = queue.pop()
            outputs += self._update_from_output(so, pending.get())
        elif self.waiting_for_grammar:
            self._wait_for_a_grammar()
        return outputs

    def _collect_inflight(self) -> list[EngineCoreOutput]:
        assert self.inflight is not None
        so, pending = self.inflight
        self.inflight = None
        result = pending.get()
        gate = so.grammar_gate
        if gate is not None and (why := self.structured_output_manager.gate_forced(gate)) is not None:
            # A watchdog opened this step's gate before its rows were filled (gate.py): its constrained
            # rows sampled under a stale bitmask. Their requests are aborted before the scheduler takes
            # the step's tokens (it drops those of finished requests): no such token is emitted.
            self._grammar_failed(GrammarBackendError(f"gated step {gate.seq}: {why}"))
        return self._update_from_output(so, result)

    def has_unfinished_requests(self) -> bool:
        return (self.inflight is not None or self.deferred_sample is not None or bool(self.batch_queue)
                or bool(self.waiting_for_grammar) or self.scheduler.has_unfinished_requests())

    def reset_prefix_cache(self) -> bool:
        """Drop all prefix-cache entries; refused (False) unless every block is free."""
        if self.has_unfinished_requests():
            return False
        return self.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()
