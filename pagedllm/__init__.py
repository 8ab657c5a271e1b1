"""pagedllm: a vLLM-style LLM inference and serving engine (paged KV cache, continuous batching)."""

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.pooling.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineArgs",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "PoolingParams",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
    "__version__",
]
