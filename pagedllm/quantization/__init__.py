"""Quantization: the `QuantizationConfig` / `QuantizeMethodBase` hook and its implementations."""

from pagedllm.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
)

__all__ = [
    "LinearMethodBase",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "UnquantizedEmbeddingMethod",
    "UnquantizedLinearMethod",
]
