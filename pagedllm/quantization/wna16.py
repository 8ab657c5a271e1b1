"""Shared core of the int-weight methods (AWQ, GPTQ, compressed-tensors pack-quantized).

Each subclass registers the parameters its checkpoint format holds and, after loading, says what
they mean as plain tensors (`_unpack`: values q (K, N), zero points (K // G, N), scales (K // G, N),
g_idx (K,) or None). This class then repacks them, once, into the one layout the W4A16 kernel and
its reference read (kernels/wna16_gemm.py), and drops the checkpoint tensors.

Act-order (GPTQ desc_act, compressed-tensors actorder): g_idx[k] is the group of input k, groups
scattered over K. Sorting K by group (a stable argsort, `perm`) makes each group contiguous; the
weight rows are stored in that order and x is gathered x[:, perm] before the GEMM, which gives the
same y. All checkpoints these tools write have groups of exactly G inputs; anything else is refused.

Act order at tensor_parallel_size > 1: a row-parallel layer (o_proj, down_proj) gives each rank a
contiguous slice of K and its slice of the group rows of scales / zeros. That is only right when the
rank's inputs all belong to its own groups (`act_order_loader`): g_idx natural, as GPTQ's static_groups
writes, or permuted within each rank's slice. A checkpoint whose groups are scattered over the whole of
K (plain desc_act) would need every rank to keep all the group scales and a kernel that reads a group
index per input (vLLM's Marlin with is_k_full=False); that is not built, so it is refused at the layer's
g_idx, the first tensor of it read.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.kernels.wna16_gemm import pack_along_k, wna16_linear, wna16_linear_ref
from pagedllm.quantization.base import LinearMethodBase
from pagedllm.quantization.utils import add_param

SUPPORTED_BITS = (4, 8)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Values packed along `dim`, value j of a word at bits [j * bits, +bits), no reordering.

    (R, C // pf) along dim 1 -> (R, C); (R // pf, C) along dim 0 -> (R, C).
    """
    pf = 32 // bits
    shifts = torch.arange(pf, device=packed.device, dtype=torch.int32) * bits
    if dim == 1:
        vals = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return vals.reshape(packed.shape[0], packed.shape[1] * pf)
    vals = (packed.unsqueeze(1) >> shifts.view(1, pf, 1)) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0] * pf, packed.shape[1])


def check_weight_scheme(bits: int, group_size: int) -> None:
    """The bits / group sizes the W4A16 kernel is built for; ValueError naming the one refused."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits}-bit weights are not built; built: {SUPPORTED_BITS}")
    if group_size != -1 and (group_size <= 0 or group_size % 16):
        raise ValueError(f"group_size must be -1 (one group per channel) or a positive multiple of 16, "
                         f"got {group_size}")


def act_order_loader(layer: nn.Module, inner: Callable[..., None], what: str, k: int, group: int,
                     sliced: bool) -> Callable[..., None]:
    """The g_idx (K,) loader of a layer with `k` inputs on this rank. A row-parallel layer at
    tensor_parallel_size > 1 (k < layer.input_size) keeps rank r's slice of g_idx, made relative to its
    own groups: global group ids first..first + k // G - 1 -> 0..k // G - 1 (first = r * k // G). Any
    of its inputs in another rank's group is a ValueError (see the module docstring). `sliced` False
    (group_size -1: one group, its scales on every rank): g_idx is all 0 and stays so.

    K 128, G 32, tp 2, rank 1: inputs 64..127; g_idx there in 2..3 -> 0..1; a 0 or 1 there is refused."""
    if k == layer.input_size or not sliced:
        return inner  # the whole input on every rank (column-parallel, or tp 1): g_idx as it is

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            inner(param, loaded)
        else:
            inner(param, loaded, shard_id)
        first, num = layer.tp_rank * (k // group), k // group
        local = param.data.to(torch.int64) - first
        if bool(((local < 0) | (local >= num)).any()):
            r, tp = layer.tp_rank, layer.tp_size
            raise ValueError(
                f"{what}: act order (GPTQ desc_act / compressed-tensors actorder) with groups scattered over "
                f"all inputs is not built at tensor_parallel_size {tp}: rank {r} of this row-parallel layer "
                f"holds inputs {r * k}..{(r + 1) * k - 1}, and some of them belong to groups outside its "
                f"groups {first}..{first + num - 1} (the kernels need each rank's groups whole). Run this "
                "checkpoint at tensor_parallel_size 1, or use one quantized without act order (desc_act "
                "false) or with static_groups."
            )
        param.data.copy_(local.to(param.dtype))
    return load


class WNA16LinearMethod(LinearMethodBase):
    """Weight-only int4/int8 linear: y = x @ ((q - z) * s) + b, activations in the model dtype."""

    # Checkpoint parameter names of the subclass, dropped after repacking.
    checkpoint_params: tuple[str, ...] = ()

    def __init__(self, bits: int, group_size: int) -> None:
        check_weight_scheme(bits, group_size)
        self.bits = bits
        self.pack_factor = 32 // bits
        self.group_size = group_size

    def groups(self, layer: nn.Module, input_size_per_partition: int, input_size: int) -> tuple[int, int]:
        """(group size G along this rank's inputs, number of groups) with exact-division checks."""
        # group_size -1 (one group per output channel): one group over this rank's inputs, its scale row
        # the same on every rank (a row-parallel layer at tp 2 has K / 2 inputs, one group of K / 2).
        g = input_size_per_partition if self.group_size == -1 else self.group_size
        what = getattr(layer, "prefix", "layer")
        if input_size_per_partition % g:
            raise ValueError(f"{what}: {input_size_per_partition} inputs are not a whole number of groups of {g}")
        if input_size_per_partition % self.pack_factor:
            raise ValueError(f"{what}: {input_size_per_partition} inputs do not pack {self.pack_factor} per int32")
        return g, input_size_per_partition // g

    def check_outputs(self, layer: nn.Module, output_partition_sizes: list[int], multiple: int) -> None:
        for size in output_partition_sizes:
            if size % multiple:
                raise ValueError(f"{getattr(layer, 'prefix', 'layer')}: {size} output features are not a multiple "
                                 f"of {multiple} (the packing of this format)")

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        g, _ = self.groups(layer, input_size_per_partition, input_size)
        layer.wna16_group = g
        self.create_checkpoint_weights(layer, input_size_per_partition, sum(output_partition_sizes),
                                       output_partition_sizes, g, params_dtype, extra_weight_attrs)

    @abstractmethod
    def create_checkpoint_weights(self, layer: nn.Module, k: int, n: int, output_partition_sizes: list[int],
                                  group: int, params_dtype: torch.dtype, attrs: dict[str, Any]) -> None:
        """Register the format's parameters for a (k inputs, n outputs) shard with groups of `group`."""

    @abstractmethod
    def _unpack(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q (K, N) unsigned, zeros (K // G, N), scales (K // G, N), g_idx (K,) or None)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, zeros, scales, g_idx = self._unpack(layer)
        k, g = q.shape[0], layer.wna16_group
        perm = None
        if g_idx is not None:
            g_idx = g_idx.to(torch.int64)
            natural = torch.arange(k, device=q.device) // g
            if not torch.equal(g_idx, natural):
                perm = torch.argsort(g_idx, stable=True).to(torch.int32)  # kernels read x through it
                if not torch.equal(g_idx[perm], natural):
                    raise ValueError(f"{layer.prefix}: g_idx does not assign exactly {g} inputs to each group")
                q = q[perm]
        for name in self.checkpoint_params:
            if hasattr(layer, name):
                delattr(layer, name)
        if int(zeros.max()) > 255 or int(zeros.min()) < 0:
            raise ValueError(f"{layer.prefix}: zero points outside 0..255")
        add_param(layer, "wna16_qweight", pack_along_k(q, self.bits).contiguous(), {})
        add_param(layer, "wna16_scales", scales.contiguous(), {})
        add_param(layer, "wna16_zeros", zeros.to(torch.uint8).contiguous(), {})
        layer.wna16_perm = perm

    def fuses_silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether `apply_silu_and_mul` saves the activation's launch for x = [gate | up]: one row of
        int4 on the GPU (the one-row kernel computes silu(gate) * up in its prologue)."""
        return x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and self.bits == 4

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """apply(layer, silu_and_mul(x), bias), x = (T, 2 * input_size) [gate | up]."""
        if not x.is_cuda:
            from pagedllm.kernels.activation import silu_and_mul_ref

            return self.apply(layer, silu_and_mul_ref(x), bias)
        x2 = x.reshape(-1, x.shape[-1])
        out = wna16_linear(x2, layer.wna16_qweight, layer.wna16_scales, layer.wna16_zeros, self.bits,
                           layer.wna16_group, layer.wna16_perm, bias, act="silu_and_mul")
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def fuses_rms_norm(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether `apply_rms_norm` saves the norm's launch: one row of int4 on the GPU where the layer's
        one-row launch is the packed fp16 path (whose x prologue computes the norm)."""
        if not (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and self.bits == 4):
            return False
        from pagedllm.kernels.wna16_stream_config import StreamConfig, stream_config, stream_supported

        k = layer.wna16_qweight.shape[0] * 8
        cfg = stream_config(layer.wna16_qweight.shape[1], k)
        return (stream_supported(x, self.bits, layer.wna16_group, k) and isinstance(cfg, StreamConfig)
                and cfg.MATH == "f16x2" and cfg.FUSE_NORM)

    def apply_rms_norm(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(apply(layer, rms_norm(x + residual) * norm_weight, bias), x + residual) for one row."""
        if not x.is_cuda:
            from pagedllm.kernels.rmsnorm import rms_norm_ref

            normed, new_residual = rms_norm_ref(x, norm_weight, eps, residual)
            return self.apply(layer, normed, bias), new_residual
        from pagedllm.kernels.wna16_stream import wna16_stream_linear_rms_norm

        return wna16_stream_linear_rms_norm(x, residual, norm_weight, eps, layer.wna16_qweight, layer.wna16_scales,
                                            layer.wna16_zeros, layer.wna16_group, bias, layer.wna16_perm)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        fn = wna16_linear if x.is_cuda else wna16_linear_ref
        out = fn(x2, layer.wna16_qweight, layer.wna16_scales, layer.wna16_zeros, self.bits, layer.wna16_group,
                 layer.wna16_perm, bias)
        return out.reshape(*lead, out.shape[-1])
