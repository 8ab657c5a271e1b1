"""`quantization="compressed-tensors"`: checkpoints written by llm-compressor / compressed-tensors.

config.json holds the library's QuantizationConfig (parsed here as a plain dict, so serving does
not need pydantic):

    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {...}, "input_activations": {...}}},
        "ignore": ["lm_head"], "kv_cache_scheme": null}

Schemes built (anything else is refused with the scheme spelled out):

    W8A8-FP8   weights float 8-bit (tensor or channel), activations float 8-bit (dynamic per token or
               static per tensor); format float-quantized / naive-quantized
    W8A8-INT8  weights int 8-bit symmetric (tensor or channel), activations int 8-bit symmetric
               (dynamic per token or static per tensor); format int-quantized / naive-quantized
    FP8_BLOCK  weights float 8-bit with one scale per block_structure [bn, bk] block (`weight_scale`,
               (ceil(N / bn), ceil(K / bk))), activations float 8-bit dynamic per token and group of bk
               inputs; format float-quantized: quantization/fp8_block.py, its limits as fp8's
               weight_block_size (fused shards and TP slices whole blocks)
    W4A16 / W8A16  weights int 4/8-bit (group or channel, symmetric or with zero points, optional
               actorder g_idx), no activation quantization; format pack-quantized:

        weight_packed      (N, K // pf) int32, value k of a row at bits (k % pf) * bits of word k // pf,
                           stored with +2^(bits-1) offset (signed q + 8 for 4 bits)
        weight_scale       (N, K // G)
        weight_zero_point  (N // pf, K // G) int32, packed along N the same way (asymmetric only)
        weight_g_idx       (K,) int32 (actorder only)
        weight_shape       (2,) int: [N, K] of the unpacked weight
        w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.kernels.scaled_mm import FP8_DTYPE
from pagedllm.quantization.base import QuantizationConfig, QuantizeMethodBase
from pagedllm.quantization.fp8_block import Fp8BlockLinearMethod, parse_block
from pagedllm.quantization.utils import (
    FLOAT_DTYPES,
    add_param,
    checked_loader,
    checkpoint_prefixes,
    is_layer_skipped,
    name_matches,
)
from pagedllm.quantization.w8a8 import W8A8LinearMethod
from pagedllm.quantization.wna16 import WNA16LinearMethod, act_order_loader, check_weight_scheme, unpack_int32

FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")


def _describe(weights: dict | None, acts: dict | None) -> str:
    def one(a: dict | None) -> str:
        if not a:
            return "none"
        return (f"{a.get('type', 'int')}{a.get('num_bits')} {a.get('strategy')} "
                f"{'sym' if a.get('symmetric', True) else 'asym'}{' dynamic' if a.get('dynamic') else ''}")
    return f"weights {one(weights)}, input activations {one(acts)}"


class CompressedTensorsScheme:
    """One config group's scheme, validated: which method runs it."""

    def __init__(self, group: dict[str, Any], fmt: str | None) -> None:
        self.targets = list(group.get("targets") or [])
        weights, acts = group.get("weights"), group.get("input_activations")
        self.format = group.get("format") or fmt
        if group.get("output_activations"):
            raise ValueError(f"compressed-tensors output activation quantization is not built ({group})")
        if weights is None:
            raise ValueError(f"compressed-tensors scheme without weight quantization is not built ({group})")
        desc = _describe(weights, acts)
        if self.format not in FORMATS:
            raise ValueError(f"compressed-tensors format {self.format!r} is not built ({desc}); built: {FORMATS}")
        wtype, wbits, wstrat = weights.get("type", "int"), weights.get("num_bits"), weights.get("strategy")
        if wstrat == "block":
            self._block_scheme(weights, acts, desc)
        elif acts is not None:
            if acts.get("type", "int") != wtype or acts.get("num_bits") != 8 or wbits != 8:
                raise ValueError(f"compressed-tensors scheme ({desc}) is not built; built: W8A8-FP8, W8A8-INT8, "
                                 "W4A16, W8A16")
            if wstrat not in ("tensor", "channel") or not weights.get("symmetric", True):
                raise ValueError(f"compressed-tensors W8A8 with {desc} is not built (symmetric tensor/channel "
                                 "weight scales are)")
            dynamic = acts.get("dynamic")
            if not acts.get("symmetric", True) or dynamic == "local" or \
                    (dynamic and acts.get("strategy") != "token") or (not dynamic and acts.get("strategy") != "tensor"):
                raise ValueError(f"compressed-tensors activations ({desc}) are not built: dynamic per-token or "
                                 "static per-tensor symmetric ones are")
            self.kind = "w8a8"
            self.qdtype = FP8_DTYPE if wtype == "float" else torch.int8
            self.static_input = not dynamic
        else:
            if wtype != "int" or wbits not in (4, 8) or wstrat not in ("group", "channel") \
                    or self.format != "pack-quantized":
                raise ValueError(f"compressed-tensors weight-only scheme ({desc}, format {self.format}) is not "
                                 "built; built: int4/int8 group or channel, pack-quantized")
            self.kind = "wna16"
            self.bits = int(wbits)
            self.group_size = int(weights["group_size"]) if wstrat == "group" else -1
            self.symmetric = bool(weights.get("symmetric", True))
            self.actorder = weights.get("actorder") not in (None, False)
            check_weight_scheme(self.bits, self.group_size)

    def _block_scheme(self, weights: dict, acts: dict | None, desc: str) -> None:
        """FP8_BLOCK (llm-compressor): fp8 weights with one scale per block_structure [bn, bk] block (the grid is
        `weight_scale`), activations fp8 dynamic per token and group of bk inputs: fp8's weight_block_size."""
        built = ("compressed-tensors block-wise weights are built as FP8_BLOCK: float8 symmetric weights with "
                 "block_structure [block_n, block_k], float8 symmetric dynamic activations of strategy 'group' "
                 "with group_size block_k")
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or not weights.get("symmetric", True):
            raise ValueError(f"compressed-tensors scheme ({desc}) is not built; {built}")
        block = parse_block(weights.get("block_structure"), "compressed-tensors block_structure")
        if acts is None or acts.get("type") != "float" or acts.get("num_bits") != 8 \
                or not acts.get("symmetric", True) or acts.get("dynamic") is not True \
                or acts.get("strategy") != "group" or acts.get("group_size") != block[1]:
            raise ValueError(f"compressed-tensors scheme ({desc}, block_structure {list(block)}, activation group "
                             f"{(acts or {}).get('group_size')}) is not built; {built}")
        if self.format not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors FP8_BLOCK in format {self.format!r} is not built "
                             "(float-quantized / naive-quantized are)")
        self.kind = "fp8_block"
        self.qdtype = FP8_DTYPE
        self.block = block

    def method(self) -> QuantizeMethodBase:
        if self.kind == "fp8_block":
            return Fp8BlockLinearMethod(self.block, scale_name="weight_scale")
        if self.kind == "w8a8":
            return W8A8LinearMethod(self.qdtype, self.static_input)
        return CTPackedLinearMethod(self.bits, self.group_size, self.symmetric, self.actorder)


