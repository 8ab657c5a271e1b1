"""The engine core's structured-output state (vLLM v1's StructuredOutputManager).

- `add_request`: the request's grammar compiles in a small thread pool, off the step loop; the
  core holds the request back from the scheduler until it is ready (a cached schema: at once).
- `advance`: after each collected step, the tokens the scheduler accepted are queued for the
  grammars. Only these tokens ever reach a grammar, so a token the scheduler dropped (a request
  finished or aborted while its step ran) never does.
- `grammar_bitmask`: before a step samples, one bitmask row per request whose next token is
  constrained: the queued tokens advance the grammars (one batch call), then the rows are filled
  (xgrammar's threads). `submit_grammar_bitmask` runs the fill on the manager's bitmask thread
  (xgrammar's C++ gives up the GIL), so with async scheduling the engine core schedules the next
  step while it runs and samples only when the next forward is launched (engine_core.py).

Rows whose next token is free (the reasoning text, a grammar already ended) get no row: the mask
is applied to constrained rows only. A step with none samples unmasked (GrammarOutput None).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from pagedllm import envs
from pagedllm.structured_output.backend_types import StructuredOutputBackend
from pagedllm.structured_output.bitmask import GrammarOutput
from pagedllm.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.sched_output import EngineCoreOutput, SchedulerOutput
    from pagedllm.request import Request

logger = logging.getLogger(__name__)


def make_backend(tokenizer, vocab_size: int) -> StructuredOutputBackend:
    from pagedllm.structured_output.backend_xgrammar import XgrammarBackend

    # xgrammar's compile and batch-fill threads: half the host's cores, 2 to 8 (the fill must stay
    # well under a GPU decode step), unless PAGEDLLM_XGRAMMAR_THREADS says.
    threads = envs.PAGEDLLM_XGRAMMAR_THREADS or max(2, min(8, (os.cpu_count() or 2) // 2))
    return XgrammarBackend(tokenizer, vocab_size, max_threads=threads)


class StructuredOutputManager:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.requests: dict[str, StructuredOutputRequest] = {}
        # Accepted tokens not yet fed to their grammar, in order (the next bitmask job feeds them).
        self._to_accept: dict[StructuredOutputRequest, list[int]] = {}
        self._fill_thread: ThreadPoolExecutor | None = None
        # Pinned host bitmasks, reused in turn: a step's copy to the device is queued when it
        # samples and has run when that step is collected, before the buffer's next turn (2 steps on).
        self._bitmasks: list = []
        self._next_bitmask = 0

    def backend(self) -> StructuredOutputBackend:
        """Built on first use (the core loads a tokenizer only if a request needs a grammar)."""
        with self._backend_lock:
            if self._backend is None:
                from pagedllm.engine.llm_engine import load_tokenizer

                tokenizer = load_tokenizer(self.config)
                if tokenizer is None:
                    raise ValueError("structured outputs need a tokenizer; this engine has none (skip_tokenizer_init).")
                self._backend = make_backend(tokenizer, self.config.model_config.vocab_size)
            return self._backend

    def add_request(self, request: Request) -> StructuredOutputRequest:
        params = request.sampling_params.structured_outputs
        assert params is not None
        stop_ids = sorted(request.sampling_params.all_stop_token_ids)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="pagedllm-grammar")
        future = self._pool.submit(lambda: self.backend().compile_grammar(params, stop_ids))
        sor = StructuredOutputRequest(request.request_id, params, future)
        self.requests[request.request_id] = sor
        return sor

    def remove(self, request_ids) -> None:
        for rid in request_ids:
            sor = self.requests.pop(rid, None)
            if sor is not None:
                self._to_accept.pop(sor, None)

    def advance(self, outputs: list[EngineCoreOutput]) -> None:
        """Queue each constrained request's accepted tokens for its grammar; forget finished ones."""
        if not self.requests:
            return
        requests, to_accept = self.requests, self._to_accept
        for out in outputs:  # every constrained row, every step: attribute reads, no property calls
            sor = requests.get(out.request_id)
            if sor is None:
                continue
            if out.finish_reason is not None:
                del requests[out.request_id]
                to_accept.pop(sor, None)
            elif out.new_token_ids and (sor._grammar is not None or sor.ready):
                to_accept.setdefault(sor, []).extend(out.new_token_ids)

    def _accept_queued(self, queued: dict[StructuredOutputRequest, list[int]]) -> None:
        """Feed queued tokens: one batch call for the requests with one token past the reasoning (a
        decode step), one call each for the others (a request collected twice before a fill).
        The batch's bookkeeping is inline: this loop runs over every constrained row every step."""
        singles: list[StructuredOutputRequest] = []
        tokens: list[int] = []
        for sor, new in queued.items():
            if len(new) == 1 and sor.reasoning_ended:
                if not sor.ended:
                    singles.append(sor)
                    tokens.append(new[0])
                continue
            grammar_tokens = sor.grammar_tokens(new)
            if grammar_tokens:
                sor.accepted(grammar_tokens, sor.grammar.accept_tokens(grammar_tokens))
        if not singles:
            return
        grammars = [sor.grammar for sor in singles]
        refused = self.backend().accept_tokens_batch(grammars, tokens)
        for sor, grammar, token in zip(singles, grammars, tokens, strict=True):
            sor.num_accepted += 1
            if grammar.may_terminate(token):
                sor.ended = grammar.is_terminated()
        if refused is not None:
            for sor, token, ok in zip(singles, tokens, refused, strict=True):
                if not ok:
                    sor.accepted([], ok=False, refused=[token])

    def sampling_request_ids(self, so: SchedulerOutput) -> list[str]:
        """Constrained requests that sample in this step, in batch order (the runner's row order)."""
        if not self.requests:
            return []
        return [r for r in so.num_scheduled_tokens if r in so.sampling_req_ids and r in self.requests]

    def _take_bitmask(self, num_rows: int):
        backend = self.backend()
        if not self._bitmasks or self._bitmasks[0].shape[0] < num_rows:
            rows = max(num_rows, self.config.scheduler_config.max_num_seqs)
            pin = self.config.device_config.device == "cuda"
            self._bitmasks = [backend.allocate_bitmask(rows, pin_memory=pin) for _ in range(2)]
        self._next_bitmask ^= 1
        return self._bitmasks[self._next_bitmask][:num_rows]

    def _prepare(self, so: SchedulerOutput) -> tuple[list, torch.Tensor, list[str]] | None:
        """In the caller's thread: advance by the queued tokens (one xgrammar batch call),
        pick the rows whose next token is constrained, take a bitmask. None when no row is."""
        queued, self._to_accept = self._to_accept, {}
        if queued:
            self._accept_queued(queued)
        sors = [sor for rid in self.sampling_request_ids(so) if (sor := self.requests[rid]).constrains_next]
        if not sors:
            return None
        return [sor.grammar for sor in sors], self._take_bitmask(len(sors)), [sor.request_id for sor in sors]

    def _fill(self, grammars: list, bitmask: torch.Tensor, ids: list[str]) -> GrammarOutput:
        self.backend().fill_bitmasks(grammars, bitmask, list(range(len(ids))))
        return GrammarOutput(ids, bitmask)

    def grammar_bitmask(self, so: SchedulerOutput) -> GrammarOutput | None:
        """The step's bitmask, computed now (in the caller's thread)."""
        job = self._prepare(so)
        return None if job is None else self._fill(*job)

    def submit_grammar_bitmask(self, so: SchedulerOutput) -> Future[GrammarOutput | None]:
        """The same, its fill on the bitmask thread. Until its result is taken, the caller must not
        start another job (the grammars are the fill's); `advance`, `add_request`, `remove` are safe.

        Why only the fill, and why the hand-shake: the thread needs the GIL to start and to finish.
        While this thread runs Python (output processing, scheduling), a thread waiting for the GIL
        gets it only after the switch interval (5 ms), so Python work on the bitmask thread would
        run after the step loop blocks, not beside it. Here this thread waits (GIL released) until
        the bitmask thread is inside xgrammar's fill, which runs without the GIL; its one Python
        line after the fill runs when the step loop asks for the result."""
        job = self._prepare(so)
        done: Future[GrammarOutput | None] = Future()
        if job is None:
            done.set_result(None)
            return done
        if self._fill_thread is None:
            self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-bitmask")
        started = threading.Event()

        def fill() -> GrammarOutput:
            started.set()  # this thread keeps the GIL until the fill gives it up
            return self._fill(*job)

        future = self._fill_thread.submit(fill)
        started.wait()
        return future

    def shutdown(self) -> None:
        for pool in (self._pool, self._fill_thread):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
