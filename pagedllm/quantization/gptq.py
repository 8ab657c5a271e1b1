"""`quantization="gptq"` (and "gptq_marlin"): AutoGPTQ / GPTQModel checkpoints, 4 or 8 bit.

config.json: {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false,
              "sym": true, "checkpoint_format": "gptq"}

Checkpoint tensors of a linear with K inputs, N outputs, groups of G, pf = 32 // bits:

    qweight  (K // pf, N) int32   pf values of consecutive inputs per word, value j at bits j*bits
    qzeros   (K // G, N // pf) int32   zero points packed along N the same way; the v1 format
                                  ("checkpoint_format": "gptq", what AutoGPTQ and GPTQModel save)
                                  stores zero - 1, so a symmetric 4-bit zero of 8 is stored as 7
                                  (0x77777777); "gptq_v2" stores the zero itself
    scales   (K // G, N) float16
    g_idx    (K,) int32            group of each input; with desc_act the inputs were quantized in
                                  activation order, so groups are scattered over K
    w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

group_size -1 is one group per output channel. As vLLM, g_idx is only read with desc_act true.
Refused by name: bits other than 4 / 8, per-module "dynamic" overrides, a quantized lm_head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.quantization.base import QuantizationConfig, QuantizeMethodBase
from pagedllm.quantization.utils import FLOAT_DTYPES, add_param, checked_loader, is_layer_skipped
from pagedllm.quantization.wna16 import WNA16LinearMethod, act_order_loader, check_weight_scheme, unpack_int32

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(QuantizationConfig):
    def __init__(self, weight_bits: int, group_size: int, desc_act: bool, sym: bool = True,
                 checkpoint_format: str = "gptq", modules_to_not_convert: list[str] | None = None) -> None:
        super().__init__()
        if weight_bits not in (4, 8):
            raise ValueError(f"GPTQ with {weight_bits}-bit weights is not built; built: 4, 8")
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not built; built: {CHECKPOINT_FORMATS}")
        check_weight_scheme(weight_bits, group_size)
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.checkpoint_format = checkpoint_format
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    def get_name(self) -> str:
        return "gptq"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 60

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        if config.get("dynamic"):
            raise ValueError("GPTQ per-module 'dynamic' overrides are not built")
        if config.get("lm_head"):
            raise ValueError("GPTQ with a quantized lm_head (lm_head: true) is not built")
        fmt = cls.get_from_keys(config, ["checkpoint_format"], None)
        if fmt is None:  # older GPTQModel configs keep it in "meta" or call it "format"
            fmt = cls.get_from_keys(config, ["format"], "gptq")
        return cls(int(cls.get_from_keys(config, ["bits"])), int(cls.get_from_keys(config, ["group_size"])),
                   bool(cls.get_from_keys(config, ["desc_act"], False)), bool(cls.get_from_keys(config, ["sym"], True)),
                   str(fmt), cls.get_from_keys(config, ["modules_to_not_convert"], None))

    @classmethod
    def default_for_dummy(cls) -> GPTQConfig:
        return cls(4, 128, False)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from pagedllm.layers.linear import LinearBase

        if not isinstance(layer, LinearBase) or is_layer_skipped(prefix, self.modules_to_not_convert,
                                                                 self.packed_modules_mapping):
            return None
        return GPTQLinearMethod(self.weight_bits, self.group_size, self.desc_act, self.checkpoint_format)


class GPTQLinearMethod(WNA16LinearMethod):
    checkpoint_params = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, bits: int, group_size: int, desc_act: bool, checkpoint_format: str) -> None:
        super().__init__(bits, group_size)
        self.desc_act = desc_act
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0

    def create_checkpoint_weights(self, layer: nn.Module, k: int, n: int, output_partition_sizes: list[int],
                                  group: int, params_dtype: torch.dtype, attrs: dict[str, Any]) -> None:
        pf = self.pack_factor
        self.check_outputs(layer, output_partition_sizes, pf)
        loader, p = attrs.pop("weight_loader"), layer.prefix
        grouped = {"input_dim": 0, "group_dims": {0: group}} if self.group_size != -1 else {}
        add_param(layer, "qweight", torch.zeros(k // pf, n, dtype=torch.int32),
                  {"input_dim": 0, "packed_dim": 0, "pack_factor": pf, "output_dim": 1, **attrs,
                   "weight_loader": checked_loader(loader, f"{p}.qweight", (torch.int32,))})
        add_param(layer, "qzeros", torch.zeros(k // group, n // pf, dtype=torch.int32),
                  {**grouped, "output_dim": 1, "packed_dim": 1, "pack_factor": pf, **attrs,
                   "weight_loader": checked_loader(loader, f"{p}.qzeros", (torch.int32,))})
        add_param(layer, "scales", torch.ones(k // group, n, dtype=params_dtype),
                  {**grouped, "output_dim": 1, **attrs,
                   "weight_loader": checked_loader(loader, f"{p}.scales", FLOAT_DTYPES)})
        # Present in every AutoGPTQ checkpoint (trivial without desc_act): optional, never random.
        add_param(layer, "g_idx", torch.arange(k, dtype=torch.int32) // group,
                  {"input_dim": 0, "optional": True, "skip_dummy_init": True, **attrs,
                   "weight_loader": _g_idx_loader(act_order_loader(layer, loader, f"{p}.g_idx", k, group, bool(grouped)),
                                                  f"{p}.g_idx")})

    def _unpack(self, layer: nn.Module):
        q = unpack_int32(layer.qweight.data, self.bits, dim=0)
        zeros = unpack_int32(layer.qzeros.data, self.bits, dim=1) + self.zero_offset
        return q, zeros, layer.scales.data, layer.g_idx.data if self.desc_act else None


def _g_idx_loader(inner, what: str):
    """Fused layers (q/k/v, gate/up) share one input, hence one act order: every shard's g_idx must be
    the same; the first one loaded is kept and later ones are compared to it."""
    seen: dict[int, torch.Tensor] = {}

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if loaded.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{what}: checkpoint tensor has dtype {loaded.dtype}, expected int32")
        key = id(param)
        if key in seen:
            before = param.data.clone()
            inner(param, loaded)
            if not torch.equal(before, param.data):
                raise ValueError(f"{what}: shard {shard_id!r} has another act order (g_idx) than the other shards "
                                 "of this fused layer")
            return
        inner(param, loaded)
        seen[key] = param
    return load
