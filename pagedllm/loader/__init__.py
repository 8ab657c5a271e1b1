"""Model loading: resolve a model argument, load its tokenizer, iterate its weights under HF names.

The names below are imported on first use: the engine process unpickles its config's ModelSource
(loader/source.py) and must not import the tokenizer's side of transformers with it (AutoTokenizer
brings transformers' generation and model-auto modules: seconds; BENCHMARKS.md, issue 16 cold start).
"""

from typing import TYPE_CHECKING

from pagedllm._lazy import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, _MODULES, globals())

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
