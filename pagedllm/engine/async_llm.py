"""AsyncLLM: the asyncio frontend used by the server. Many requests stream at once.

The event loop does the frontend's work; the step loop runs elsewhere and never waits on text work:

    asyncio loop (server)                                             engine (core_client.py)
    ---------------------                                             -----------------------
    add_request: tokenize, states and Requests built in the
      worker pool; states registered -------------- AddRequests ---> apply adds / aborts / stops
                                                                      step() -> EngineCoreOutputs
    one step's outputs per loop iteration (output_pump.py): <------- StepOutputs (at most
      detokenize, stop strings, RequestOutputs, IterationStats,       MAX_PENDING_BATCHES behind)
      mailboxes, metrics
    abort (disconnect): forget now ---------------- AbortRequests --> applied before the next step

The engine side (`EngineCoreClient`) runs the EngineCore in a process of its own (engine/core_proc.py;
the default) or in a thread of this one. The loop alone touches the OutputProcessor, the mailboxes
and the table of unfinished requests (engine/live_requests.py: every request gets an internal id,
`"{request_id}-{seq}"`, so a caller may reuse a request id the moment its previous request ended,
without outputs of the old one still in flight reaching the new one).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.iteration_stats import process_outputs_with_stats
from pagedllm.engine.live_requests import LiveRequests
from pagedllm.engine.llm_engine import load_tokenizer
from pagedllm.engine.messages import AbortRequests, AddRequests, EngineCoreRequest, StepOutputs, StopRequests
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.output_pump import OutputPump
from pagedllm.engine.output_stream import LiveRequest, RequestOutputCollector, RequestOutputStream
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.loader import hf_configs
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
StatLogger = Callable[[SchedulerStats | None, IterationStats | None], None]

class EngineDeadError(RuntimeError):
    """The engine (or the output processing) failed; no request can be served any more."""


@dataclass(slots=True)
class _EngineFailed:
    error: BaseException  # through the pump: after the outputs queued before it


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, tokenizer_pool_size: int = 2,
                 while_waiting: Callable[[], None] | None = None) -> None:
        """while_waiting: the caller's own start-up work, run once the tokenizer is loaded, before
        waiting for the engine to be ready (the server's: api_server.run_server)."""
        self.config = config
        self.model_config = config.model_config
        self._outq = OutputPump(self._on_output_items)  # engine replies -> the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        # Started first, so that in an engine process the model loads there while the tokenizer
        # loads here.
        self.engine_core = EngineCoreClient.make_client(
            config,
            self._outq,
            on_failed=lambda failed: self._call_on_loop(self._fail_requests, failed),
            # Through the pump: the steps finished before the failure reach their streams
            # first, then the error.
            on_dead=lambda exc: self._outq.put(_EngineFailed(exc)),
        )
        try:
            t0 = time.monotonic()
            self.tokenizer = load_tokenizer(config)
            self.processor = Processor(config, self.tokenizer)
            if while_waiting is not None:
                while_waiting()
            t1 = time.monotonic()
            self.engine_core.wait_ready()
            # The start-up timeline (scripts/gpu_cold_start.py): the frontend's tokenizer (and the
            # caller's work), then how long it waited for the engine (0 when the engine was ready first).
            logger.info("start-up: tokenizer and processor took %.2f s; then waited %.2f s for the engine",
                        t1 - t0, time.monotonic() - t1)
            # The start completed: the model config built here is kept for the next start
            # (loader/hf_configs.py; the engine process keeps the one it built itself).
            hf_configs.remember()
        except BaseException:
            self.engine_core.shutdown(0)
            raise
        # The event loop's alone; a request whose output it cannot process fails alone (take_failed).
        self.output_processor = OutputProcessor(self.tokenizer, isolate_failures=True)
        self.stat_loggers: list[StatLogger] = []
        self._failed_stat_loggers: set[int] = set()  # ids of those whose failure was logged
        self.dead_error: EngineDeadError | None = None
        # Set by refuse_new_requests (a draining server): add_request raises it.
        self.refusal: BaseException | None = None
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._requests = LiveRequests()  # the event loop's
        self._seq = itertools.count()
        self._started = False
        # Tokenization and chat-template rendering run here, never on the event loop.
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_pool_size, thread_name_prefix="pagedllm-tokenizer")

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args.create_engine_config())

    # -- status ------------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return self.engine_core.is_alive() and self.dead_error is None

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    def add_dead_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Called on the event loop once, when the engine (or output) thread dies."""
        self._dead_callbacks.append(callback)

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this engine was started with skip_tokenizer_init; it has no tokenizer.")
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def request_overview(self, limit: int = 50) -> list[dict[str, Any]]:
        """The unfinished sequences (at most `limit`, oldest first) with their token counts, for the
        web console. Called on the event loop, which owns the table."""
        now = time.time()
        out = []
        for st in list(self.output_processor.request_states.values())[:limit]:
            m = st.metrics
            out.append({
                "id": st.request_id,
                "state": "running" if m.first_token_time is not None else "prefill",
                "prompt_tokens": len(st.prompt_token_ids),
                "output_tokens": len(st.token_ids),
                "age_s": round(now - m.arrival_time, 3),
            })
        return out

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache); False while requests run."""
        self._check_accepting()
        self._ensure_started()
        return await asyncio.wrap_future(self.engine_core.reset_prefix_cache())

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
        self._check_accepting()
        self._ensure_started()
        self._requests.reserve(request_id)  # while the pool tokenizes
        try:
            internal_id = f"{request_id}-{next(self._seq)}"
            arrival_time = arrival_time if arrival_time is not None else time.time()
            prep = await self.run_in_tokenizer_pool(
                self.processor.process_request, internal_id, prompt, sampling_params, arrival_time
            )
            self._check_accepting()
            # Built before anything is registered: a request that cannot be turned into the message
            # raises here, leaving no state behind.
            add = AddRequests([EngineCoreRequest.from_request(r) for r in prep.requests])
        except BaseException:
            self._requests.release(request_id)
            raise
        core_ids = [r.request_id for r in prep.requests]
        live = LiveRequest(request_id, internal_id, core_ids, RequestOutputCollector(prep.output_kind))
        live.arrival_time = arrival_time
        self._requests.register(live)
        # States first: they exist before the engine can produce a token for them.
        for st in prep.states:
            self.output_processor.add_request(st)
        self.engine_core.send(add)
        return RequestOutputStream(live, self._abort_live)

    def _check_accepting(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self.refusal is not None:
            raise self.refusal

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
        """Forget the requests (callers' ids) here and tell the engine thread; their blocks are
        freed before the next step. Must be called on the event loop's thread."""
        for rid in request_ids:
            live = self._requests.by_request_id(rid)
            if live is not None:
                self._abort_live(live)

    def _abort_live(self, live: LiveRequest) -> None:
        if not self._requests.is_live(live):
            return  # finished or aborted already
        self._requests.forget(live)
        if self.dead_error is None:
            self._count_aborted(self.output_processor.abort_requests([live.internal_id]), live.arrival_time)
            self.engine_core.send(AbortRequests(live.core_ids))

    def fail_all_requests(self, error: BaseException) -> int:
        """End every live request with `error` (their consumers raise it) and free their blocks.
        Returns how many there were. Used when a draining server runs out of time."""
        lives = list(self._requests)
        for live in lives:
            live.collector.put(error)
            self._abort_live(live)
        return len(lives)

    def refuse_new_requests(self, error: BaseException) -> None:
        """From now on add_request raises `error` (also for requests still being tokenized)."""
        self.refusal = error

    # -- threads -----------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._outq.bind(self._loop)
        self.engine_core.start()

    def start(self) -> None:
        """Start the engine threads now (on the running loop); otherwise the first request does."""
        self._ensure_started()

    def _call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop closed under us (interpreter shutdown)

    # -- engine replies, on the event loop (output_pump.py) -----------------------------------------
    def _on_output_items(self, items: list[StepOutputs | _EngineFailed]) -> None:
        """What the pump held at this loop iteration, in order: the steps queued while the frontend
        was behind are processed as one (one RequestOutput per request for all their tokens, so one
        write per stream), then a failure after them."""
        steps: list[StepOutputs] = []
        for item in items:
            match item:
                case StepOutputs():
                    steps.append(item)
                case _EngineFailed(error=error):  # after the outputs queued before it
                    self._on_steps(steps)
                    steps = []
                    self._on_engine_dead(error)
                case _:
                    raise AssertionError(f"unknown engine reply {item!r}")
        self._on_steps(steps)

    def _on_steps(self, steps: list[StepOutputs]) -> None:
        if not steps:
            return
        if self.dead_error is not None:
            for _ in steps:
                self.engine_core.batch_done()
            return
        # One request may appear in several steps: process_outputs applies its outputs in step order.
        outputs = [o for s in steps for o in s.outputs]
        queue_times = [t for s in steps for t in s.queue_times]
        try:
            request_outputs, stops, it = process_outputs_with_stats(self.output_processor, outputs, queue_times)
            if stops:
                self.engine_core.send(StopRequests(stops))
        except BaseException as e:  # noqa: BLE001 - past one request's failure (take_failed): fatal, as a step's
            logger.exception("output processing failed")
            self._on_engine_dead(e)
            return
        finally:
            for _ in steps:
                self.engine_core.batch_done()
        # Every step's scheduler stats, in order (a KV map may ride on any one of them); the
        # iteration's stats with the last.
        for s in steps[:-1]:
            self._run_stat_loggers(s.stats, None)
        self._deliver(request_outputs, steps[-1].stats, it)
        failed = self.output_processor.take_failed()
        if failed:
            self._fail_requests(failed)

    def _count_aborted(self, core_ids: list[str], arrival_time: float) -> None:
        """The sequences an abort found unfinished finish with reason "abort" in the stats (vLLM's
        request_success_total{finished_reason="abort"}). A sequence that finished before its abort
        counts once, as finished (its state is gone by then)."""
        if core_ids:
            e2e = max(0.0, time.time() - arrival_time) if arrival_time else 0.0
            self._log_stats(IterationStats(finished_requests=[FinishedRequestStats("abort", e2e, 0) for _ in core_ids]))

    def _log_stats(self, it: IterationStats) -> None:
        self._run_stat_loggers(None, it)

    def _run_stat_loggers(self, stats: SchedulerStats | None, it: IterationStats | None) -> None:
        for log in self.stat_loggers:
            try:
                log(stats, it)
            except Exception:  # noqa: BLE001 - a metrics bug must not cost the requests their outputs
                if id(log) not in self._failed_stat_loggers:  # once: it would fail every step
                    self._failed_stat_loggers.add(id(log))
                    logger.exception("stat logger %r failed (logged once; it keeps being called)", log)

    # -- event-loop side ---------------------------------------------------------------------------
    def _deliver(self, request_outputs: list[RequestOutput], stats: SchedulerStats, it: IterationStats) -> None:
        if self.dead_error is not None:
            return
        for ro in request_outputs:
            live = self._requests.get(ro.request_id)
            if live is None:
                continue  # aborted after this step's outputs were built
            ro.request_id = live.request_id
            live.collector.put(ro)
            if ro.finished:
                self._requests.forget(live)
        self._run_stat_loggers(stats, it)

    def _fail_requests(self, failed: dict[str, BaseException]) -> None:
        """The engine core refused requests (it checks what the frontend cannot): fail their owners."""
        for core_id, err in failed.items():
            live = self._requests.owner_of(core_id)
            if live is not None:
                live.collector.put(err)
                self._abort_live(live)

    def _on_engine_dead(self, exc: BaseException) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = EngineDeadError(f"The engine failed and cannot serve requests: {type(exc).__name__}: {exc}")
        self.dead_error.__cause__ = exc
        self.engine_core.stop()
        self._outq.close()
        for live in self._requests:
            live.collector.put(self.dead_error)
        self._requests.clear()
        for cb in self._dead_callbacks:
            try:
                cb(self.dead_error)
            except Exception:
                logger.exception("engine-dead callback failed")

    def shutdown(self, timeout: float = 5.0) -> None:
        self._outq.close()
        self.engine_core.shutdown(timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
