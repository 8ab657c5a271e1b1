"""The engine core's structured-output state (vLLM v1's StructuredOutputManager).

- `add_request`: the request's grammar compiles in a small thread pool, off the step loop; the
  core holds the request back from the scheduler until it is ready (a cached schema: at once).
- `advance`: after each collected step, the tokens the scheduler accepted are queued for the
  grammars. Only these tokens ever reach a grammar, so a token the scheduler dropped (a request
  finished or aborted while its step ran) never does. A decode row's one token (the common case)
  is queued for a batch accept with no per-row call; the rest (reasoning text, a stop token)
  advance one request at a time.
- `grammar_bitmask`: before a step samples, one bitmask row per request whose next token is
  constrained: the queued tokens advance the grammars (one xgrammar batch call), then the rows
  are filled (xgrammar's threads). `submit_grammar_bitmask` hands the job off, so with async
  scheduling the engine core returns the step's outputs and schedules the next step while it
  runs, and samples only when the next forward is launched (engine_core.py). Two backends take
  it: the grammar worker process (backend_process.py; the default under async scheduling: the
  accept and the fill there, one message a step), or in this process the bitmask thread
  (fill_thread.py; xgrammar's C++ gives up the GIL) with the accept in the step loop (on the
  thread it would need the GIL again between it and the fill, i.e. wait for the loop to block).

Rows whose next token is free (the reasoning text, a grammar already ended) get no row: the mask
is applied to constrained rows only. A step with none samples unmasked (GrammarOutput None).

Gated sampling's half (gate_step, submit_gate) is gated_manager.py's mixin; the backend choice
(make_backend, use_grammar_worker) backend_select.py's, imported here for the callers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from pagedllm.structured_output.backend_select import make_backend, use_grammar_worker
from pagedllm.structured_output.backend_types import StructuredOutputBackend
from pagedllm.structured_output.bitmask import GrammarOutput
from pagedllm.structured_output.fill_thread import FillThread
from pagedllm.structured_output.gate import FlagWords, GateWatchdog
from pagedllm.structured_output.gated_manager import GatedSamplingMixin
from pagedllm.structured_output.request import StructuredOutputRequest
from pagedllm.structured_output.sample_check import SampleChecks, needs_sample_check

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.sched_output import EngineCoreOutput, SchedulerOutput
    from pagedllm.request import Request
    from pagedllm.structured_output.backend_process import WorkerJob

logger = logging.getLogger(__name__)
__all__ = ["BitmaskJob", "StructuredOutputManager", "make_backend", "use_grammar_worker"]


class StructuredOutputManager(GatedSamplingMixin):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.requests: dict[str, StructuredOutputRequest] = {}
        # Accepted tokens not yet fed to their grammar (the next bitmask job feeds them): one token
        # of an active grammar (the batch accept), and the rest in order (one request at a time).
        self._to_accept_one: dict[StructuredOutputRequest, int] = {}
        self._to_accept: dict[StructuredOutputRequest, list[int]] = {}
        self._fill_thread: FillThread | None = None
        self._rows_of: tuple[object, list[str]] = (None, [])  # the last step's sampling_request_ids
        # Pinned host bitmasks, reused in turn: a step's copy to the device is queued when it
        # samples and has run when that step is collected, before the buffer's next turn (2 steps on).
        self._bitmasks: list = []
        self._bitmask_views: list[dict[int, torch.Tensor]] = []
        self._next_bitmask = 0
        self._remote = False  # the backend is the grammar worker process (backend_process.py)
        # Gated sampling (gate.py): the flag words, and the last gated job (waited for before the next job).
        self._flags: FlagWords | None = None
        self._gate_watchdog: GateWatchdog | None = None  # the bitmask thread's (the workers have theirs)
        self._gate_job: Callable[[], None] | None = None
        # Gated, bitmask thread: the batch accept on the thread before the fill, not in the step
        # loop. The thread needs the GIL between the two C++ calls, which a busy step loop gives up
        # only after the switch interval (sys.setswitchinterval): an A/B of scripts/gpu_h42_gate.py.
        self.accept_on_thread = False
        # Grammar workers: the last gated step's rows laid out per worker, (version, request ids,
        # layout); `_layout_version` moves whenever a request leaves or a grammar may have ended.
        self._gate_layout: tuple[int, list[str], list] | None = None
        self._layout_version = 0
        self._gate_rows: tuple[int, list[str]] | None = None  # gate_step's rows, all active, kept the same way
        self._workers_failed = False  # fail_over: the grammar workers failed, the thread serves from now on
        self._retired: list[StructuredOutputBackend] = []  # failed backends, shut down with the engine
        # Rows whose sampled token is checked against their bitmask at collect (sample_check.py): the
        # requests with another mask that may leave no token, counted (0: nothing is recorded).
        self._checks = SampleChecks()
        self._num_checked = 0
        self.refused_ids: list[str] = []  # take_refused's

    def backend(self) -> StructuredOutputBackend:
        """Built on first use (the core loads a tokenizer only if a request needs a grammar)."""
        with self._backend_lock:
            if self._backend is None:
                from pagedllm.engine.llm_engine import load_tokenizer

                tokenizer = load_tokenizer(self.config)
                if tokenizer is None:
                    raise ValueError("structured outputs need a tokenizer; this engine has none (skip_tokenizer_init).")
                config = self.config
                self._backend = make_backend(
                    tokenizer, config.model_config.vocab_size,
                    worker=use_grammar_worker() and not self._workers_failed,
                    rows=config.scheduler_config.max_num_seqs, pin_memory=config.device_config.device == "cuda")
                self._remote = getattr(self._backend, "remote", False)
            return self._backend

    def add_request(self, request: Request) -> StructuredOutputRequest:
        params = request.sampling_params.structured_outputs
        assert params is not None
        stop_ids = sorted(request.sampling_params.all_stop_token_ids)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="pagedllm-grammar")
        future = self._pool.submit(lambda: self.backend().compile_grammar(params, stop_ids))
        sor = StructuredOutputRequest(request.request_id, params, future)
        if needs_sample_check(request.sampling_params):
            sor.check_samples = True
            self._num_checked += 1
        self.requests[request.request_id] = sor
        return sor

    def remove(self, request_ids) -> None:
        self._layout_version += 1
        for rid in request_ids:
            sor = self.requests.pop(rid, None)
            if sor is not None:
                self._num_checked -= sor.check_samples
                self._to_accept.pop(sor, None)
                self._to_accept_one.pop(sor, None)
                if self._remote:
                    self._release(sor)

    def _release(self, sor: StructuredOutputRequest) -> None:
        """A finished request's grammar in the grammar worker is dropped (with the next job); one
        still compiling, once it has."""
        future = sor.future
        if not future.done():
            future.add_done_callback(lambda _: self._release(sor))
        elif not future.cancelled() and future.exception() is None:
            self.backend().release(future.result())

    def advance(self, outputs: list[EngineCoreOutput]) -> None:
        """Queue each constrained request's accepted tokens for its grammar; forget finished ones.

        The fast path (one token, the grammar active, not one of its stop tokens: every decode row
        of a JSON answer) queues the token for the next job's one batch accept; anything else (a
        reasoning row, a stop token, a request collected twice before a job) the slow path."""
        if not self.requests:
            return
        requests, one, many = self.requests, self._to_accept_one, self._to_accept
        for out in outputs:  # every constrained row, every step: attribute reads, no calls
            sor = requests.get(out.request_id)
            if sor is None:
                continue
            if out.finish_reason is not None:
                del requests[out.request_id]
                self._num_checked -= sor.check_samples
                self._layout_version += 1
                many.pop(sor, None)
                one.pop(sor, None)
                if self._remote:
                    self._release(sor)
                continue
            new = out.new_token_ids
            if not new:
                continue
            g = sor.active_grammar
            if (len(new) == 1 and g is not None and (stop := g.stop_ids) is not None and new[0] not in stop
                    and sor not in one and sor not in many):
                one[sor] = new[0]
                continue
            if sor in one:  # keep the order: its earlier token first
                many[sor] = [one.pop(sor)]
            if sor._grammar is not None or sor.ready:
                many.setdefault(sor, []).extend(new)

    def _accept_queued(self) -> None:
        """Feed queued tokens: the fast path's in one batch call (no per-row bookkeeping after it:
        none of them is a stop token), the others one request at a time."""
        one, many = self._to_accept_one, self._to_accept
        if one:
            self._to_accept_one = {}
            refused = self.backend().accept_tokens_batch([sor.active_grammar for sor in one], list(one.values()))
            if refused is not None:
                for (sor, token), ok in zip(one.items(), refused, strict=True):
                    if not ok:
                        sor.accepted([], ok=False, refused=[token])
                        self.refused_ids.append(sor.request_id)
        if many:
            self._to_accept = {}
            self._layout_version += 1  # a stop token among them may end a grammar
            for sor, new in many.items():
                if not sor.advance(new):
                    self.refused_ids.append(sor.request_id)

    def take_refused(self) -> list[str]:
        """Requests whose grammar refused a token since the last call (request.accepted: never expected),
        still constrained; the engine core ends them with an error."""
        ids, self.refused_ids = self.refused_ids, []
        return [rid for rid in ids if rid in self.requests]

    def _remote_refusals(self) -> None:
        """The grammar workers' refused slots (their replies) -> refused_ids."""
        slots, self._backend.refused_slots = set(self._backend.refused_slots), []
        for rid, sor in self.requests.items():
            if sor._grammar is not None and getattr(sor._grammar, "slot", None) in slots:
                sor.refused = True
                self.refused_ids.append(rid)

    def sampling_request_ids(self, so: SchedulerOutput) -> list[str]:
        """Constrained requests that sample in this step, in batch order (the runner's row order)."""
        if not self.requests:
            return []
        if so is self._rows_of[0]:
            return self._rows_of[1]  # asked twice a step: by the engine core, then by _prepare
        requests, sampling = self.requests, so.sampling_req_ids
        ids = [r for r in so.num_scheduled_tokens if r in sampling and r in requests]
        self._rows_of = (so, ids)
        return ids

    def _take_bitmask(self, num_rows: int):
        backend = self.backend()
        if not self._bitmasks or self._bitmasks[0].shape[0] < num_rows:
            rows = max(num_rows, self.config.scheduler_config.max_num_seqs)
            pin = self.config.device_config.device == "cuda"
            self._bitmasks = [backend.allocate_bitmask(rows, pin_memory=pin) for _ in range(2)]
            self._bitmask_views = [{} for _ in range(2)]
        self._next_bitmask ^= 1
        views = self._bitmask_views[self._next_bitmask]  # the (num_rows, W) views, made once each
        view = views.get(num_rows)
        if view is None:
            view = views[num_rows] = self._bitmasks[self._next_bitmask][:num_rows]
        return view

    def _prepare(self, so: SchedulerOutput) -> tuple[Callable[[], None], GrammarOutput] | None:
        """In the caller's thread: advance by the queued tokens (one xgrammar batch call), pick the
        rows whose next token is constrained, take a bitmask. Returns the fill (a call with no
        arguments) and the output it fills; None when no row is constrained."""
        if self._gate_job is not None:
            self._wait_gate_job()
        if self._to_accept_one or self._to_accept:
            self._accept_queued()
        if self._remote and self._backend.refused_slots:
            self._remote_refusals()
        requests = self.requests
        grammars, ids = [], []
        for rid in self.sampling_request_ids(so):
            sor = requests.get(rid)
            if sor is None:
                continue  # finished by the step just collected (async scheduling had scheduled it)
            g = sor.active_grammar
            if g is None:
                g = sor.activate()
                if g is None:
                    continue
            grammars.append(g)
            ids.append(rid)
        if not ids:
            return None
        bitmask = self._take_bitmask(len(ids))
        if self._num_checked:
            self._record_checks(so, ids, bitmask)
        return self.backend().fill_job(grammars, bitmask), GrammarOutput(ids, bitmask)

    def _record_checks(self, so: SchedulerOutput, ids: list[str], bitmask: torch.Tensor) -> None:
        requests = self.requests
        rows = [(rid, i) for i, rid in enumerate(ids) if (sor := requests.get(rid)) is not None and sor.check_samples]
        if rows:
            self._checks.record(so, rows, bitmask)

    def refused_samples(self, so: SchedulerOutput, result) -> dict[str, int]:
        """At the step's collect, before the scheduler takes its tokens: the constrained rows whose
        sampled token their bitmask forbids (another mask left none the grammar allows: sample_check.py),
        request id -> token. Empty at once when no request carries such a mask."""
        if not self._num_checked:
            return {}
        gate = so.grammar_gate
        if gate is not None and gate.source is self._flags:
            self._record_checks(so, gate.request_ids, gate.bitmask)  # (a row all ones: finished or ended)
        return self._checks.refused(so, result, self.requests)

    def grammar_bitmask(self, so: SchedulerOutput) -> GrammarOutput | None:
        """The step's bitmask, computed now (in the caller's thread)."""
        job = self._prepare(so)
        if job is None:
            return None
        job[0]()
        if self._num_checked:
            self._checks.snapshot(so)  # filled now; the step may be collected after the buffer's next turn
        return job[1]

    def submit_grammar_bitmask(self, so: SchedulerOutput) -> BitmaskJob:
        """The same, its fill on the bitmask thread (fill_thread.py); `result()` waits for it. Until
        then the caller must not start another job (the grammars are the fill's); `advance`,
        `add_request`, `remove` are safe (they only queue)."""
        job = self._prepare(so)
        if job is None:
            return BitmaskJob(None, None)
        fill = job[0]
        if self._remote:  # the grammar worker (backend_process.WorkerJob): one message now, its reply in result()
            fill.send()
            return BitmaskJob(fill, job[1])
        if self._fill_thread is None:
            self._fill_thread = FillThread()
        self._fill_thread.submit(fill)
        return BitmaskJob(self._fill_thread, job[1])

    def fail_over(self) -> list[str]:
        """The grammar workers failed (GrammarBackendError), or a gate was forced open (a dead or stuck
        filler, the bitmask thread's too): every constrained request is dropped here and returned (the
        engine core finishes them as aborted: their grammars were in the workers, or in a thread that
        may never return), the worker processes ended, and constrained requests from now on get a new
        in-process bitmask thread.
        The failed backend's shared memory stays until `shutdown` (the step in flight may still read
        its bitmask and flag words: a gated copy on the device, a gated CPU step's sampling)."""
        ids = list(self.requests)
        self.requests.clear()
        self._checks.clear()
        self._num_checked = 0
        self._to_accept, self._to_accept_one = {}, {}
        self._gate_job, self._gate_layout, self._gate_rows, self._rows_of = None, None, None, (None, [])
        with self._backend_lock:
            old, self._backend, self._remote = self._backend, None, False
            self._workers_failed = True
        self._flags = None
        self._stop_gate_watchdog()
        if self._fill_thread is not None:
            # A busy thread may be the stuck filler: left to itself (a daemon), later jobs get a new one.
            if not self._fill_thread.busy:
                self._fill_thread.close()
            self._fill_thread = None
        self._bitmasks, self._bitmask_views = [], []
        if old is not None:
            retire = getattr(old, "retire", None)
            if retire is not None:
                retire()
            self._retired.append(old)  # shut down with the engine: a step in flight may read its memory
        return ids

    def shutdown(self) -> None:
        self._stop_gate_watchdog()
        if self._gate_job is not None:
            try:
                self._wait_gate_job()
            except Exception:  # noqa: BLE001 - shutting down; the job's error was the step's to report
                logger.exception("structured outputs: the last gated bitmask job failed")
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._fill_thread is not None:
            self._fill_thread.close()
            self._fill_thread = None
        if self._backend is not None:
            self._bitmasks, self._bitmask_views = [], []
            self._backend.shutdown()
        for backend in self._retired:
            backend.shutdown()
        self._retired = []


class BitmaskJob:
    """A submitted bitmask job; `result()` waits for its fill (none: the step has no constrained row)."""

    __slots__ = ("_thread", "_output")

    def __init__(self, thread: FillThread | WorkerJob | None, output: GrammarOutput | None) -> None:
        self._thread, self._output = thread, output

    def result(self) -> GrammarOutput | None:
        if self._thread is not None:
            self._thread.wait()
            self._thread = None
        return self._output
