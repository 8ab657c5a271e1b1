"""Engine-side request state: the scheduler sees a request as (num_computed_tokens, num_tokens)."""

from __future__ import annotations

import enum
import time

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after this is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(status)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by a step still running on the device (async scheduling): they count as
        # known for scheduling, and become real in update_from_output.
        self.num_output_placeholders = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.cache_salt = cache_salt
        self.max_tokens = sampling_params.max_tokens
        # Prefix caching: hash of each *full* block of all_token_ids, appended as blocks fill.
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1  # set at first scheduling
        self.num_preemptions = 0

    @property
    def needs_output_history(self) -> bool:
        """Sampling reads this request's past outputs (penalties, min_tokens): the runner must
        hold every sampled token, so the previous step is collected before this one runs."""
        p = self.sampling_params
        return (
            p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0
            or self.num_output_tokens + self.num_output_placeholders < p.min_tokens
            or any(len(w) > 1 for w in p.bad_words_token_ids)  # a multi-token bad word reads the tail
        )

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self._all_token_ids) + self.num_output_placeholders

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def append_output_token_ids(self, token_id: int) -> None:
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)
