"""`quantization="fp8"`: FP8 (e4m3) checkpoints, or online FP8 of a bf16/fp32 checkpoint.

config.json of an FP8 checkpoint (vLLM's "fp8" format, as written by AutoFP8 / vLLM's tools):

    "quantization_config": {"quant_method": "fp8", "activation_scheme": "static" | "dynamic",
                            "ignored_layers": ["lm_head", ...]}

Weight scales may be per tensor or per output channel; `weight_block_size` (DeepSeek-style
128x128 block scales) is refused by name: not built (for MoE experts too). Methods: the linears
quantization/w8a8.py; MoE experts (`FusedMoE`) quantization/fp8_moe.py (per-expert scales, W8A16).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.kernels.scaled_mm import FP8_DTYPE
from pagedllm.quantization.base import QuantizationConfig, QuantizeMethodBase
from pagedllm.quantization.fp8_moe import Fp8MoEMethod
from pagedllm.quantization.utils import is_layer_skipped
from pagedllm.quantization.w8a8 import W8A8LinearMethod

ACTIVATION_SCHEMES = ("static", "dynamic")


class Fp8Config(QuantizationConfig):
    def __init__(self, is_checkpoint_fp8_serialized: bool = True, activation_scheme: str = "dynamic",
                 ignored_layers: list[str] | None = None) -> None:
        super().__init__()
        if activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"fp8 activation_scheme must be one of {ACTIVATION_SCHEMES}, got {activation_scheme!r}")
        if not is_checkpoint_fp8_serialized and activation_scheme == "static":
            raise ValueError("online fp8 (a checkpoint without fp8 weights) needs activation_scheme 'dynamic'")
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
        if config.get("weight_block_size") is not None:
            raise ValueError(
                f"fp8 checkpoint with weight_block_size={config['weight_block_size']} (block-wise weight "
                "scales) is not built; per-tensor and per-channel weight scales are."
            )
        serialized = "fp8" in str(cls.get_from_keys(config, ["quant_method"], "fp8"))
        return cls(serialized, cls.get_from_keys(config, ["activation_scheme"], "dynamic"),
                   cls.get_from_keys(config, ["ignored_layers", "modules_to_not_convert"], None))

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
            return Fp8MoEMethod(self.is_checkpoint_fp8_serialized, self.activation_scheme == "static")
        return W8A8LinearMethod(FP8_DTYPE, static_input=self.activation_scheme == "static",
                                serialized=self.is_checkpoint_fp8_serialized)
