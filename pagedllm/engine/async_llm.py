"""AsyncLLM: the asyncio frontend used by the server. Many requests stream at once.

Two threads share the work:

    asyncio loop (server)                         engine thread
    ---------------------                         -------------
    add_request: tokenize (worker pool),          loop: apply queued adds / aborts / stops
      validate, RequestState, put("add") ------>        step() -> EngineCoreOutputs
    output handler: detokenize, stop strings, <------  call_soon_threadsafe(outputs, stats)
      per-request collectors, metrics
    abort (disconnect) put("abort") ----------->  applied before the next step

The EngineCore stays pure and single-threaded: only the engine thread touches it, and it learns of
new work through a thread-safe queue between steps. Torch releases the GIL inside the model's
kernels, so HTTP handling and detokenization on the loop overlap the forward pass.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.llm_engine import load_tokenizer
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest, RequestState
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
StatLogger = Callable[[SchedulerStats | None, IterationStats | None], None]

# Test-only fault injection: raise inside the N-th engine step (1-based). Lets tests check that a
# dying engine fails in-flight requests, turns /health to 503 and ends the server.
FAULT_INJECT_ENV = "PAGEDLLM_TEST_FAIL_AT_STEP"


class EngineDeadError(RuntimeError):
    """The engine thread crashed; no request can be served any more."""


class RequestOutputCollector:
    """Mailbox between the output handler and one request's consumer.

    With DELTA outputs a slow consumer does not make a queue grow: new deltas merge into the one
    pending output (text and tokens appended), so memory per request stays bounded.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        if isinstance(self.output, BaseException):
            return  # an error is final
        if self.output is None or isinstance(output, BaseException):
            self.output = output
            self.ready.set()
        elif self.aggregate:
            _merge_delta(self.output, output)
        else:
            self.output = output  # cumulative / final: the newer one holds everything

    def get_nowait(self) -> RequestOutput | None:
        out = self.output
        if out is None:
            return None
        self.output = None
        self.ready.clear()
        if isinstance(out, BaseException):
            raise out
        return out

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        out = self.get_nowait()
        assert out is not None
        return out


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    # into.outputs: one CompletionOutput per choice index seen so far, in index order.
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids = prev.token_ids + c.token_ids
        if c.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + c.logprobs
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason = c.finish_reason
        prev.stop_reason = c.stop_reason
    into.outputs = [by_index[i] for i in sorted(by_index)]
    into.finished = new.finished
    into.metrics = new.metrics
    into.num_cached_tokens = new.num_cached_tokens


