"""Checkpoint-name -> parameter loading shared by the decoder-only models, and the pipeline-stage
pieces (PPMissingLayer, IntermediateTensors) they are built from."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedllm.layers.utils import default_weight_loader


class PPMissingLayer(nn.Module):
    """Stands where a module of another pipeline stage would be (vLLM's name): no parameters, so
    this stage neither allocates nor loads it, and the other modules keep their names."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("PPMissingLayer runs on another pipeline stage")


class IntermediateTensors:
    """What one pipeline stage hands the next: {"hidden_states": (T, hidden), "residual": (T, hidden)}."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __repr__(self) -> str:
        return f"IntermediateTensors({ {k: tuple(v.shape) for k, v in self.tensors.items()} })"


# (fused param name, checkpoint name, shard id): checkpoint tensors that load into one slice of a
# fused parameter. "model.layers.0.self_attn.k_proj.weight" -> "model.layers.0.self_attn.qkv_proj.weight"
# with shard "k".
StackedParamsMapping = list[tuple[str, str, str | int]]


def load_weights_with_mapping(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: StackedParamsMapping,
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Load HF-named checkpoint tensors into `model`; returns the parameter names loaded.

    ValueError for a tensor no parameter takes, and — after all weights — for parameters that got
    nothing or fused parameters missing some of their shards (a qkv_proj with q and k but no v).
    """
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    # Modules of other pipeline stages: their checkpoint tensors are not this rank's to load.
    other_stages = tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))
    expected_shards: dict[str, set[str | int]] = {}
    ckpt_of: dict[tuple[str, object], str] = {}  # (fused, shard) -> checkpoint name, for the error below
    for fused, ckpt_name, shard_id in stacked_params_mapping:
        expected_shards.setdefault(fused, set()).add(shard_id)
        ckpt_of[(fused, shard_id)] = ckpt_name
    loaded: set[str] = set()
    shards_seen: dict[str, set[str | int]] = {}

    for name, tensor in weights:
        if skip(name):
            continue
        for fused, ckpt_name, shard_id in stacked_params_mapping:
            if ckpt_name not in name:
                continue
            param_name = name.replace(ckpt_name, fused)
            if param_name.startswith(other_stages):
                break
            param = _lookup(params, param_name, name)
            _named(name, param.weight_loader, param, tensor, shard_id)
            shards_seen.setdefault(param_name, set()).add(shard_id)
            break
        else:
            param_name = name
            if param_name.startswith(other_stages):
                continue
            param = _lookup(params, param_name, name)
            _named(name, getattr(param, "weight_loader", default_weight_loader), param, tensor)
            shards_seen.setdefault(param_name, set()).add(None)  # the whole tensor: every shard
        loaded.add(param_name)

    # Optional parameters (a GPTQ g_idx without act order) keep their defaults when absent.
    missing = sorted(n for n in set(params) - loaded if not getattr(params[n], "optional", False))
    partial = []
    for param_name, seen in shards_seen.items():
        if None in seen:  # loaded from an already fused checkpoint tensor
            continue
        for fused, need in expected_shards.items():
            if fused in param_name and not need <= seen:
                # The checkpoint tensors that would have filled the missing shards, e.g.
                # "model.layers.0.mlp.experts.3.w1.weight_scale" for param "...experts.w13_weight_scale".
                absent = sorted(param_name.replace(fused, ckpt_of[(fused, s)]) for s in need - seen)
                more = f" and {len(absent) - 8} more" if len(absent) > 8 else ""
                if any(isinstance(s, tuple) for s in need):  # MoE (expert, shard): count them
                    has = f"has {len(seen)} of {len(need)} shards"
                else:
                    has = f"has shards {sorted(map(str, seen))}"
                partial.append(f"{param_name} ({has}), missing checkpoint tensors: {', '.join(absent[:8])}{more}")
    if missing or partial:
        raise ValueError(f"checkpoint is incomplete; parameters without weights: {missing + partial}")
    return loaded


def sliding_window_for_layer(config: object, index: int) -> int | None:
    """The attention window of decoder layer `index` (None: full attention), as transformers reads it:
    `layer_types[index] == "sliding_attention"` when the config lists layer types (Qwen2, Gemma 2/3),
    else `sliding_window` on every layer (Mistral, Mixtral, Phi-3); 0 / None / use_sliding_window=False
    mean none."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types[index] == "sliding_attention" else None
    return int(window)


def _named(ckpt_name: str, loader: Callable[..., None], *args) -> None:
    """Run a weight loader; its ValueError (wrong shape or dtype) gets the checkpoint tensor's name."""
    try:
        loader(*args)
    except ValueError as e:
        if ckpt_name in str(e):
            raise
        raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from e


def _lookup(params: dict[str, nn.Parameter], param_name: str, ckpt_name: str) -> nn.Parameter:
    if param_name not in params:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} matches no model parameter ({param_name!r})")
    return params[param_name]


def single_stage(model: object, architecture: str) -> None:
    """For decoder stacks without pipeline stages (Gemma 2/3, DeepSeek V2/V3): refuse
    pipeline_parallel_size > 1 by name, and mark the one stage as first and last (every layer)."""
    from pagedllm.distributed.parallel_state import get_pp_group

    if get_pp_group().world_size > 1:
        raise ValueError(f"pipeline_parallel_size > 1 is not built for {architecture}; use tensor_parallel_size.")
    model.is_first_stage = model.is_last_stage = True
    model.start_layer, model.end_layer = 0, model.config.num_hidden_layers
