"""Build the model class for a config and fill its weights (checkpoint, GGUF, or dummy)."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.loader.dummy import initialize_dummy_weights
from pagedllm.loader.weights import iter_weights
from pagedllm.models.registry import resolve_model_cls
from pagedllm.quantization.base import QuantizationConfig
from pagedllm.quantization.kv_cache import take_kv_scales

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def check_capability(config: QuantizationConfig, device: torch.device) -> None:
    """ValueError, before any weight is read, when the CUDA device is older than the method needs: an
    FP8 checkpoint on an A100 (sm_80) would otherwise load and then fail inside its first FP8 GEMM
    (Triton: fp8e4nv not supported; torch._scaled_mm: sm_89+). FP8's weight-only GEMV would run a
    1-16-row decode there, but every prefill takes an FP8 GEMM, so no batch size is exempt.
    The CPU runs every method (its torch references)."""
    if device.type != "cuda":
        return
    need = config.required_capability()
    major, minor = torch.cuda.get_device_capability(device)
    have = major * 10 + minor
    if have < need:
        raise ValueError(
            f"quantization {config.get_name()!r} needs a GPU of compute capability {need // 10}.{need % 10} or "
            f"newer (get_min_capability: {need}); {device} has {major}.{minor} ({have}). Use a checkpoint of a "
            "method this GPU runs (each QuantizationConfig's get_min_capability), or a newer GPU."
        )


def get_quant_config(model_config: ModelConfig, device: torch.device) -> QuantizationConfig | None:
    """The quantization config the model is built with (None: dense weights in model_config.dtype);
    refused on a CUDA device older than the method's minimum (check_capability)."""
    from pagedllm.quantization.gguf import select_gguf_config
    from pagedllm.quantization.registry import build_quant_config

    if model_config.quantization not in (None, "gguf"):
        config = build_quant_config(model_config.quantization, model_config.hf_config, model_config.load_format)
        check_capability(config, device)
        logger.info("quantization: %s", config.get_name())
        return config
    config = select_gguf_config(model_config, device)
    if config is not None:
        check_capability(config, device)
    return config


def load_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    cls = resolve_model_cls(model_config.hf_config)
    quant_config = get_quant_config(model_config, device)
    if quant_config is not None:
        # Lets the config match checkpoint names (q_proj) to fused layers (qkv_proj).
        quant_config.packed_modules_mapping = dict(getattr(cls, "packed_modules_mapping", {}))
    with _default_dtype(model_config.dtype), torch.device(device):
        model = cls(model_config.hf_config, quant_config=quant_config)
    if model_config.load_format == "dummy":
        initialize_dummy_weights(model, seed=model_config.seed)
    else:
        # A config that computes on a checkpoint's quantized blocks names the tensors it takes raw.
        names_fn = getattr(quant_config, "quantized_weight_names", None)
        keep_quantized, skip_dense = names_fn(model) if names_fn is not None else ((), ())
        # Tensor-parallel ranks read only their slices of each safetensors tensor.
        lazy = get_tp_group().world_size > 1
        weights = iter_weights(model_config.source, model_config.load_format, keep_quantized=keep_quantized,
                               skip_dense=skip_dense, lazy=lazy)
        # Tensors keep their checkpoint dtype here: each parameter's loader copies (and so casts) into
        # the parameter's own dtype, and quantized ones check theirs (fp8 must not become bf16 on the way).
        weights = take_kv_scales(model, weights)  # fp8 KV-cache scales go to the attention layers
        model.load_weights((name, t.to(device)) for name, t in weights)
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(module)
    logger.info("loaded %s (%s) on %s in %s", cls.__name__, model_config.model, device, model_config.dtype)
    return model.eval()
