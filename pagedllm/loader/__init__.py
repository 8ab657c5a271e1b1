"""Model loading: resolve a model argument, load its tokenizer, iterate its weights under HF names."""

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
