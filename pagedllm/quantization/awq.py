"""`quantization="awq"` (and vLLM's "awq_marlin" spelling): AutoAWQ's GEMM checkpoints.

config.json: {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true,
              "version": "gemm", "modules_to_not_convert": [...] | null}

Checkpoint tensors of a linear with K inputs, N outputs, groups of G (AutoAWQ's WQLinear_GEMM):

    qweight  (K, N // 8) int32   eight 4-bit values of consecutive output columns per word, in
                                 AWQ's interleaved order: nibble i (bits 4i..4i+3) of word c holds
                                 column 8c + AWQ_ORDER[i], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    qzeros   (K // G, N // 8) int32   zero points, packed the same way (no off-by-one)
    scales   (K // G, N) float16
    w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]

At load the values are unpacked and repacked along K for the W4A16 kernel (quantization/wna16.py).
Only version "gemm" with zero points is built ("gemv", "marlin", "exllama" layouts are refused).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.quantization.base import QuantizationConfig, QuantizeMethodBase
from pagedllm.quantization.utils import FLOAT_DTYPES, add_param, checked_loader, is_layer_skipped
from pagedllm.quantization.wna16 import WNA16LinearMethod, check_weight_scheme, unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """(R, C // 8) AWQ-packed int32 -> (R, C) values in column order (AWQ_ORDER undone)."""
    nibbles = unpack_int32(packed, 4, dim=1).reshape(packed.shape[0], packed.shape[1], 8)
    out = torch.empty_like(nibbles)
    out[:, :, list(AWQ_ORDER)] = nibbles  # nibble i is column AWQ_ORDER[i]
    return out.reshape(packed.shape[0], packed.shape[1] * 8)


class AWQConfig(QuantizationConfig):
    def __init__(self, weight_bits: int, group_size: int, zero_point: bool,
                 modules_to_not_convert: list[str] | None = None) -> None:
        super().__init__()
        if weight_bits != 4:
            raise ValueError(f"AWQ with {weight_bits}-bit weights is not built; AWQ checkpoints are 4-bit")
        if not zero_point:
            raise ValueError("AWQ without zero points (zero_point: false) is not built")
        check_weight_scheme(weight_bits, group_size)
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.zero_point = zero_point
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    def get_name(self) -> str:
        return "awq"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 75

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quant_config.json", "quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        version = str(cls.get_from_keys(config, ["version"], "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not built; only the GEMM layout ('gemm') is")
        return cls(int(cls.get_from_keys(config, ["w_bit", "bits"])),
                   int(cls.get_from_keys(config, ["q_group_size", "group_size"])),
                   bool(cls.get_from_keys(config, ["zero_point"], True)),
                   cls.get_from_keys(config, ["modules_to_not_convert"], None))

    @classmethod
    def default_for_dummy(cls) -> AWQConfig:
        return cls(4, 128, True)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from pagedllm.layers.linear import LinearBase

        if not isinstance(layer, LinearBase) or is_layer_skipped(prefix, self.modules_to_not_convert,
                                                                 self.packed_modules_mapping):
            return None
        return AWQLinearMethod(self.weight_bits, self.group_size)


class AWQLinearMethod(WNA16LinearMethod):
    checkpoint_params = ("qweight", "qzeros", "scales")

    def create_checkpoint_weights(self, layer: nn.Module, k: int, n: int, output_partition_sizes: list[int],
                                  group: int, params_dtype: torch.dtype, attrs: dict[str, Any]) -> None:
        self.check_outputs(layer, output_partition_sizes, 8)
        loader, p = attrs.pop("weight_loader"), layer.prefix
        # Group-wise tensors split over TP ranks by groups of inputs (`group_dims`).
        grouped = {"input_dim": 0, "group_dims": {0: group}} if self.group_size != -1 else {}
        add_param(layer, "qweight", torch.zeros(k, n // 8, dtype=torch.int32),
                  {"input_dim": 0, "output_dim": 1, "packed_dim": 1, "pack_factor": 8, **attrs,
                   "weight_loader": checked_loader(loader, f"{p}.qweight", (torch.int32,))})
        add_param(layer, "qzeros", torch.zeros(k // group, n // 8, dtype=torch.int32),
                  {**grouped, "output_dim": 1, "packed_dim": 1, "pack_factor": 8, **attrs,
                   "weight_loader": checked_loader(loader, f"{p}.qzeros", (torch.int32,))})
        add_param(layer, "scales", torch.ones(k // group, n, dtype=params_dtype),
                  {**grouped, "output_dim": 1, **attrs,
                   "weight_loader": checked_loader(loader, f"{p}.scales", FLOAT_DTYPES)})

    def _unpack(self, layer: nn.Module):
        return awq_unpack(layer.qweight.data), awq_unpack(layer.qzeros.data), layer.scales.data, None
