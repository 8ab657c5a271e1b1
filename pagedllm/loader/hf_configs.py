"""transformers' config classes for the model types pagedllm serves, loaded without transformers'
auto-model machinery.

Why: a config class module (e.g. `transformers.models.llama.configuration_llama`) decorates its class
with `@auto_docstring`, which writes the class's docstring from transformers' auto-model registry
and imports it to do so: `transformers.models.auto.modeling_auto`, whose `auto_factory` brings the
generation utilities (scikit-learn), masking_utils (torch._dynamo) and FSDP (torch.distributed.tensor).
On the H200 host (transformers 5.17) that was 11.8 s of `pagedllm serve`'s start, paid by the frontend
and again by the engine process (BENCHMARKS.md, issue 16, h47). A config used for serving needs no
generated docstring, so the decorator is the identity while such a module imports
(`without_generated_docstrings`), and the class is taken directly (`config_class`) instead of
through AutoConfig, whose own module is the same registry.

This module reads no environment variable: the engine's fork server may import it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

# model_type (config.json) -> (transformers.models.<module>, config class): the class AutoConfig maps
# the type to (tests/loader/test_hf_configs.py holds the table to transformers' CONFIG_MAPPING).
CONFIG_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaConfig"),
    "mistral": ("mistral", "MistralConfig"),
    "qwen2": ("qwen2", "Qwen2Config"),
    "qwen3": ("qwen3", "Qwen3Config"),
    "mixtral": ("mixtral", "MixtralConfig"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig"),
    "gemma2": ("gemma2", "Gemma2Config"),
    "gemma3": ("gemma3", "Gemma3Config"),
    "gemma3_text": ("gemma3", "Gemma3TextConfig"),
    "phi3": ("phi3", "Phi3Config"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2Config"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config"),
    "bert": ("bert", "BertConfig"),
    "xlm-roberta": ("xlm_roberta", "XLMRobertaConfig"),
}


def _identity_docstring(obj: Any = None, **_: Any) -> Any:
    """`@auto_docstring` and `@auto_docstring(checkpoint=...)`, writing nothing."""
    return obj if obj is not None else (lambda o: o)


@contextlib.contextmanager
def without_generated_docstrings() -> Iterator[None]:
    """While this context is open, transformers modules imported for the first time get an identity
    `auto_docstring` (their classes keep their own docstrings only); restored on exit. Where this
    transformers has no such decorator, nothing changes."""
    try:
        import transformers.utils as utils

        original = utils.auto_docstring
    except (ImportError, AttributeError):
        yield
        return
    utils.auto_docstring = _identity_docstring
    try:
        yield
    finally:
        utils.auto_docstring = original


def config_class(model_type: Any) -> type | None:
    """The transformers config class for `model_type`, imported without generated docstrings; None
    for a type not in CONFIG_CLASSES or one this transformers lacks (AutoConfig then decides)."""
    entry = CONFIG_CLASSES.get(model_type) if isinstance(model_type, str) else None
    if entry is None:
        return None
    module_name = f"transformers.models.{entry[0]}.configuration_{entry[0]}"
    try:
        with without_generated_docstrings():
            return getattr(importlib.import_module(module_name), entry[1])
    except (ImportError, AttributeError):
        return None
