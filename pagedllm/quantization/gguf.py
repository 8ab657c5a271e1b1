"""`--quantization gguf` on the CPU: keep a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks and compute with them.

A decode step of a small model on a CPU is bound by the bytes of weights it streams: SmolLM2-135M
is ~540 MB as dense float32 but ~97 MB as its Q4_1 / Q8_0 blocks. The C kernel
(`pagedllm.cpu.gguf_gemm`) multiplies float32 activations by the blocks directly; every weight
takes the exact float32 value the dequantized checkpoint has, so results equal a dense float32
matmul up to the order of the float32 sums (greedy outputs are those of the float32 model).

Each quantized layer holds two copies: the packed blocks for steps of at most `max_packed_rows`
tokens (decode, small prefill chunks) and the dense float32 weight, which MKL multiplies faster
for long prefills. The dense copy is not read during decode, so it costs memory, not bandwidth.

How the blocks arrive: the GGUF weight iterator yields `<name>.qweight` (the raw uint8 blocks of
each row, q/k rows un-permuted like the dense tensor) beside `<name>.weight` for every tensor this
config names in `quantized_weight_names()`; the layer's usual `weight_loader` places them into
the fused qkv / gate_up rows, and `process_weights_after_loading` repacks them for the kernel.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.cpu.gguf_gemm import BLOCK_BYTES, QK, SUPPORTED_TYPES, PackedGGUFWeight, gguf_matmul, pack_gguf_rows
from pagedllm.layers.utils import set_weight_attrs
from pagedllm.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    _create_dense_weight,
)

logger = logging.getLogger(__name__)

# Steps with more rows than this use the dense float32 weight (MKL is faster on long prefills;
# measured on a 2-core AVX-512 Xeon, see docs/CPU_PROFILE.md). Decode batches up to the CPU
# default max_num_seqs (64) always take the packed blocks.
DEFAULT_MAX_PACKED_ROWS = 64


class GGUFConfig(QuantizationConfig):
    """Which layers of a GGUF checkpoint compute on their blocks, from the file's tensor types."""

    def __init__(self, tensor_types: dict[str, str], max_packed_rows: int = DEFAULT_MAX_PACKED_ROWS) -> None:
        super().__init__()
        # HF weight name -> GGML type name, e.g. "model.layers.0.mlp.down_proj.weight" -> "Q4_1"
        self.tensor_types = dict(tensor_types)
        self.max_packed_rows = max_packed_rows

    def get_name(self) -> str:
        return "gguf"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        return cls(cls.get_from_keys(config, ["tensor_types"]),
                   cls.get_from_keys(config, ["max_packed_rows"], DEFAULT_MAX_PACKED_ROWS))

    def _checkpoint_weight_names(self, prefix: str) -> list[str]:
        # "model.layers.0.self_attn.qkv_proj" -> [... q_proj.weight, ... k_proj.weight, ... v_proj.weight]
        head, _, last = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(last, [last])
        return [f"{head}.{p}.weight" if head else f"{p}.weight" for p in parts]

    def block_type(self, prefix: str) -> str | None:
        """The one GGML type of every checkpoint tensor of layer `prefix`, if the kernel has it."""
        types = {self.tensor_types.get(name) for name in self._checkpoint_weight_names(prefix)}
        if len(types) != 1:
            return None  # absent (tied lm_head) or mixed types in one fused layer: dense
        (qtype,) = types
        return qtype if qtype in SUPPORTED_TYPES else None

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from pagedllm.layers.linear import LinearBase
        from pagedllm.layers.vocab_embedding import VocabParallelEmbedding

        qtype = self.block_type(prefix)
        if qtype is None:
            return None
        if isinstance(layer, LinearBase):
            return GGUFLinearMethod(qtype, self.max_packed_rows)
        if isinstance(layer, VocabParallelEmbedding):
            return GGUFEmbeddingMethod(qtype, self.max_packed_rows)
        return None

    def quantized_weight_names(self, model: nn.Module) -> set[str]:
        """Checkpoint weight names whose raw blocks the model's layers take (as `.qweight`)."""
        names: set[str] = set()
        for prefix, module in model.named_modules():
            if isinstance(getattr(module, "quant_method", None), _GGUFMethodMixin) and hasattr(module, "qweight"):
                names.update(self._checkpoint_weight_names(prefix))
        return names


