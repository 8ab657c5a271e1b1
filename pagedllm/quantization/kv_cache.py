"""Per-tensor KV-cache scales (`--kv-cache-dtype fp8`): read from the checkpoint, else 1.0, as vLLM.

FP8 checkpoints that calibrated the cache carry one scale per layer for K and one for V, under the
attention module: `model.layers.N.self_attn.k_scale` / `.v_scale` (vLLM's fp8 format and
compressed-tensors' kv_cache_scheme), or `.kv_scale` for both (older AutoFP8), or
`self_attn.k_proj.output_scale` / `v_proj.output_scale`. The cache then holds K / k_scale and
V / v_scale in e4m3; attention folds the scales back in (attention/layer.py). Without an fp8 cache the
scales are read and not used (the cache holds K and V themselves).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)

_SCALE_RE = re.compile(r"^(?P<attn>.*\.self_attn)\.(?:(?P<which>k|v|kv)_scale|(?P<proj>k|v)_proj\.output_scale)$")


def take_kv_scales(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass every tensor through except KV-cache scales, which are set on the layer's `Attention`
    (`k_scale` / `v_scale`, floats); ValueError naming a scale that is not one positive number."""
    from pagedllm.attention.layer import Attention

    for name, tensor in weights:
        match = _SCALE_RE.match(name)
        if match is None:
            yield name, tensor
            continue
        attn = dict(model.named_modules()).get(match["attn"] + ".attn")
        if not isinstance(attn, Attention):
            raise ValueError(f"checkpoint tensor {name!r}: no attention layer at {match['attn']}.attn for it")
        if tensor.numel() != 1 or not tensor.is_floating_point() or not float(tensor.reshape(-1)[0]) > 0:
            raise ValueError(f"checkpoint tensor {name!r}: a KV-cache scale must be one positive float, got "
                             f"shape {tuple(tensor.shape)} dtype {tensor.dtype}")
        value = float(tensor.reshape(-1)[0])
        which = match["which"] or match["proj"]
        if which in ("k", "kv"):
            attn.k_scale = value
        if which in ("v", "kv"):
            attn.v_scale = value
