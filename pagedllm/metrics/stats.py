"""What the frontend measures per batch of engine outputs, for the Prometheus exporter.

The engine core reports its own state (`SchedulerStats`: running / waiting, KV usage, cumulative
preemptions and prefix-cache counters). Times seen by a client (first token, gaps between tokens,
end to end) are measured where outputs reach the frontend, so they are gathered here, one
`IterationStats` per batch of `EngineCoreOutput`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    """One finished sequence (a core request: with n > 1 every choice is one)."""

    finish_reason: str  # "stop" | "length" | "abort"
    e2e_latency: float  # seconds from arrival to the last token
    num_generation_tokens: int
    request_id: str = ""  # the caller's id (the web console lists recent requests)
    num_prompt_tokens: int = 0


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
