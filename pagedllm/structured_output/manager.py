"""The engine core's structured-output state (vLLM v1's StructuredOutputManager).

- `add_request`: the request's grammar compiles in a small thread pool, off the step loop; the
  core holds the request back from the scheduler until it is ready (a cached schema: at once).
- `advance`: after each collected step, the tokens the scheduler accepted advance the grammars.
  This is the only place grammars move, so a token the scheduler dropped (a request finished or
  aborted while its step ran) never reaches one.
- `grammar_bitmask`: before a step samples, one bitmask row per constrained request that samples,
  filled on the host from grammars that have seen every earlier token (the core collects the step
  in flight first; the device meanwhile runs this step's forward pass).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

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

    # xgrammar's compile and batch-fill threads: half the host's cores, 2 to 8 (a 64-row fill takes
    # ~0.8 ms on one thread; it must stay well under a GPU decode step).
    threads = max(2, min(8, (os.cpu_count() or 2) // 2))
    return XgrammarBackend(tokenizer, vocab_size, max_threads=threads)


class StructuredOutputManager:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.requests: dict[str, StructuredOutputRequest] = {}

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
            self.requests.pop(rid, None)

    def advance(self, outputs: list[EngineCoreOutput]) -> None:
        """Feed each constrained request the tokens the scheduler accepted; forget finished ones."""
        if not self.requests:
            return
        for out in outputs:
            sor = self.requests.get(out.request_id)
            if sor is None:
                continue
            if out.new_token_ids and sor.ready:
                sor.advance(out.new_token_ids)
            if out.finished:
                del self.requests[out.request_id]

    def sampling_request_ids(self, so: SchedulerOutput) -> list[str]:
        """Constrained requests that sample in this step, in batch order (the runner's row order)."""
        if not self.requests:
            return []
        return [r for r in so.num_scheduled_tokens if r in so.sampling_req_ids and r in self.requests]

    def grammar_bitmask(self, so: SchedulerOutput) -> GrammarOutput | None:
        ids = self.sampling_request_ids(so)
        if not ids:
            return None
        backend = self.backend()
        bitmask = backend.allocate_bitmask(len(ids), pin_memory=self.config.device_config.device == "cuda")
        rows, grammars = [], []
        for i, rid in enumerate(ids):
            sor = self.requests[rid]
            if sor.constrains_next:
                rows.append(i)
                grammars.append(sor.grammar)
        backend.fill_bitmasks(grammars, bitmask, rows)
        return GrammarOutput(ids, bitmask)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
