"""Model loading: resolve a model argument, load its tokenizer, iterate its weights under HF names.

The names below are imported on first use: the engine process unpickles its config's ModelSource
(loader/source.py) and must not import the tokenizer's side of transformers with it (AutoTokenizer
brings transformers' generation and model-auto modules: seconds; BENCHMARKS.md, issue 16 cold start).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.loader.dummy import initialize_dummy_weights
    from pagedllm.loader.gguf_weights import gguf_to_hf_name, gguf_weights_iterator, reverse_permute_qk
    from pagedllm.loader.source import ModelSource, available_presets, default_model_path, resolve_model
    from pagedllm.loader.tokenizer import get_tokenizer
    from pagedllm.loader.weights import (
        LOAD_FORMATS,
        iter_weights,
        resolve_load_format,
        safetensors_weights_iterator,
    )

# name -> the module that defines it
_MODULES = {
    "initialize_dummy_weights": "pagedllm.loader.dummy",
    "gguf_to_hf_name": "pagedllm.loader.gguf_weights",
    "gguf_weights_iterator": "pagedllm.loader.gguf_weights",
    "reverse_permute_qk": "pagedllm.loader.gguf_weights",
    "ModelSource": "pagedllm.loader.source",
    "available_presets": "pagedllm.loader.source",
    "default_model_path": "pagedllm.loader.source",
    "resolve_model": "pagedllm.loader.source",
    "get_tokenizer": "pagedllm.loader.tokenizer",
    "LOAD_FORMATS": "pagedllm.loader.weights",
    "iter_weights": "pagedllm.loader.weights",
    "resolve_load_format": "pagedllm.loader.weights",
    "safetensors_weights_iterator": "pagedllm.loader.weights",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "LOAD_FORMATS",
    "ModelSource",
    "available_presets",
    "default_model_path",
    "get_tokenizer",
    "gguf_to_hf_name",
    "gguf_weights_iterator",
    "initialize_dummy_weights",
    "iter_weights",
    "resolve_load_format",
    "resolve_model",
    "reverse_permute_qk",
    "safetensors_weights_iterator",
]
