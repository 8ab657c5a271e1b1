"""What the pooling APIs return: vLLM's PoolingRequestOutput and its embed / classify / score views,
and the output processor's per-request state for a pooling request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import RequestOutputKind


@dataclass
class PoolingOutput:
    data: torch.Tensor  # (dims,) embedding / (num_labels,) scores / (tokens, hidden) for ALL pooling


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = out.outputs.data
        if data.dim() != 1:
            raise ValueError(f"an embedding is one vector; this pooler gave shape {tuple(data.shape)}.")
        return cls(out.request_id, EmbeddingOutput(data.tolist()), out.prompt_token_ids, out.finished)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, ClassificationOutput(out.outputs.data.reshape(-1).tolist()),
                   out.prompt_token_ids, out.finished)


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


class PoolingRequestState:
    """The output processor's state of one pooling request: no tokens, one final output."""

    parent = None
    index = 0
    output_kind = RequestOutputKind.FINAL_ONLY
    params = None  # no SamplingParams: the finished-request metrics read max_tokens as None

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.data: torch.Tensor | None = None

    def add(self, out: EngineCoreOutput) -> None:
        self.finish_reason = out.finish_reason
        self.data = out.pooling_output
        if self.finish_reason is not None:
            self.metrics.finished_time = time.time()

    def make_output(self) -> PoolingRequestOutput | None:
        if self.finish_reason is None:
            return None
        if self.data is None:  # aborted: nothing was pooled
            return PoolingRequestOutput(self.request_id, PoolingOutput(torch.empty(0)), self.prompt_token_ids,
                                        True, self.prompt, self.metrics)
        return PoolingRequestOutput(self.request_id, PoolingOutput(self.data), self.prompt_token_ids, True,
                                    self.prompt, self.metrics)
