"""The quantization hook: a `QuantizationConfig` picks a `QuantizeMethodBase` per layer.

Every linear (and embedding) layer asks its config for a method at construction time; the
method creates the layer's parameters and runs its matmul. Nothing else in a layer knows about
quantization, so a new scheme (fp8, int8, AWQ, GPTQ, GGUF) is one config + one method:

    layer.quant_method = quant_config.get_quant_method(layer, prefix) or UnquantizedLinearMethod()
    layer.quant_method.create_weights(layer, input_size_per_partition, output_partition_sizes,
                                      input_size, output_size, params_dtype, weight_loader=...)
    ...after loading: layer.quant_method.process_weights_after_loading(layer)
    forward:          layer.quant_method.apply(layer, x, bias)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.utils import set_weight_attrs


class QuantizeMethodBase(ABC):
    """How one layer stores its weights and computes with them."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, *weight_args: Any, **extra_weight_attrs: Any) -> None:
        """Register the layer's parameters (`layer.register_parameter`)."""

    @abstractmethod
    def apply(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The layer's forward computation."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack / transpose / fuse scales once all checkpoint tensors are in. Default: nothing."""
        return None


class LinearMethodBase(QuantizeMethodBase):
    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],  # this rank's rows of each fused sub-matrix, e.g. [q, k, v]
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,  # weight_loader=..., attached to every parameter created
    ) -> None: ...

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (num_tokens, input_size_per_partition) -> (num_tokens, sum(output_partition_sizes))."""


def _create_dense_weight(
    layer: nn.Module,
    input_size_per_partition: int,
    output_partition_sizes: list[int],
    params_dtype: torch.dtype,
    extra_weight_attrs: dict[str, Any],
) -> None:
    # (out, in), the nn.Linear / HF checkpoint layout, so checkpoint tensors copy in unchanged.
    weight = nn.Parameter(
        torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
        requires_grad=False,
    )
    set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
    set_weight_attrs(weight, extra_weight_attrs)
    layer.register_parameter("weight", weight)


def _dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias; decode-sized CUDA batches (a few rows) take the skinny-GEMM kernel."""
    if x.is_cuda and x.dim() == 2 and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        from pagedllm.kernels.gemv import skinny_linear, use_skinny_linear

        if use_skinny_linear(x.shape[0], weight.shape[0], weight.shape[1], x.dtype):
            return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain dense weights in the model dtype: y = x @ W.T + b."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        _create_dense_weight(layer, input_size_per_partition, output_partition_sizes, params_dtype,
                             extra_weight_attrs)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _dense_linear(x, layer.weight, bias)


class UnquantizedEmbeddingMethod(QuantizeMethodBase):
    """Dense (vocab_shard, hidden) table; `apply` serves the LM head, `embedding` the token lookup."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,  # embedding_dim
        output_partition_sizes: list[int],  # [num_embeddings_per_partition]
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        _create_dense_weight(layer, input_size_per_partition, output_partition_sizes, params_dtype,
                             extra_weight_attrs)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _dense_linear(x, layer.weight, bias)

    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_, layer.weight)


class QuantizationConfig(ABC):
    """A checkpoint's quantization settings (parsed from its config) and the per-layer method factory."""

    def __init__(self) -> None:
        # Filled from the model class (e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}) so that a
        # config listing checkpoint names ("q_proj" in an ignore list) can match fused layers.
        self.packed_modules_mapping: dict[str, list[str]] = {}

    @abstractmethod
    def get_name(self) -> str:
        """The `--quantization` name, e.g. "fp8"."""

    @abstractmethod
    def get_supported_act_dtypes(self) -> list[torch.dtype]: ...

    @classmethod
    @abstractmethod
    def get_min_capability(cls) -> int:
        """Minimum CUDA compute capability * 10 (e.g. 80 for Ampere); 0 = runs anywhere."""

    def required_capability(self) -> int:
        """The compute capability * 10 this checkpoint's layers need on CUDA (the loader refuses a GPU
        below it: loader/model_loader.check_capability). The class's floor unless a config's own
        schemes need more (compressed-tensors: FP8 schemes 89, INT8 75)."""
        return self.get_min_capability()

    @staticmethod
    @abstractmethod
    def get_config_filenames() -> list[str]:
        """Files in the model directory to read the settings from (besides config.json)."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig: ...

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for `layer` (named `prefix`, e.g. "model.layers.0.mlp.down_proj"); None = unquantized."""

    @staticmethod
    def get_from_keys(config: dict[str, Any], keys: list[str], default: Any = ...) -> Any:
        """First present key of `keys`; ValueError naming them when none is and no default given."""
        for key in keys:
            if key in config:
                return config[key]
        if default is ...:
            raise ValueError(f"quantization config has none of the keys {keys}")
        return default