class CompressedTensorsConfig(QuantizationConfig):
    def __init__(self, schemes: list[CompressedTensorsScheme], ignore: list[str],
                 kv_cache_scheme: dict | None = None) -> None:
        super().__init__()
        self.schemes = schemes
        self.ignore = ignore
        self.kv_cache_scheme = kv_cache_scheme

    def get_name(self) -> str:
        return "compressed-tensors"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 75

    def required_capability(self) -> int:
        # FP8 W8A8 runs FP8 tensor-core GEMMs (Triton's fp8e4nv dot, torch._scaled_mm): sm_89 and up, as
        # Fp8Config; INT8 W8A8 (torch._int_mm) and the int4/int8 weight-only kernels run from sm_75.
        fp8 = any(s.kind in ("w8a8", "fp8_block") and s.qdtype == FP8_DTYPE for s in self.schemes)
        return max(self.get_min_capability(), 89 if fp8 else 0)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        if config.get("sparsity_config"):
            raise ValueError("compressed-tensors sparsity (sparsity_config) is not built")
        if config.get("transform_config"):
            raise ValueError("compressed-tensors transforms (transform_config) are not built")
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        fmt = config.get("format")
        kv = config.get("kv_cache_scheme")
        if kv is not None and (kv.get("type") != "float" or kv.get("num_bits") != 8):
            raise ValueError(f"compressed-tensors kv_cache_scheme {kv} is not built (fp8 is)")
        return cls([CompressedTensorsScheme(g, fmt) for g in groups.values()], list(config.get("ignore") or []), kv)

    @classmethod
    def default_for_dummy(cls) -> CompressedTensorsConfig:
        """W8A8-INT8, channel-wise weights and dynamic per-token activations (llm-compressor's W8A8)."""
        group = {"targets": ["Linear"],
                 "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                 "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                       "dynamic": True}}
        return cls([CompressedTensorsScheme(group, "int-quantized")], ["lm_head"])

    def _scheme_for(self, name: str) -> CompressedTensorsScheme | None:
        for scheme in self.schemes:
            if "Linear" in scheme.targets or name_matches(name, scheme.targets):
                return scheme
        return None

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from pagedllm.layers.linear import LinearBase

        if not isinstance(layer, LinearBase) or is_layer_skipped(prefix, self.ignore, self.packed_modules_mapping):
            return None
        names = checkpoint_prefixes(prefix, self.packed_modules_mapping)
        schemes = {id(s): s for s in (self._scheme_for(n) for n in names)}
        if len(schemes) != 1:
            raise ValueError(f"{prefix}: its parts {names} have different compressed-tensors schemes")
        (scheme,) = schemes.values()
        return None if scheme is None else scheme.method()


