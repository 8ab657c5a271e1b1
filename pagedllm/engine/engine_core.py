"""EngineCore: schedule -> execute -> update, the one step loop. No sockets, no asyncio, no text.

The frontends (LLMEngine for `LLM`, AsyncLLM for the server) own tokenization, detokenization and
stop strings; the core sees token ids only.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import gc
import logging
import time
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import EngineCoreOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler, SchedulerStats
from pagedllm.request import Request, RequestStatus
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.worker.model_runner import ModelRunner, PendingOutput, kv_cache_bytes_per_block
from pagedllm.worker.warmup import warmup_kernels

logger = logging.getLogger(__name__)

# Test-only fault injection: raise inside the N-th engine step (1-based). Lets tests check that a
# dying engine fails in-flight requests, turns /health to 503 and ends the server.
FAULT_INJECT_ENV = "PAGEDLLM_TEST_FAIL_AT_STEP"


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)  # once per process, however many engines


def freeze_gc_heap() -> None:
    """Move every live object out of the cyclic collector's sight (vLLM freezes its heap too).

    The model, its buffers and the start-up garbage are long-lived; otherwise each full collection
    while serving walks them again (~0.3 s of a 6 s W1 run on the H200 host). Frozen objects are
    never collected, so a frontend that drops its engine calls `unfreeze_gc_heap` (below); at exit
    the heap is given back too, so interpreter shutdown still collects it (extension modules such
    as Triton's report frozen objects as leaks otherwise).
    """
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


def unfreeze_gc_heap() -> None:
    """Give frozen objects back to the collector: an engine's reference cycles (and the GPU memory
    they hold) are freed by the next `gc.collect()`. Other live engines only lose the speed-up
    until the next engine start freezes again."""
    gc.unfreeze()


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        t0 = time.monotonic()
        threads = config.device_config.cpu_threads
        if threads is not None:
            if threads < 1:
                raise ValueError(f"cpu_threads must be >= 1, got {threads}.")
            torch.set_num_threads(threads)
        self.model_runner = ModelRunner(config)
        num_blocks = self.model_runner.determine_num_blocks()
        bs = config.cache_config.block_size
        max_len = config.model_config.max_model_len
        if num_blocks * bs < max_len:
            raise ValueError(
                f"The model's max_model_len ({max_len}) is larger than the {num_blocks * bs} tokens "
                f"({num_blocks} blocks of {bs}) that fit in the KV cache. Increase gpu_memory_utilization / "
                f"cpu_kvcache_space / num_gpu_blocks_override, or set max_model_len <= {num_blocks * bs}."
            )
        self.model_runner.initialize_kv_cache(num_blocks)
        warmup_kernels(self.model_runner)
        self.model_runner.capture_model()
        self.num_gpu_blocks = num_blocks
        num_cpu_blocks = 0
        if config.preemption_mode == "swap":
            per_block = kv_cache_bytes_per_block(config)
            num_cpu_blocks = int(config.cache_config.swap_space * (1 << 30)) // per_block
            self.model_runner.init_swap_space(num_cpu_blocks)
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, num_blocks, config.preemption_mode, num_cpu_blocks
        )
        self.step_count = 0
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.inflight: tuple[SchedulerOutput, PendingOutput] | None = None
        self.structured_output_manager = StructuredOutputManager(config)
        # Constrained requests whose grammar is still compiling: they reach the scheduler when it is.
        self.waiting_for_grammar: dict[str, Request] = {}
        freeze_gc_heap()
        logger.info(
            "engine ready in %.1f s: %d KV blocks of %d tokens (%d tokens), %s on %s",
            time.monotonic() - t0, num_blocks, bs, num_blocks * bs,
            config.model_config.dtype, config.device_config.device,
        )

    def add_request(self, request: Request) -> None:
        """Validate and queue; raises ValueError (nothing queued) when the request can never run."""
        if request.sampling_params.seed is not None and request.generator is None:
            gen = torch.Generator(device=self.model_runner.device)
            gen.manual_seed(request.sampling_params.seed)
            request.generator = gen
        if request.sampling_params.structured_outputs is not None:
            self.structured_output_manager.add_request(request)
            self.waiting_for_grammar[request.request_id] = request
            return
        self.scheduler.add_request(request)

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
        """Schedule and launch one step; return the outputs of the step that just completed.

        Synchronous: that is this step. With async scheduling the previous step's results are
        collected after this step is launched, so the host prepares step N+1 while the device
        runs step N. A batch whose sampling reads past outputs (penalties, min_tokens) first
        collects the step in flight, so the runner holds every token.
        """
        outputs: list[EngineCoreOutput] = []
        if self.waiting_for_grammar:
            outputs += self._release_compiled()
        so = self.scheduler.schedule() if self.scheduler.has_unfinished_requests() else None
        if so is not None and so.is_empty:
            so = None
        if self.inflight is not None and (so is None or not self.async_scheduling or so.needs_output_history):
            outputs += self._collect_inflight()
        if so is None and self.waiting_for_grammar and self.inflight is None:
            self._wait_for_a_grammar()
        if so is not None:
            manager = self.structured_output_manager
            so.has_structured_output_requests = bool(manager.sampling_request_ids(so))
            pending = self.model_runner.execute_model(so)
            if pending is None:
                # Constrained rows: their bitmask needs the tokens of the step in flight, so collect
                # it now (the device runs this step's forward meanwhile), then fill and sample.
                if self.inflight is not None:
                    outputs += self._collect_inflight()
                pending = self.model_runner.sample_tokens(manager.grammar_bitmask(so))
            self.step_count += 1
            if self.inflight is not None:
                outputs += self._collect_inflight()
            self.inflight = (so, pending)
            if not self.async_scheduling:
                outputs += self._collect_inflight()
        return outputs

    def _collect_inflight(self) -> list[EngineCoreOutput]:
        assert self.inflight is not None
        so, pending = self.inflight
        self.inflight = None
        outputs = self.scheduler.update_from_output(so, pending.get())
        self.structured_output_manager.advance(outputs)  # the one place grammars advance
        return outputs

    def _wait_for_a_grammar(self) -> None:
        """Nothing to run but grammars compiling: sleep until one is done instead of spinning."""
        futures = [self.structured_output_manager.requests[r].future for r in self.waiting_for_grammar]
        concurrent.futures.wait(futures, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)

    def has_unfinished_requests(self) -> bool:
        return self.inflight is not None or bool(self.waiting_for_grammar) or self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Drop all prefix-cache entries; refused (False) unless every block is free."""
        if self.has_unfinished_requests():
            return False
        return self.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()


