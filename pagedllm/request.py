"""Engine-side request state: the scheduler sees a request as (num_computed_tokens, num_tokens)."""

from __future__ import annotations

import enum
import time
from typing import Any

from pagedllm.sampling_params import SamplingParams

# What the scheduler reads of a pooling request's sampling: nothing applies (no penalties, no
# min_tokens, no seed), so every check on it stays a plain attribute read.
_POOLING_SAMPLING = SamplingParams(max_tokens=1)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after this is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # ended by the engine (vLLM's FINISHED_ERROR): finish_reason "error"

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(status)


class Request:
    def add_prompt_logprobs(self, start: int, entries: list[tuple[list[int], list[float], int]]) -> None:
        """A chunk's entries for prompt tokens start .. start + len - 1; positions already known (a prompt
        recomputed after preemption) are not added again, nor anything once they went out (None)."""
        if self.prompt_logprobs is None:
            return
        known = len(self.prompt_logprobs)  # entries for prompt tokens 1 .. known
        if start <= known + 1:
            self.prompt_logprobs.extend(entries[known + 1 - start:])

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        pooling_params: Any = None,
    ) -> None:
        self.request_id = request_id
        # A pooling request (pooling_params, no sampling_params) produces no tokens: its output is
        # pooled from its prompt's one step.
        self.sampling_params = sampling_params if sampling_params is not None else _POOLING_SAMPLING
        self.pooling_params = pooling_params
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        # len(all_token_ids) and len(output_token_ids), as plain attributes: the scheduler reads them
        # for every running request every step. append_output_token_ids (the lists' one writer)
        # keeps them in step.
        self.num_tokens = self.num_prompt_tokens
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        # Tokens sampled by a step still running on the device (async scheduling): they count as
        # known for scheduling, and become real in update_from_output.
        self.num_output_placeholders = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.cache_salt = cache_salt
        self.max_tokens = 0 if pooling_params is not None else self.sampling_params.max_tokens
        # Prefix caching: hash of each *full* block of all_token_ids, appended as blocks fill.
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1  # set at first scheduling
        # Prompt logprobs by position (entry t predicts prompt token t + 1), until sent with the first output
        # (then None: a recomputed prompt adds nothing)
        self.prompt_logprobs: list[tuple[list[int], list[float], int]] | None = (
            [] if self.sampling_params.prompt_logprobs is not None else None)
        self.num_preemptions = 0
        # The part of needs_output_history that never changes (the params are fixed by now), read
        # once per sampling step by the scheduler.
        p = self.sampling_params
        self.reads_output_history = (
            p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0
            or any(len(w) > 1 for w in p.bad_words_token_ids)  # a multi-token bad word reads the tail
        )

    @property
    def needs_output_history(self) -> bool:
        """Sampling reads this request's past outputs (penalties, min_tokens): the runner must
        hold every sampled token, so the previous step is collected before this one runs."""
        return (self.reads_output_history
                or self.num_output_tokens + self.num_output_placeholders < self.sampling_params.min_tokens)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def append_output_token_ids(self, token_id: int) -> None:
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.num_tokens += 1
        self.num_output_tokens += 1

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)
