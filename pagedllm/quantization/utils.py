"""Pieces every quantization method shares: layer-name matching, checked weight loaders, scales.

Checked loaders. A checkpoint tensor is copied into its parameter by the layer's `weight_loader`
(which slices this TP rank's rows/columns); `checked_loader` wraps it so that a tensor of the wrong
kind (int8 where fp8 is expected, float where packed int32 is) fails naming the checkpoint tensor,
instead of `copy_` silently converting it. Shapes are checked by the layer's loader itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.layers.utils import set_weight_attrs

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def checkpoint_prefixes(prefix: str, packed_modules_mapping: dict[str, list[str]]) -> list[str]:
    """"model.layers.0.self_attn.qkv_proj" -> [...q_proj, ...k_proj, ...v_proj] (unfused: [prefix])."""
    head, _, last = prefix.rpartition(".")
    parts = packed_modules_mapping.get(last, [last])
    return [f"{head}.{p}" if head else p for p in parts]


def name_matches(name: str, patterns: Iterable[str]) -> bool:
    """compressed-tensors / vLLM target matching: "re:<regex>" (re.match on the full name), an exact
    module name, or a name suffix ("lm_head" matches "lm_head", "q_proj" matches "...self_attn.q_proj")."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


def is_layer_skipped(prefix: str, ignored: Iterable[str], packed_modules_mapping: dict[str, list[str]]) -> bool:
    """Whether the (possibly fused) layer is left unquantized; ValueError if only some shards are."""
    ignored = list(ignored)
    names = checkpoint_prefixes(prefix, packed_modules_mapping)
    skipped = [name_matches(n, ignored) for n in names]
    if any(skipped) and not all(skipped):
        raise ValueError(
            f"{prefix}: the checkpoint quantizes some of {names} and not others ({ignored}); a fused layer "
            "needs one scheme for all of its parts"
        )
    return all(skipped)


def checked_loader(inner: Callable[..., None], what: str, dtypes: tuple[torch.dtype, ...]) -> Callable[..., None]:
    """`inner` (a layer weight_loader) that first refuses checkpoint tensors of another dtype."""

    def load(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if loaded_weight.dtype not in dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"{what}: checkpoint tensor has dtype {str(loaded_weight.dtype).removeprefix('torch.')}, "
                             f"expected {names}")
        if shard_id is None:
            inner(param, loaded_weight)
        else:
            inner(param, loaded_weight, shard_id)

    return load


def add_param(layer: nn.Module, name: str, tensor: torch.Tensor, attrs: dict[str, Any]) -> nn.Parameter:
    """Register a frozen parameter with loading metadata (output_dim, input_dim, packed_dim, ...)."""
    param = nn.Parameter(tensor, requires_grad=False)
    set_weight_attrs(param, attrs)
    layer.register_parameter(name, param)
    return param


def shard_rows(layer: nn.Module, shard_id: Any) -> int:
    """Rows (output features) of the full checkpoint tensor that loads with `shard_id`."""
    sizes = getattr(layer, "output_sizes", None)
    if shard_id is None or sizes is None:
        return sum(sizes) if sizes is not None else layer.output_size
    index = "qkv".index(shard_id) if isinstance(shard_id, str) else shard_id
    return sizes[index]


def output_scale_loader(layer: nn.Module, what: str) -> Callable[..., None]:
    """Loader of an (out,) fp32 per-output-channel scale that also takes per-tensor checkpoint scales.

    A per-tensor scale (shape (), (1,)) of a fused shard becomes that shard's rows: q, k and v keep
    their own scales and nothing is requantized. Per-channel scales come as (rows,) or (rows, 1).
    """

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if not loaded.is_floating_point():
            raise ValueError(f"{what}: checkpoint scale has dtype {loaded.dtype}, expected a float tensor")
        rows = shard_rows(layer, shard_id)
        if loaded.numel() == 1:
            loaded = loaded.reshape(1).float().expand(rows)
        elif loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded[:, 0]
        if loaded.dim() != 1 or loaded.shape[0] != rows:
            raise ValueError(f"{what}: checkpoint scale has shape {tuple(loaded.shape)}, expected a per-tensor "
                             f"scale () / (1,) or per-channel ({rows},) / ({rows}, 1)")
        if shard_id is None:
            layer.weight_loader(param, loaded.float())
        else:
            layer.weight_loader(param, loaded.float(), shard_id)

    return load


def shard_scalar_loader(layer: nn.Module, what: str) -> Callable[..., None]:
    """Loader of a (num_shards,) parameter holding one scalar per fused shard (static input scales)."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if loaded.numel() != 1 or not loaded.is_floating_point():
            raise ValueError(f"{what}: expected one float scale per tensor, got shape {tuple(loaded.shape)} "
                             f"dtype {loaded.dtype}")
        if shard_id is None:
            param.data.fill_(loaded.item())
        else:
            index = "qkv".index(shard_id) if isinstance(shard_id, str) else shard_id
            param.data[index] = loaded.item()

    return load
