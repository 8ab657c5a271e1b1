"""pagedllm: a vLLM-style LLM inference and serving engine (paged KV cache, continuous batching).

The public names are imported on first use (as vLLM's package does), so `import pagedllm` costs
nothing: the command line starts its engine's fork server before torch loads (entrypoints/cli.py),
and AsyncLLM (which brings msgspec, the server's wire format) never loads where only the offline
path runs (the GPU benchmarks, where only torch and transformers are).
"""

from typing import TYPE_CHECKING

from pagedllm._lazy import lazy_exports

if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.inputs import PromptType, TextPrompt, TokensPrompt
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

# public name -> the module that defines it
_MODULES = {
    "LLM": "pagedllm.entrypoints.llm",
    "AsyncLLM": "pagedllm.engine.async_llm",
    "EngineArgs": "pagedllm.engine.arg_utils",
    "SamplingParams": "pagedllm.sampling_params",
    "TextPrompt": "pagedllm.inputs",
    "TokensPrompt": "pagedllm.inputs",
    "PromptType": "pagedllm.inputs",
    "RequestOutputKind": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "PoolingParams": "pagedllm.pooling.params",
    "PoolingRequestOutput": "pagedllm.pooling.outputs",
    "EmbeddingRequestOutput": "pagedllm.pooling.outputs",
    "ClassificationRequestOutput": "pagedllm.pooling.outputs",
    "ScoringRequestOutput": "pagedllm.pooling.outputs",
}


__getattr__, __dir__ = lazy_exports(__name__, _MODULES, globals())

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineArgs",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
    "PromptType",
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
