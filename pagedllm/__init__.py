"""pagedllm: a vLLM-style LLM inference and serving engine (paged KV cache, continuous batching)."""

from typing import TYPE_CHECKING, Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.async_llm import AsyncLLM

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # AsyncLLM (the server's engine) brings msgspec, its wire format, in: imported on first use, so
    # the offline LLM path (and the GPU benchmarks) runs where only torch and transformers are.
    if name == "AsyncLLM":
        from pagedllm.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineArgs",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "__version__",
]
