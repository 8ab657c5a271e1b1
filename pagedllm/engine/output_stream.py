"""Per-request delivery on the asyncio side of AsyncLLM: a mailbox that merges deltas, and the
async iterator a caller reads (aborting the request when the caller goes away)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """Mailbox between the output handler and one request's consumer.

    With DELTA outputs a slow consumer does not make a queue grow: new deltas merge into the one
    pending output (text and tokens appended), so what waits for a consumer is at most the request's
    own tokens and text (max_tokens per choice), never a queue of outputs.
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


@dataclass
class LiveRequest:
    """A request between add_request and its final output (or abort), as the event loop sees it."""

    request_id: str  # the caller's id
    internal_id: str  # unique for this engine's lifetime; the parent id of n > 1 children
    core_ids: list[str]
    collector: RequestOutputCollector
    arrival_time: float = 0.0  # for the e2e latency of an aborted request's stats


class RequestOutputStream:
    """Async iterator over one request's outputs; aborting it (or dropping out of the loop through
    an exception or cancellation) aborts the request in the engine and frees its KV blocks.
    `on_abort` (AsyncLLM's) does that; the stream knows nothing else of the engine."""

    def __init__(self, live: LiveRequest, on_abort: Callable[[LiveRequest], None]) -> None:
        self.on_abort = on_abort
        self.live = live
        self.request_id = live.request_id
        self.collector = live.collector
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
        # A pooling request's outputs is one PoolingOutput, never ended with an error this way.
        for c in out.outputs if isinstance(out.outputs, list) else ():
            if c.finish_reason == "error":
                # The engine ended this sequence (e.g. its grammar and its other token masks left nothing
                # to sample: structured_output/sample_check.py); stop_reason holds why. Raised, as the
                # server answers it (a 400, or a stream's error event): vLLM's serving layer raises on
                # finish_reason "error" too. The request's other sequences (n > 1) are aborted.
                self.abort()
                raise ValueError(str(c.stop_reason or "the engine ended the request with an error"))
        if out.finished:
            self.finished = True
        return out

    def abort(self) -> None:
        """Idempotent; a no-op once the request finished."""
        if not self.finished:
            self.finished = True
            self.on_abort(self.live)

    async def aclose(self) -> None:
        self.abort()