def step_and_queue_times(core: EngineCore, unscheduled: dict[str, Request]) -> tuple[list[EngineCoreOutput], list[float]]:
    """One `core.step()`, and the time in queue of each request in `unscheduled` (added, not yet
    scheduled) that this step scheduled: from its arrival until the step started (vLLM's
    time-in-queue metric). Scheduled and finished requests leave `unscheduled`; both engine shells
    (the AsyncLLM engine thread and the engine process) call this."""
    step_start = time.time()
    outputs = core.step()
    queue_times = []
    for rid, req in list(unscheduled.items()):
        if req.is_finished():
            del unscheduled[rid]
        elif req.status != RequestStatus.WAITING:
            queue_times.append(step_start - req.arrival_time)
            del unscheduled[rid]
    return outputs, queue_times


def check_injected_fault(step: int, fail_at: int | None) -> None:
    """Raise in engine step `fail_at` (FAULT_INJECT_ENV) and after; both engine shells call this."""
    if fail_at is not None and step >= fail_at:
        raise RuntimeError(f"injected fault in engine step {step} ({FAULT_INJECT_ENV})")


def apply_command(
    core: EngineCore, kind: str, payload: Any, unscheduled: dict[str, Request], failed: list[tuple[str, Exception]]
) -> bool:
    """Apply one frontend command to the core; False for "shutdown". Both engine shells call this.

    "add" (a list of Requests): each joins `unscheduled` (its queue time is measured), or, when the
    core refuses it, goes to `failed` as (request id, error): it fails alone, the engine lives on.
    "abort" (core request ids), "stop" ({core request id: the stop string the frontend found}).
    """
    if kind == "shutdown":
        return False
    if kind == "add":
        for req in payload:
            try:
                core.add_request(req)
                unscheduled[req.request_id] = req
            except Exception as e:  # noqa: BLE001 - reported to the request's owner
                if not isinstance(e, ValueError):
                    logger.exception("engine core refused request %s", req.request_id)
                failed.append((req.request_id, e))
    elif kind == "abort":
        core.abort_requests(payload)
    elif kind == "stop":
        core.stop_requests(payload)
    else:
        raise AssertionError(f"unknown engine command {kind!r}")
    return True