class _GGUFMethodMixin:
    """Shared by the linear and embedding methods: the raw-block parameter and its repacking."""

    def __init__(self, qtype: str, max_packed_rows: int) -> None:
        self.qtype = qtype
        self.max_packed_rows = max_packed_rows

    def _create_qweight(self, layer: nn.Module, in_features: int, rows: int, attrs: dict[str, Any]) -> None:
        if in_features % QK:
            raise ValueError(f"GGUF {self.qtype} rows need a multiple of {QK} inputs, got {in_features}")
        # (rows, bytes of one row's blocks), rows in output order: fused shards load by output rows.
        qweight = nn.Parameter(
            torch.zeros(rows, in_features // QK * BLOCK_BYTES[self.qtype], dtype=torch.uint8), requires_grad=False
        )
        set_weight_attrs(qweight, {"output_dim": 0})
        set_weight_attrs(qweight, attrs)
        layer.register_parameter("qweight", qweight)

    def _pack(self, layer: nn.Module) -> PackedGGUFWeight:
        packed = pack_gguf_rows(layer.qweight.data, self.qtype, layer.weight.shape[1])
        del layer.qweight  # the raw blocks are no longer needed
        return packed

    def _matmul(self, packed: PackedGGUFWeight, weight: torch.Tensor, x: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] > self.max_packed_rows or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        out = gguf_matmul(x, packed)
        if bias is not None:
            out += bias
        return out


class GGUFLinearMethod(_GGUFMethodMixin, LinearMethodBase):
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
        _create_dense_weight(layer, input_size_per_partition, output_partition_sizes, params_dtype,
                             extra_weight_attrs)
        self._create_qweight(layer, input_size_per_partition, sum(output_partition_sizes), extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.gguf_packed = self._pack(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._matmul(layer.gguf_packed, layer.weight, x, bias)


class GGUFEmbeddingMethod(_GGUFMethodMixin, QuantizeMethodBase):
    """Token lookup from the dense table; the LM head (tied or not) multiplies by the blocks.

    A tied LM head shares this method object with the embedding (`ParallelLMHead.tie_weights`), so
    the packed blocks live on the method, not on one of the two layers.
    """

    def __init__(self, qtype: str, max_packed_rows: int) -> None:
        super().__init__(qtype, max_packed_rows)
        self.packed: PackedGGUFWeight | None = None

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
        _create_dense_weight(layer, input_size_per_partition, output_partition_sizes, params_dtype,
                             extra_weight_attrs)
        self._create_qweight(layer, input_size_per_partition, sum(output_partition_sizes), extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "qweight"):  # the tied LM head has none: it reuses the embedding's blocks
            self.packed = self._pack(layer)

    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_, layer.weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        assert self.packed is not None, "process_weights_after_loading has not run"
        return self._matmul(self.packed, layer.weight, x, bias)


def select_gguf_config(model_config: Any, device: torch.device) -> GGUFConfig | None:
    """Decide once, at load, whether this model computes on its GGUF blocks; logs the decision.

    Yes for a GGUF file on the CPU in float32 when the kernels build (`quantization` None or
    "gguf"); otherwise the weights are dequantized to dense `dtype` as before.
    """
    from pagedllm.cpu.build import cpu_isa, load_cpu_kernels
    from pagedllm.loader.gguf_weights import gguf_tensor_types

    source = model_config.source
    if model_config.quantization not in (None, "gguf") or getattr(source, "kind", None) != "gguf":
        return None
    if model_config.load_format == "dummy":
        return None
    if device.type != "cpu" or model_config.dtype != torch.float32:
        logger.info("GGUF weights dequantized to dense %s (block kernels are built for float32 on the CPU; "
                    "running %s on %s)", model_config.dtype, model_config.dtype, device)
        return None
    if load_cpu_kernels() is None:
        return None
    types = gguf_tensor_types(source.path)
    config = GGUFConfig(types)
    kept = sorted({t for t in types.values() if t in SUPPORTED_TYPES})
    dense = sorted({t for t in types.values() if t not in SUPPORTED_TYPES and t not in ("F32", "F16", "BF16")})
    logger.info(
        "CPU weights: GGUF %s blocks computed in place (float32 activations, %s kernels, %d threads); "
        "dense float32 for steps over %d tokens%s",
        "/".join(kept) or "no", cpu_isa(), torch.get_num_threads(), config.max_packed_rows,
        f"; {'/'.join(dense)} tensors dequantized (no kernel)" if dense else "",
    )
    return config
