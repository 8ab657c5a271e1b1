"""Build the model class for a config and fill its weights (checkpoint, GGUF, or dummy)."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.loader.dummy import initialize_dummy_weights
from pagedllm.loader.weights import iter_weights
from pagedllm.models.registry import resolve_model_cls

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    cls = resolve_model_cls(model_config.hf_config)
    with _default_dtype(model_config.dtype), torch.device(device):
        model = cls(model_config.hf_config)
    if model_config.load_format == "dummy":
        initialize_dummy_weights(model, seed=model_config.seed)
    else:
        model.load_weights(
            (name, t.to(device=device, dtype=model_config.dtype)) for name, t in iter_weights(
                model_config.source, model_config.load_format)
        )
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(module)
    logger.info("loaded %s (%s) on %s in %s", cls.__name__, model_config.model, device, model_config.dtype)
    return model.eval()
