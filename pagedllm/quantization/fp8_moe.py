"""FP8 (e4m3) MoE experts: `Fp8MoEMethod`, what `Fp8Config` returns for a `FusedMoE` layer (vLLM's name).

Parameters (names as vLLM's Fp8MoEMethod; E experts, I = intermediate size per rank, H = hidden):

    w13_weight         (E, 2I, H) float8_e4m3fn   [gate (w1); up (w3)] of every expert
    w2_weight          (E, H, I)  float8_e4m3fn   down (w2)
    w13_weight_scale   (E, 2) fp32 while loading (w1's, w3's), (E,) after: one scale per expert
    w2_weight_scale    (E,) fp32
    w13_input_scale    static activations only: (E, 2) while loading, the largest one after (a scalar)
    w2_input_scale     static activations only: (E,) while loading, the largest one after

Checkpoint tensors (AutoFP8 / vLLM's "fp8" format, one per expert and projection; the model's
`make_expert_params_mapping` routes them): Mixtral `...experts.{e}.w1.weight` (fp8), `.weight_scale`
(one fp32 per tensor, () or (1,)), `.input_scale` (static only); Qwen-MoE the same with gate_proj /
up_proj / down_proj. Per-channel expert scales are refused by name (not built).

Online FP8 (`quantization="fp8"` on a bf16/fp32 checkpoint): the experts load in the model dtype and
are quantized per expert after loading (one scale over the expert's whole w13, one over its w2,
amax / 448, as vLLM does), so they hold 1 byte a weight from then on (the load itself peaks at the
model dtype's size).

Compute is weight-only (W8A16): the activations stay in the model dtype. On CUDA the fused MoE
kernels' W_SCALED variant (kernels/fused_moe.py) converts fp8 weight tiles in the kernel and scales
the accumulator; on the CPU the torch reference dequantizes each expert hit. A static checkpoint's
input scales are loaded and checked but not applied (vLLM's default is W8A8: fp8 activations with
dynamic per-token scales, or the static ones; not built here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.kernels.scaled_mm import FP8_DTYPE, FP8_MAX
from pagedllm.layers.fused_moe.method import FusedMoEMethodBase
from pagedllm.quantization.utils import FLOAT_DTYPES, add_param, checked_loader

# Checkpoint projection -> column of the (E, 2) loading-time w13 scales.
_W13_COLUMN = {"w1": 0, "w3": 1}


class Fp8MoEMethod(FusedMoEMethodBase):
    """FP8 experts, weight-only (W8A16): per-expert e4m3 weights, one fp32 scale per expert and GEMM."""

    supports_unsummed_topk = True  # the fused kernels on CUDA may leave the top-k sum to the next norm

    def __init__(self, serialized: bool, static_input: bool) -> None:
        if not serialized and static_input:
            raise ValueError("online fp8 has no calibrated input scales: activation_scheme must be 'dynamic'")
        self.serialized = serialized  # False: the checkpoint holds bf16/fp32 experts (online fp8)
        self.static_input = static_input

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        loader = extra_weight_attrs.pop("weight_loader")
        prefix = getattr(layer, "prefix", "")
        e, inter = num_experts, intermediate_size_per_partition
        wdtype = FP8_DTYPE if self.serialized else params_dtype
        accepted = (FP8_DTYPE,) if self.serialized else FLOAT_DTYPES
        for name, shape in (("w13_weight", (e, 2 * inter, hidden_size)), ("w2_weight", (e, hidden_size, inter))):
            add_param(layer, name, torch.empty(shape, dtype=wdtype),
                      {**extra_weight_attrs, "weight_loader": checked_loader(loader, f"{prefix}.{name}", accepted)})
        if self.serialized:
            # Ones, not NaN: a missing expert scale fails in load_weights_with_mapping (every shard of
            # every expert is required), and dummy weights (--load-format dummy) keep a usable scale.
            add_param(layer, "w13_weight_scale", torch.ones(e, 2, dtype=torch.float32),
                      {"weight_loader": _expert_scale_loader(layer, "weight_scale")})
            add_param(layer, "w2_weight_scale", torch.ones(e, dtype=torch.float32),
                      {"weight_loader": _expert_scale_loader(layer, "weight_scale")})
        if self.static_input:
            add_param(layer, "w13_input_scale", torch.full((e, 2), float("nan")),
                      {"weight_loader": _expert_scale_loader(layer, "input_scale")})
            add_param(layer, "w2_input_scale", torch.full((e,), float("nan")),
                      {"weight_loader": _expert_scale_loader(layer, "input_scale")})

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.serialized:
            w13, s13 = _quantize_per_expert(layer.w13_weight.data)
            w2, s2 = _quantize_per_expert(layer.w2_weight.data)
        else:
            w13, s13 = _requantize_w13(layer.w13_weight.data, layer.w13_weight_scale.data)
            w2, s2 = layer.w2_weight.data, layer.w2_weight_scale.data
        for name, tensor in (("w13_weight", w13), ("w2_weight", w2), ("w13_weight_scale", s13),
                             ("w2_weight_scale", s2)):
            if hasattr(layer, name):
                delattr(layer, name)
            add_param(layer, name, tensor.contiguous(), {})
        if self.static_input:
            for name in ("w13_input_scale", "w2_input_scale"):
                scales = getattr(layer, name).data
                missing = torch.isnan(scales.reshape(scales.shape[0], -1)).any(1)
                if missing.any():
                    raise ValueError(f"{layer.prefix}: {name} is missing for expert {int(missing.nonzero()[0])} "
                                     f"(of {scales.shape[0]})")
                # One activation scale for all experts, the largest (vLLM's choice for its W8A8 kernel);
                # kept for a W8A8 path, unused by the W8A16 compute.
                delattr(layer, name)
                add_param(layer, name, scales.max().reshape(1), {})

    def apply(self, layer, x, topk_weights, topk_ids):
        if x.is_cuda:
            from pagedllm.kernels.fused_moe import fused_experts

            return fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                 w13_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale)
        from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

        return fused_experts_ref(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                 layer.w13_weight_scale, layer.w2_weight_scale)

    def apply_unsummed(self, layer, x, topk_weights, topk_ids):
        from pagedllm.kernels.fused_moe import fused_experts

        return fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, sum_topk=False,
                             w13_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale)


def _expert_scale_loader(layer: nn.Module, kind: str) -> Callable[..., None]:
    """Loader of one expert's per-tensor scale (kind "weight_scale" / "input_scale") into its row
    of an (E, 2) (w1, w3) or (E,) (w2) fp32 parameter. ValueError for a scale that is not one float
    (a per-channel scale: not built for experts) or an expert out of range."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any) -> None:
        expert, shard = shard_id
        what = f"{layer.prefix} expert {expert} {shard}.{kind}"
        if not loaded.is_floating_point():
            raise ValueError(f"{what}: checkpoint scale has dtype {loaded.dtype}, expected a float tensor")
        if loaded.numel() != 1:
            raise ValueError(f"{what}: checkpoint scale has shape {tuple(loaded.shape)}; FP8 experts take one "
                             "scale per expert tensor (() or (1,)): per-channel expert scales are not built")
        if not 0 <= expert < param.shape[0]:
            raise ValueError(f"{what}: expert {expert} out of range ({param.shape[0]} experts)")
        if shard == "w2":
            param.data[expert] = loaded.item()
        else:
            param.data[expert, _W13_COLUMN[shard]] = loaded.item()

    return load


