"""What `LLM.generate` returns and `AsyncLLM.generate` streams: vLLM's output shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

# One generated position's logprobs: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, "Logprob"]]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    lora_request: None = field(default=None, repr=False)  # vLLM's field: no LoRA adapters are built

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = field(default=None, repr=False)
    # vLLM's fields for what is not built (LoRA, encoder-decoder and multimodal models): always empty,
    # there for scripts that read them.
    lora_request: None = field(default=None, repr=False)
    encoder_prompt: str | None = field(default=None, repr=False)
    encoder_prompt_token_ids: list[int] | None = field(default=None, repr=False)
    multi_modal_placeholders: dict = field(default_factory=dict, repr=False)
