"""Helpers shared by layers, quantization methods and model `load_weights`."""

from __future__ import annotations

from typing import Any

import torch


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any] | None) -> None:
    """Attach loading metadata to a parameter, as vLLM does.

    Attributes the linear layers read: `output_dim` / `input_dim` (which tensor dim is sharded when
    the layer is split across TP ranks, None = not sharded), `packed_dim` + `pack_factor` (that dim
    holds pack_factor logical values per element, e.g. eight 4-bit weights in one int32), `group_dims`
    ({dim: group_size}: one element per group of logical values, a group-wise scale), and
    `weight_loader(param, loaded_weight, shard_id=None)`.
    """
    for key, value in (attrs or {}).items():
        if hasattr(param, key):
            raise ValueError(f"parameter already has attribute {key!r}; refusing to overwrite it")
        setattr(param, key, value)


def check_shape(name: str, expected: torch.Size | tuple[int, ...], got: torch.Size | tuple[int, ...]) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(got)}, expected {tuple(expected)}")


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into an unsharded parameter (norm weights, q_norm, ...)."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        # Scalars are stored as () in some checkpoints and (1,) in others.
        param.data.fill_(loaded_weight.item())
        return
    check_shape("weight", param.shape, loaded_weight.shape)
    param.data.copy_(loaded_weight)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """Exact division for TP sharding: 96 heads over 8 ranks -> 12; 10 over 4 -> ValueError."""
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by tensor parallel size {denominator}")
    return numerator // denominator