def _requantize_w13(w13: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, 2I, H) fp8 with separate w1 / w3 scales (E, 2) -> the same weights on one scale per expert (E,).

    Why: the grouped GEMM multiplies a whole expert's [gate | up] product by one scale (the fused
    SiLU epilogue's two accumulators, and tiles that may straddle the gate / up boundary), so both
    halves must share it. The larger of the two is taken (vLLM's choice): the half with the smaller
    scale is dequantized and quantized again at the larger one, which cannot overflow e4m3's 448
    and costs that half only rounding at a coarser step. Experts whose two scales are equal (one
    calibration for both) are left bit for bit as loaded.
        w1 scale 0.02, w3 scale 0.01 -> both 0.02; a w3 value 160 (= 1.6) becomes 80 (= 1.6).
    In place: w13 is the loaded parameter's data."""
    e, two_inter, hidden = w13.shape
    target = scales.max(dim=1).values  # (E,)
    # (E, 2): 1.0 for the larger half (an all-zero expert's 0 / 0 made 0: its weights are all 0)
    ratio = scales / target.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    for i in range(e):  # one expert's fp32 copy at a time; no host sync (device tensors stay on device)
        halves = w13[i].view(2, two_inter // 2, hidden).float() * ratio[i][:, None, None]
        # A half at ratio 1.0 comes back as it was: e4m3 values times 1.0 round to themselves.
        w13[i] = halves.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(two_inter, hidden)
    return w13, target.contiguous()


def _quantize_per_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) float -> (E, N, K) e4m3 and (E,) fp32 scales, scale = amax(|w[e]|) / 448 (online FP8);
    one expert at a time, so the fp32 copy is one expert's."""
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scales = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        we = w[e].float()
        scales[e] = (we.abs().amax() / FP8_MAX).clamp(min=1e-12)
        q[e] = (we / scales[e]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales
