"""`--quantization gguf` on a GPU: Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K linears computed on their blocks.

The loader hands each such layer its raw blocks (`<name>.qweight`, uint8 rows of blocks in HF row
order, as for the CPU kernels: quantization/gguf.py); `process_weights_after_loading` repacks them on
the device into the layout of kernels/gguf_dequant.py and frees the raw bytes. No dense copy of the
weight is kept. The config (quantization/gguf.py) gives this method to the linears and to an untied
LM head (ParallelLMHead calls create_weights / apply the same way); the embedding table stays dense.

Decode batches of <= 4 rows run the GEMV on the blocks; larger steps dequantize into a scratch for
cuBLAS (kernels/gguf_gemv.py). Off CUDA (tests forcing this method on the CPU) `apply` is the fp32
torch reference; the kernels' own interpreter tests call them directly (tests/kernels/test_gguf_kernels.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.gguf_dequant import GGUF_BLOCK, GGUFPacked, repack_gguf_rows
from pagedllm.layers.utils import set_weight_attrs
from pagedllm.quantization.base import LinearMethodBase

GPU_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GGUFGPULinearMethod(LinearMethodBase):
    """A linear whose weight stays GGUF blocks (repacked), computed by kernels/gguf_gemv.py.

    A fused layer may mix types (a Q4_K_M file stores some layers' v_proj as Q6_K beside Q4_K q/k):
    `qtypes` has one type per fused shard; the raw parameter is as wide as the widest shard's rows
    (narrower rows are zero-padded on load), and runs of shards of one type are repacked and
    multiplied separately, their outputs concatenated (uniform layers: one weight, one launch).
    """

    takes_gguf_blocks = True  # GGUFConfig.quantized_weight_names: its layer takes the raw blocks

    keeps_dense_weight = False  # quantized_weight_names: the loader need not dequantize these tensors

    def __init__(self, qtypes: str | Sequence[str]) -> None:
        self.qtypes = [qtypes] if isinstance(qtypes, str) else list(qtypes)
        for qtype in self.qtypes:
            if qtype not in GGUF_BLOCK:
                raise ValueError(f"GGUF type {qtype} has no GPU kernel (have {sorted(GGUF_BLOCK)})")
        self.qtype = "/".join(dict.fromkeys(self.qtypes))  # "Q4_K", or "Q4_K/Q6_K" for a mixed layer

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
        if params_dtype not in GPU_ACT_DTYPES:
            raise ValueError(f"GGUF GPU kernels take bfloat16 / float16 / float32 activations, not {params_dtype}")
        k = input_size_per_partition
        types = self.qtypes * len(output_partition_sizes) if len(self.qtypes) == 1 else self.qtypes
        if len(types) != len(output_partition_sizes):
            raise ValueError(f"{len(types)} GGUF types for {len(output_partition_sizes)} fused shards")
        for qtype in types:
            if k % GGUF_BLOCK[qtype][0]:
                raise ValueError(f"GGUF {qtype} rows need a multiple of {GGUF_BLOCK[qtype][0]} inputs, got {k}")
        row_bytes = [k // GGUF_BLOCK[t][0] * GGUF_BLOCK[t][1] for t in types]
        width = max(row_bytes)
        # (rows, bytes of one row's blocks), rows in output order: fused shards load by output rows.
        qweight = nn.Parameter(torch.zeros(sum(output_partition_sizes), width, dtype=torch.uint8),
                               requires_grad=False)
        # A RowParallelLinear (one shard, one type) rank takes whole blocks of its inputs: load_slice
        # divides input offsets by this Fraction.
        qk, nbytes = GGUF_BLOCK[types[0]]
        set_weight_attrs(qweight, {"output_dim": 0, "input_dim": 1, "packed_dim": 1, "pack_factor": Fraction(qk, nbytes)})
        loader = extra_weight_attrs.get("weight_loader")
        if loader is not None and min(row_bytes) < width:
            extra_weight_attrs = {**extra_weight_attrs, "weight_loader": _padding_loader(loader, width)}
        set_weight_attrs(qweight, extra_weight_attrs)
        layer.register_parameter("qweight", qweight)
        layer.gguf_in_features = k
        # Runs of shards of one type: (type, first row, rows, bytes a row)
        runs: list[list[Any]] = []
        row = 0
        for qtype, rows, nb in zip(types, output_partition_sizes, row_bytes):
            if runs and runs[-1][0] == qtype:
                runs[-1][2] += rows
            else:
                runs.append([qtype, row, rows, nb])
            row += rows
        layer.gguf_runs = [tuple(r) for r in runs]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        raw = layer.qweight.data
        layer.gguf_packed = tuple(repack_gguf_rows(raw[start:start + rows, :nb], qtype, layer.gguf_in_features)
                                  for qtype, start, rows, nb in layer.gguf_runs)
        del layer.qweight  # the raw blocks are no longer needed

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from pagedllm.kernels.gguf_gemv import gguf_linear, gguf_linear_ref

        packs: tuple[GGUFPacked, ...] = layer.gguf_packed
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        n = sum(p.n for p in packs)
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, n)
        fn = gguf_linear if x2.is_cuda else gguf_linear_ref
        outs, start = [], 0
        for p in packs:
            outs.append(fn(x2, p, None if bias is None else bias[start:start + p.n]))
            start += p.n
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out.reshape(*lead, n)


def _padding_loader(loader: Callable[..., None], width: int) -> Callable[..., None]:
    """The layer's weight loader, with a shard's narrower rows of blocks zero-padded to `width` bytes."""

    def load(param: torch.Tensor, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if loaded.dim() == 2 and loaded.shape[1] < width:
            loaded = F.pad(loaded, (0, width - loaded.shape[1]))
        loader(param, loaded, *args, **kwargs)

    return load
