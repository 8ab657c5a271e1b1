"""Turns EngineCoreOutputs (token ids) into RequestOutputs (text, logprobs, finish reasons).

Shared by LLMEngine and AsyncLLM. Requests with n > 1 run as n child requests in the core
(`"{index}_{parent_id}"`); a ParentRequest gathers them back into one RequestOutput.

With `isolate_failures` (AsyncLLM: one processor serves every stream) a request whose output cannot
be processed (its detokenizer raises on a token, say) is dropped and kept in `take_failed()` for the
caller to fail; the other requests of the batch get their outputs. Without it (LLMEngine) the
exception propagates to the caller of `step()`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

@dataclass
class ParentRequest:
    request_id: str
    n: int
    output_kind: RequestOutputKind
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0

    def child_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"


class RequestState:
    def __init__(
        self,
        request_id: str,
        parent: ParentRequest | None,
        index: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.parent = parent
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.output_kind = params.output_kind
        self._delta = params.output_kind == RequestOutputKind.DELTA
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop, params.include_stop_str_in_output,
                params.spaces_between_special_tokens,
            )
            if tokenizer is not None and params.detokenize
            else None
        )
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.num_sent_tokens = 0
        self.num_sent_logprobs = 0
        self.num_cached_tokens = 0
        # vLLM's RequestOutput.prompt_logprobs: None for the first prompt token, then one dict each
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.prompt_logprobs_sent = False  # DELTA outputs carry them once, in the first
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def _decode_token(self, tok: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([tok], skip_special_tokens=False)

    def _logprob_entry(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        """One position's {token: Logprob}: column 0 the sampled (or prompt) token with its rank, then the
        top k by rank 1..k (column 0's token may repeat among them: kept once, with its own rank)."""
        entry: dict[int, Logprob] = {}
        for j, (t, lp) in enumerate(zip(ids, lps)):
            if t not in entry:
                entry[t] = Logprob(lp, rank if j == 0 else j, self._decode_token(t))
        return entry

    def add(self, out: EngineCoreOutput) -> str | None:
        """Apply one core output; returns a stop string if the text hit one."""
        now = time.time()
        metrics = self.metrics
        if metrics.first_token_time is None and out.new_token_ids:
            metrics.first_token_time = now
        metrics.last_token_time = now
        self.num_cached_tokens = out.num_cached_tokens
        self.token_ids.extend(out.new_token_ids)
        if self.logprobs is not None and out.new_logprobs:
            for ids, lps, rank in out.new_logprobs:
                self.logprobs.append(self._logprob_entry(ids, lps, rank))
                self.cumulative_logprob = (self.cumulative_logprob or 0.0) + lps[0]
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = [None] + [self._logprob_entry(*e) for e in out.prompt_logprobs]
        stop_str = None
        if self.detokenizer is not None:  # detokenize=False (the server's token-id prompts) skips it all
            text_ids = out.new_token_ids
            if out.finish_reason == "stop" and text_ids and not self.params.include_stop_str_in_output:
                # vLLM's rule: the EOS / stop token that ended the request is not part of the text (with
                # skip_special_tokens=False it would otherwise end every answer with e.g. "<|im_end|>").
                text_ids = text_ids[:-1]
            stop_str = self.detokenizer.update(text_ids)
        if stop_str is not None:
            self.finish_reason, self.stop_reason = "stop", stop_str
        elif out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if self.finish_reason is not None:
            self.metrics.finished_time = now
        return stop_str

    def completion(self) -> CompletionOutput:
        finished = self.finish_reason is not None
        delta = self._delta
        text = self.detokenizer.get_next_output_text(finished, delta) if self.detokenizer is not None else ""
        if delta:
            token_ids = self.token_ids[self.num_sent_tokens :]
            logprobs = self.logprobs[self.num_sent_logprobs :] if self.logprobs is not None else None
            self.num_sent_tokens = len(self.token_ids)
            self.num_sent_logprobs = len(self.logprobs or [])
        else:
            token_ids, logprobs = list(self.token_ids), (list(self.logprobs) if self.logprobs is not None else None)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any, isolate_failures: bool = False) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        self.isolate_failures = isolate_failures
        self._failed: dict[str, BaseException] = {}  # core id -> why its output could not be processed

    def take_failed(self) -> dict[str, BaseException]:
        """The requests dropped since the last call ({core id: error}; with isolate_failures only)."""
        failed, self._failed = self._failed, {}
        return failed

    def _drop_failed(self, request_id: str, error: Exception) -> None:
        if not self.isolate_failures:
            raise error
        logger.exception("processing the output of request %s failed; it fails alone", request_id)
        self.request_states.pop(request_id, None)
        why = RuntimeError(f"this request's output could not be processed: {type(error).__name__}: {error}")
        why.__cause__ = error
        self._failed[request_id] = why

    def add_request(self, state: RequestState) -> None:
        self.request_states[state.request_id] = state
        if state.parent is not None:
            self.parents[state.parent.request_id] = state.parent

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (parent ids expand to their children); returns the core ids to abort."""
        core_ids: list[str] = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            ids = [parent.child_id(i) for i in range(parent.n)] if parent else [rid]
            for cid in ids:
                if self.request_states.pop(cid, None) is not None:
                    core_ids.append(cid)
        return core_ids

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], dict[str, str]]:
        """Returns the RequestOutputs to deliver and {core id: stop string} the core must stop.

        `outputs` may hold several steps' outputs of one request, in step order (AsyncLLM merges the
        steps queued while the frontend was behind): each is applied in turn, and the request gets one
        RequestOutput for all of them, built after the last. Outputs after the one that finished a
        request (a stop string found in an earlier step's text) are dropped, as they would be had the
        steps come one by one."""
        stops: dict[str, str] = {}
        states = self.request_states
        touched: dict[str, RequestState] = {}  # first-seen order
        for out in outputs:
            st = states.get(out.request_id)
            if st is None:
                continue  # aborted by the frontend while the step ran, or finished in an earlier step
            try:
                stop_str = st.add(out)
            except Exception as e:  # noqa: BLE001 - this request's alone (or re-raised: _drop_failed)
                self._drop_failed(out.request_id, e)
                touched.pop(out.request_id, None)
                continue
            if stop_str is not None and not out.finished:
                stops[out.request_id] = stop_str
            if st.finish_reason is not None:
                del states[out.request_id]
            touched[out.request_id] = st
        results: list[RequestOutput] = []
        for rid, st in touched.items():
            try:
                ro = self._make_output(st, st.finish_reason is not None)
            except Exception as e:  # noqa: BLE001 - as above
                self._drop_failed(rid, e)
                continue
            if ro is not None:
                results.append(ro)
        return results, stops

    def _make_output(self, st: RequestState, finished: bool) -> RequestOutput | None:
        if not isinstance(st, RequestState):  # a pooling request (pooling/outputs.py): one final output
            return st.make_output()
        kind = st.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        comp = st.completion()
        parent = st.parent
        if parent is None:
            return self._request_output(st.request_id, st, [comp], finished)
        # n > 1: gather children under the parent's id.
        if finished:
            parent.num_finished += 1
        all_done = parent.num_finished == parent.n
        if all_done:
            self.parents.pop(parent.request_id, None)
        if kind == RequestOutputKind.DELTA:
            return self._request_output(parent.request_id, st, [comp], all_done)
        parent.completions[comp.index] = comp
        if kind == RequestOutputKind.FINAL_ONLY and not all_done:
            return None
        comps = [parent.completions[i] for i in sorted(parent.completions)]
        return self._request_output(parent.request_id, st, comps, all_done)

    @staticmethod
    def _request_output(rid: str, st: RequestState, comps: list[CompletionOutput], finished: bool) -> RequestOutput:
        prompt_lp = st.prompt_logprobs
        if prompt_lp is not None and st.output_kind == RequestOutputKind.DELTA:
            prompt_lp, st.prompt_logprobs_sent = (None if st.prompt_logprobs_sent else prompt_lp), True
        return RequestOutput(
            request_id=rid,
            prompt=st.prompt,
            prompt_token_ids=st.prompt_token_ids,
            outputs=comps,
            finished=finished,
            prompt_logprobs=prompt_lp,
            metrics=st.metrics,
            num_cached_tokens=st.num_cached_tokens,
        )