class RequestOutputStream:
    """Async iterator over one request's outputs; aborting it (or dropping out of the loop through
    an exception or cancellation) aborts the request in the engine and frees its KV blocks."""

    def __init__(self, engine: AsyncLLM, request_id: str, collector: RequestOutputCollector) -> None:
        self.engine = engine
        self.request_id = request_id
        self.collector = collector
        self.finished = False

    def __aiter__(self) -> RequestOutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = self.collector.get_nowait() or await self.collector.get()
        except BaseException:
            self.abort()
            raise
        if out.finished:
            self.finished = True
        return out

    def abort(self) -> None:
        """Idempotent; a no-op once the request finished."""
        if not self.finished:
            self.finished = True
            self.engine.abort_now([self.request_id])

    async def aclose(self) -> None:
        self.abort()


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, tokenizer_pool_size: int = 2) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = load_tokenizer(config)
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(config)
        self.stat_loggers: list[StatLogger] = []
        self.dead_error: EngineDeadError | None = None
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        # Frontend request id -> mailbox. Children of n > 1 share their parent's mailbox.
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._inputs: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Tokenization and chat-template rendering run here, never on the event loop.
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_pool_size, thread_name_prefix="pagedllm-tokenizer")
        fail_at = os.environ.get(FAULT_INJECT_ENV)
        self._fail_at_step = int(fail_at) if fail_at else None
        self._num_steps = 0

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args.create_engine_config())

    # -- status ------------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    def add_dead_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Called on the event loop once, when the engine thread dies."""
        self._dead_callbacks.append(callback)

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this engine was started with skip_tokenizer_init; it has no tokenizer.")
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        return len(self._collectors)

    async def run_in_tokenizer_pool(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run CPU-bound text work (tokenize, render a chat template) off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, lambda: fn(*args, **kwargs))

    # -- requests ----------------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
    ) -> RequestOutputStream:
        """Validate and queue now (ValueError on a bad request, nothing queued); returns the stream
        of outputs. The caller must iterate it to the end or abort it."""
        if self.dead_error is not None:
            raise self.dead_error
        self._ensure_started()
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use.")
        arrival_time = arrival_time if arrival_time is not None else time.time()
        pp = await self.run_in_tokenizer_pool(self.processor.tokenize_prompt, prompt)
        final = self.processor.finalize_params(sampling_params, len(pp.prompt_token_ids))
        if self.dead_error is not None:
            raise self.dead_error
        if request_id in self._collectors:  # taken while we tokenized
            raise ValueError(f"request id {request_id!r} is already in use.")

        parent = ParentRequest(request_id, final.n, final.output_kind) if final.n > 1 else None
        children: list[tuple[str, SamplingParams]] = (
            [(parent.child_id(i), self.processor.child_params(final, i)) for i in range(final.n)]
            if parent
            else [(request_id, final)]
        )
        requests = []
        for index, (core_id, child_params) in enumerate(children):
            self.output_processor.add_request(
                RequestState(
                    core_id, parent, index, pp.prompt, pp.prompt_token_ids, child_params, self.tokenizer, arrival_time
                )
            )
            requests.append(Request(core_id, pp.prompt_token_ids, child_params, arrival_time, pp.cache_salt))
        collector = RequestOutputCollector(final.output_kind)
        self._collectors[request_id] = collector
        self._inputs.put(("add", requests))
        return RequestOutputStream(self, request_id, collector)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's API: yields RequestOutputs (deltas with RequestOutputKind.DELTA) until finished.
        Closing the generator or cancelling the task that iterates it aborts the request."""
        stream = await self.add_request(request_id, prompt, sampling_params, arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def abort(self, request_id: str | Iterable[str]) -> None:
        self.abort_now([request_id] if isinstance(request_id, str) else list(request_id))

    def abort_now(self, request_ids: list[str]) -> None:
        """Forget the requests here and tell the engine thread; their blocks are freed before the
        next step. Must be called on the event loop's thread."""
        for rid in request_ids:
            self._collectors.pop(rid, None)
        core_ids = self.output_processor.abort_requests(request_ids)
        if core_ids and self.dead_error is None:
            self._inputs.put(("abort", core_ids))

    # -- engine thread -----------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run_engine_core, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def start(self) -> None:
        """Start the engine thread now (on the running loop); otherwise the first request does."""
        self._ensure_started()

    def _run_engine_core(self) -> None:
        core = self.engine_core
        # Requests added but not scheduled yet, to measure their queue time.
        unscheduled: dict[str, Request] = {}
        try:
            while True:
                if not self._apply_inputs(block=not core.has_unfinished_requests(), unscheduled=unscheduled):
                    return
                if not core.has_unfinished_requests():
                    # Aborts may have emptied the engine: publish the state (0 running, free pool).
                    self._publish([], core.make_stats(), [])
                    continue
                step_start = time.time()
                self._num_steps += 1
                if self._fail_at_step is not None and self._num_steps >= self._fail_at_step:
                    raise RuntimeError(f"injected fault in engine step {self._num_steps} ({FAULT_INJECT_ENV})")
                outputs = core.step()
                queue_times = []
                for rid, req in list(unscheduled.items()):
                    if req.is_finished():
                        del unscheduled[rid]
                    elif req.status != RequestStatus.WAITING:
                        queue_times.append(step_start - req.arrival_time)
                        del unscheduled[rid]
                self._publish(outputs, core.make_stats(), queue_times)
        except BaseException as e:  # noqa: BLE001 - anything that kills the thread kills the engine
            logger.exception("engine thread died")
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._on_engine_dead, e)

    def _apply_inputs(self, block: bool, unscheduled: dict[str, Request]) -> bool:
        """Apply every queued command; False on shutdown. Blocks for the first one only when idle."""
        try:
            item = self._inputs.get(block=block)
        except queue.Empty:
            return True
        failed: list[tuple[str, Exception]] = []
        while True:
            kind, payload = item
            if kind == "shutdown":
                return False
            if kind == "add":
                for req in payload:
                    try:
                        self.engine_core.add_request(req)
                        unscheduled[req.request_id] = req
                    except Exception as e:  # a request the core refuses fails alone, the engine lives on
                        if not isinstance(e, ValueError):
                            logger.exception("engine core refused request %s", req.request_id)
                        failed.append((req.request_id, e))
            elif kind == "abort":
                self.engine_core.abort_requests(payload)
            elif kind == "stop":
                self.engine_core.stop_requests(payload)
            else:
                raise AssertionError(f"unknown engine command {kind!r}")
            try:
                item = self._inputs.get_nowait()
            except queue.Empty:
                break
        if failed:
            self._call_on_loop(self._fail_requests, failed)
        return True

    def _publish(self, outputs: list[Any], stats: SchedulerStats, queue_times: list[float]) -> None:
        self._call_on_loop(self._process_outputs, outputs, stats, queue_times)

    def _call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop closed under us (interpreter shutdown)

    # -- event-loop side ---------------------------------------------------------------------------
    def _process_outputs(self, outputs: list[Any], stats: SchedulerStats, queue_times: list[float]) -> None:
        if self.dead_error is not None:
            return
        now = time.time()
        it = IterationStats(queue_times=queue_times)
        op = self.output_processor
        touched: list[RequestState] = []
        for o in outputs:
            st = op.request_states.get(o.request_id)
            if st is None:
                continue  # aborted, or stopped by a stop string while this step ran
            touched.append(st)
            n = len(o.new_token_ids)
            if not n:
                continue
            it.num_generation_tokens += n
            if st.metrics.first_token_time is None:
                it.time_to_first_tokens.append(now - st.metrics.arrival_time)
                if st.index == 0:  # once per prompt, not per choice
                    it.num_prompt_tokens += len(st.prompt_token_ids)
            elif st.metrics.last_token_time is not None:
                it.inter_token_latencies.append(now - st.metrics.last_token_time)
        request_outputs, stops = op.process_outputs(outputs)
        if stops:
            self._inputs.put(("stop", stops))
        for st in touched:
            if st.finish_reason is not None:
                it.finished_requests.append(
                    FinishedRequestStats(st.finish_reason, now - st.metrics.arrival_time, len(st.token_ids))
                )
        for ro in request_outputs:
            collector = self._collectors.get(ro.request_id)
            if collector is not None:
                collector.put(ro)
            if ro.finished:
                self._collectors.pop(ro.request_id, None)
        for log in self.stat_loggers:
            log(stats, it)

    def _fail_requests(self, failed: list[tuple[str, Exception]]) -> None:
        """The engine core refused requests (it checks what the frontend cannot): fail their owners."""
        for core_id, err in failed:
            st = self.output_processor.request_states.get(core_id)
            rid = st.parent.request_id if st is not None and st.parent is not None else core_id
            collector = self._collectors.get(rid)
            self.abort_now([rid])
            if collector is not None:
                collector.put(err)

    def _on_engine_dead(self, exc: BaseException) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = EngineDeadError(f"The engine failed and cannot serve requests: {type(exc).__name__}: {exc}")
        self.dead_error.__cause__ = exc
        for collector in self._collectors.values():
            collector.put(self.dead_error)
        self._collectors.clear()
        for cb in self._dead_callbacks:
            try:
                cb(self.dead_error)
            except Exception:
                logger.exception("engine-dead callback failed")

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._inputs.put(("shutdown", None))
            self._thread.join(timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