class CTPackedLinearMethod(WNA16LinearMethod):
    checkpoint_params = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")

    def __init__(self, bits: int, group_size: int, symmetric: bool, actorder: bool) -> None:
        super().__init__(bits, group_size)
        self.symmetric = symmetric
        self.actorder = actorder

    def create_checkpoint_weights(self, layer: nn.Module, k: int, n: int, output_partition_sizes: list[int],
                                  group: int, params_dtype: torch.dtype, attrs: dict[str, Any]) -> None:
        pf = self.pack_factor
        loader, p = attrs.pop("weight_loader"), layer.prefix
        grouped = {"input_dim": 1, "group_dims": {1: group}} if self.group_size != -1 else {}
        add_param(layer, "weight_packed", torch.zeros(n, k // pf, dtype=torch.int32),
                  {"output_dim": 0, "input_dim": 1, "packed_dim": 1, "pack_factor": pf, **attrs,
                   "weight_loader": checked_loader(loader, f"{p}.weight_packed", (torch.int32,))})
        add_param(layer, "weight_scale", torch.ones(n, k // group, dtype=params_dtype),
                  {"output_dim": 0, **grouped, **attrs,
                   "weight_loader": checked_loader(loader, f"{p}.weight_scale", FLOAT_DTYPES)})
        if not self.symmetric:
            self.check_outputs(layer, output_partition_sizes, pf)
            add_param(layer, "weight_zero_point", torch.zeros(n // pf, k // group, dtype=torch.int32),
                      {"output_dim": 0, "packed_dim": 0, "pack_factor": pf, **grouped, **attrs,
                       "weight_loader": checked_loader(loader, f"{p}.weight_zero_point", (torch.int32,))})
        if self.actorder:
            add_param(layer, "weight_g_idx", torch.arange(k, dtype=torch.int32) // group,
                      {"input_dim": 0, "skip_dummy_init": True, **attrs,
                       "weight_loader": checked_loader(act_order_loader(layer, loader, f"{p}.weight_g_idx", k, group, bool(grouped)),
                                                       f"{p}.weight_g_idx", (torch.int32, torch.int64))})
        add_param(layer, "weight_shape", torch.zeros(2, dtype=torch.int64),
                  {"weight_loader": _shape_checker(layer, f"{p}.weight_shape"), "skip_dummy_init": True})

    def _unpack(self, layer: nn.Module):
        offset = 1 << (self.bits - 1)
        q = unpack_int32(layer.weight_packed.data, self.bits, dim=1).t()
        if self.symmetric:
            zeros = torch.full((layer.weight_scale.shape[1], q.shape[1]), offset, dtype=torch.int32, device=q.device)
        else:
            zeros = unpack_int32(layer.weight_zero_point.data, self.bits, dim=0).t()
        g_idx = layer.weight_g_idx.data if self.actorder else None
        return q, zeros, layer.weight_scale.data.t(), g_idx


def _shape_checker(layer: nn.Module, what: str):
    """weight_shape must say [rows of this checkpoint tensor, the layer's inputs]."""
    from pagedllm.quantization.utils import shard_rows

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        expected = [shard_rows(layer, shard_id), layer.input_size]
        if loaded.numel() != 2 or [int(v) for v in loaded.reshape(-1)] != expected:
            raise ValueError(f"{what}: checkpoint says the weight is {loaded.tolist()}, expected {expected}")
        param.data.copy_(torch.tensor(expected))
    return load
