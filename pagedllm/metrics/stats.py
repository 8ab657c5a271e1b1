"""What the frontend measures per batch of engine outputs, for the Prometheus exporter.

The engine core reports its own state (`SchedulerStats`: running / waiting, KV usage, cumulative
preemptions and prefix-cache counters). Times seen by a client (first token, gaps between tokens,
end to end) are measured where outputs reach the frontend, so they are gathered here, one
`IterationStats` per batch of `EngineCoreOutput`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class FinishedRequestStats:
    """One finished sequence (a core request: with n > 1 every choice is one)."""

    finish_reason: str  # "stop" | "length" | "abort"
    e2e_latency: float  # seconds from arrival to the last token
    num_generation_tokens: int
    num_prompt_tokens: int = 0
    # From the first token to the last (vLLM's decode time), and from arrival (or the first
    # scheduling, when the frontend knows it) to the first token (its prefill time).
    prefill_time: float = 0.0
    decode_time: float = 0.0
    max_tokens_param: int | None = None
    n_param: int = 1
    request_id: str = ""  # the engine's id of the sequence (the web console lists recent requests)

    @classmethod
    def from_state(cls, st: Any, now: float) -> FinishedRequestStats:
        """From an OutputProcessor RequestState that just finished (engine/output_processor.py)."""
        m = st.metrics
        start = m.first_scheduled_time if m.first_scheduled_time is not None else m.arrival_time
        first = m.first_token_time if m.first_token_time is not None else now
        parent = getattr(st, "parent", None)
        return cls(
            finish_reason=st.finish_reason,
            e2e_latency=now - m.arrival_time,
            num_generation_tokens=len(st.token_ids),
            num_prompt_tokens=len(st.prompt_token_ids),
            prefill_time=max(0.0, first - start),
            decode_time=max(0.0, now - first),
            max_tokens_param=st.params.max_tokens if st.params is not None else None,  # None: pooling
            n_param=parent.n if parent is not None else 1,
            request_id=st.request_id,
        )


@dataclass
class IterationStats:
    # Prompt tokens of prompts that produced their first token in this batch (counted once per
    # prompt, as `usage.prompt_tokens` counts them, whatever n is).
    num_prompt_tokens: int = 0
    # Tokens delivered to live requests (tokens a request made after it was stopped are not counted).
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (
            self.num_prompt_tokens
            or self.num_generation_tokens
            or self.time_to_first_tokens
            or self.inter_token_latencies
            or self.queue_times
            or self.finished_requests
        )
