"""`quantization="fp8"`: FP8 (e4m3) checkpoints, or online FP8 of a bf16/fp32 checkpoint.

config.json of an FP8 checkpoint (vLLM's "fp8" format, as written by AutoFP8 / vLLM's tools):

    "quantization_config": {"quant_method": "fp8", "activation_scheme": "static" | "dynamic",
                            "ignored_layers": ["lm_head", ...], "weight_block_size": [128, 128]}

Weight scales may be per tensor or per output channel (`weight_scale`, quantization/w8a8.py), or, with
`weight_block_size` [block_n, block_k] (DeepSeek-V3, Qwen3-FP8), one per block of the weight
(`weight_scale_inv`, quantization/fp8_block.py). Block-wise scales need activation_scheme "dynamic"
(vLLM's rule: activations are quantized per token and group of block_k inputs) and fp8 weights in the
checkpoint (online `quantization="fp8"` of a bf16 checkpoint stays per channel); block-wise MoE experts
are refused by name: not built. MoE experts (`FusedMoE`) otherwise: quantization/fp8_moe.py
(per-expert scales, W8A16).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.kernels.scaled_mm import FP8_DTYPE
from pagedllm.quantization.base import QuantizationConfig, QuantizeMethodBase
from pagedllm.quantization.fp8_block import Fp8BlockLinearMethod, parse_block
from pagedllm.quantization.fp8_moe import Fp8MoEMethod
from pagedllm.quantization.utils import is_layer_skipped
from pagedllm.quantization.w8a8 import W8A8LinearMethod

ACTIVATION_SCHEMES = ("static", "dynamic")


class Fp8Config(QuantizationConfig):
    def __init__(self, is_checkpoint_fp8_serialized: bool = True, activation_scheme: str = "dynamic",
                 ignored_layers: list[str] | None = None, weight_block_size: Any = None) -> None:
        super().__init__()
        if activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"fp8 activation_scheme must be one of {ACTIVATION_SCHEMES}, got {activation_scheme!r}")
        if not is_checkpoint_fp8_serialized and activation_scheme == "static":
            raise ValueError("online fp8 (a checkpoint without fp8 weights) needs activation_scheme 'dynamic'")
        self.weight_block_size = None if weight_block_size is None else \
            parse_block(weight_block_size, "fp8 weight_block_size")
        if self.weight_block_size is not None:
            if not is_checkpoint_fp8_serialized:
                raise ValueError(f"fp8 weight_block_size={list(self.weight_block_size)} needs fp8 weights in the "
                                 "checkpoint (quant_method 'fp8'); online fp8 quantizes per output channel")
            if activation_scheme != "dynamic":
                raise ValueError(f"fp8 weight_block_size={list(self.weight_block_size)} (block-wise weight scales) "
                                 f"needs activation_scheme 'dynamic', got {activation_scheme!r}: block-wise "
                                 "activations are quantized per token group at run time (as vLLM requires)")
        self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized
        self.activation_scheme = activation_scheme
        self.ignored_layers = list(ignored_layers or [])

    def get_name(self) -> str:
        return "fp8"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 89  # FP8 tensor cores (Ada, Hopper); the CPU path runs anywhere

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        serialized = "fp8" in str(cls.get_from_keys(config, ["quant_method"], "fp8"))
        return cls(serialized, cls.get_from_keys(config, ["activation_scheme"], "dynamic"),
                   cls.get_from_keys(config, ["ignored_layers", "modules_to_not_convert"], None),
                   config.get("weight_block_size"))

    @classmethod
    def default_for_dummy(cls) -> Fp8Config:
        return cls(is_checkpoint_fp8_serialized=False)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from pagedllm.layers.fused_moe.layer import FusedMoE
        from pagedllm.layers.linear import LinearBase

        if not isinstance(layer, LinearBase | FusedMoE) or is_layer_skipped(prefix, self.ignored_layers,
                                                                            self.packed_modules_mapping):
            return None
        if isinstance(layer, FusedMoE):  # the routed experts (the router gate stays dense, as vLLM's)
            if self.weight_block_size is not None:
                raise ValueError(f"fp8 checkpoint with weight_block_size={list(self.weight_block_size)}: block-wise "
                                 f"scales of MoE experts ({prefix}, a FusedMoE layer) are not built; the linears' "
                                 "are, and per-tensor expert scales are")
            return Fp8MoEMethod(self.is_checkpoint_fp8_serialized, self.activation_scheme == "static")
        if self.weight_block_size is not None:
            return Fp8BlockLinearMethod(self.weight_block_size)
        return W8A8LinearMethod(FP8_DTYPE, static_input=self.activation_scheme == "static",
                                serialized=self.is_checkpoint_fp8_serialized)
