"""`--quantization gguf`: keep a GGUF file's blocks and compute with them (the CPU method here; on CUDA
the Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K linears take quantization/gguf_gpu.py, see `select_gguf_config`).

A decode step of a small model on a CPU is bound by the bytes of weights it streams: SmolLM2-135M
is ~540 MB as dense float32 but ~97 MB as its Q4_1 / Q8_0 blocks. The C kernel
(`pagedllm.cpu.gguf_gemm`) multiplies float32 activations by the blocks directly; every weight
takes the exact float32 value the dequantized checkpoint has, so results equal a dense float32
matmul up to the order of the float32 sums (greedy outputs are those of the float32 model).

Steps of more than `max_packed_rows` tokens (prefills) dequantize panels of the blocks into each
worker's L2 and multiply with torch's BLAS sgemm (MKL): there a dense GEMM is 1.2-1.6x faster than
the block kernel, with the same float32 weight values. No dense copy of a linear weight is kept; the token embedding keeps its dense table for the lookup, and its blocks
serve the (tied) LM head.

How the blocks arrive: for the tensors `quantized_weight_names()` names, the GGUF weight iterator
yields `<name>.qweight` (the raw uint8 blocks of each row, q/k rows un-permuted like the dense
tensor); the layer's usual `weight_loader` places them into the fused qkv / gate_up rows, and
`process_weights_after_loading` repacks them for the kernel.
"""

from __future__ import annotations

import logging
from fractions import Fraction
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
from pagedllm.quantization.gguf_blocks import GPU_GGUF_TYPES

logger = logging.getLogger(__name__)

# Steps with more rows than this dequantize panels and use MKL (faster from ~48 rows on a 2-core
# AVX-512 Xeon, see docs/CPU_PROFILE.md); smaller ones, decode batches of up to 48 streams included,
# take the block kernel.
DEFAULT_MAX_PACKED_ROWS = 48


class GGUFConfig(QuantizationConfig):
    """Which layers of a GGUF checkpoint compute on their blocks, from the file's tensor types."""

    def __init__(self, tensor_types: dict[str, str], max_packed_rows: int = DEFAULT_MAX_PACKED_ROWS,
                 tie_word_embeddings: bool = False, gpu: bool = False) -> None:
        super().__init__()
        # HF weight name -> GGML type name, e.g. "model.layers.0.mlp.down_proj.weight" -> "Q4_1"
        self.tensor_types = dict(tensor_types)
        self.max_packed_rows = max_packed_rows
        # A tied LM head takes the embedding's method (and skips any output.weight in the file).
        self.tie_word_embeddings = tie_word_embeddings
        # True: the GPU method (quantization/gguf_gpu.py) for Q4_0/Q4_1/Q8_0/Q4_K/Q6_K linears and an
        # untied LM head, the embedding table dense; False: the CPU C kernels (float32) for Q4_0/Q4_1/Q8_0.
        self.gpu = gpu

    def get_name(self) -> str:
        return "gguf"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32] if self.gpu else [torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        return cls(cls.get_from_keys(config, ["tensor_types"]),
                   cls.get_from_keys(config, ["max_packed_rows"], DEFAULT_MAX_PACKED_ROWS),
                   cls.get_from_keys(config, ["tie_word_embeddings"], False),
                   cls.get_from_keys(config, ["gpu"], False))

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
        from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

        if self.gpu:  # linears and an untied LM head on their blocks; the embedding table dense
            types = [self.tensor_types.get(name) for name in self._checkpoint_weight_names(prefix)]
            head = isinstance(layer, ParallelLMHead) and not self.tie_word_embeddings
            if (isinstance(layer, LinearBase) or head) and all(t in GPU_GGUF_TYPES for t in types):
                from pagedllm.quantization.gguf_gpu import GGUFGPULinearMethod  # imports Triton: GPU only

                return GGUFGPULinearMethod(types)
            return None
        qtype = self.block_type(prefix)
        if qtype is None or (self.tie_word_embeddings and isinstance(layer, ParallelLMHead)):
            return None
        if isinstance(layer, LinearBase):
            return GGUFLinearMethod(qtype, self.max_packed_rows)
        if isinstance(layer, VocabParallelEmbedding):
            return GGUFEmbeddingMethod(qtype, self.max_packed_rows)
        return None

    def quantized_weight_names(self, model: nn.Module) -> tuple[set[str], set[str]]:
        """(checkpoint weights the layers take as raw blocks, those of them not wanted dense too)."""
        keep: set[str] = set()
        skip_dense: set[str] = set()
        for prefix, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if getattr(method, "takes_gguf_blocks", False) and hasattr(module, "qweight"):
                names = self._checkpoint_weight_names(prefix)
                keep.update(names)
                if not method.keeps_dense_weight:
                    skip_dense.update(names)
        return keep, skip_dense


class _GGUFMethodMixin:
    """Shared by the linear and embedding methods: the raw-block parameter and its repacking."""

    takes_gguf_blocks = True  # quantized_weight_names: its layer takes the raw blocks
    keeps_dense_weight = False

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
        # Inputs are packed QK values per BLOCK_BYTES bytes: a RowParallelLinear rank takes whole
        # blocks of its input columns (load_slice divides offsets by this factor, a Fraction).
        set_weight_attrs(qweight, {"output_dim": 0, "input_dim": 1, "packed_dim": 1,
                                   "pack_factor": Fraction(QK, BLOCK_BYTES[self.qtype])})
        set_weight_attrs(qweight, attrs)
        layer.register_parameter("qweight", qweight)

    def _pack(self, layer: nn.Module, in_features: int) -> PackedGGUFWeight:
        packed = pack_gguf_rows(layer.qweight.data, self.qtype, in_features)
        del layer.qweight  # the raw blocks are no longer needed
        return packed

    def _matmul(self, packed: PackedGGUFWeight, x: torch.Tensor, bias: torch.Tensor | None,
                dense_min_rows: int | None = None) -> torch.Tensor:
        if not x.is_cpu:
            raise ValueError(f"GGUF block kernels run on the CPU, got input on {x.device}")
        out = gguf_matmul(x, packed, dense_min_rows=dense_min_rows or self.max_packed_rows)
        if bias is not None:
            out += bias
        return out


class GGUFLinearMethod(_GGUFMethodMixin, LinearMethodBase):
    """Only the blocks: no dense weight (long prefills dequantize chunk by chunk in the kernel)."""

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
        if params_dtype != torch.float32:
            raise ValueError(f"GGUF block kernels compute in float32, not {params_dtype}")
        self._create_qweight(layer, input_size_per_partition, sum(output_partition_sizes), extra_weight_attrs)
        layer.gguf_in_features = input_size_per_partition

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.gguf_packed = self._pack(layer, layer.gguf_in_features)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._matmul(layer.gguf_packed, x, bias)


class GGUFEmbeddingMethod(_GGUFMethodMixin, QuantizeMethodBase):
    """Token lookup from the dense table; the LM head (tied or not) multiplies by the blocks.

    A tied LM head shares this method object with the embedding (`ParallelLMHead.tie_weights`), so
    the packed blocks live on the method, not on one of the two layers.
    """

    keeps_dense_weight = True  # the lookup reads dense rows

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
            self.packed = self._pack(layer, layer.weight.shape[1])

    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_, layer.weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        assert self.packed is not None, "process_weights_after_loading has not run"
        # The LM head sees one row per sampled request: always the block kernel.
        return self._matmul(self.packed, x, bias, dense_min_rows=1 << 30)


def _is_gguf_checkpoint(model_config: Any) -> bool:
    """A GGUF file's real weights (not dummy ones), with no other quantization asked for."""
    return (
        model_config.quantization in (None, "gguf")
        and getattr(model_config.source, "kind", None) == "gguf"
        and model_config.load_format != "dummy"
    )


def computes_on_gguf_blocks(model_config: Any, device: torch.device) -> bool:
    """Whether select_gguf_config says yes: a GGUF file (not dummy weights) on the CPU in float32 with
    the kernels built. Nothing is logged or configured here."""
    from pagedllm.cpu.build import load_cpu_kernels

    return (
        _is_gguf_checkpoint(model_config)
        and device.type == "cpu"
        and model_config.dtype == torch.float32
        and load_cpu_kernels() is not None
    )


def select_gguf_config(model_config: Any, device: torch.device) -> GGUFConfig | None:
    """Decide once, at load, whether this model computes on its GGUF blocks; logs the decision.

    For a GGUF file (`quantization` None or "gguf"): on CUDA in bfloat16 / float16, the GPU method
    for the linears whose types have a kernel; on the CPU in float32 when the C kernels build, the CPU
    method; otherwise None: the weights are dequantized to dense `dtype`.
    """
    from pagedllm.cpu.build import configure_cpu_threads, cpu_isa
    from pagedllm.loader.gguf_weights import gguf_tensor_types

    if _is_gguf_checkpoint(model_config) and device.type == "cuda" and model_config.dtype in (torch.bfloat16,
                                                                                              torch.float16):
        return _select_gpu(model_config)
    if not computes_on_gguf_blocks(model_config, device):
        if _is_gguf_checkpoint(model_config) and (device.type != "cpu" or model_config.dtype != torch.float32):
            logger.info("GGUF weights dequantized to dense %s (block kernels: float32 on the CPU, bfloat16 / "
                        "float16 on CUDA; running %s on %s)", model_config.dtype, model_config.dtype, device)
        return None
    source = model_config.source
    threads = configure_cpu_threads()
    types = gguf_tensor_types(source.path)
    config = GGUFConfig(types, tie_word_embeddings=bool(getattr(model_config.hf_config, "tie_word_embeddings", False)))
    kept = sorted({t for t in types.values() if t in SUPPORTED_TYPES})
    dense = sorted({t for t in types.values() if t not in SUPPORTED_TYPES and t not in ("F32", "F16", "BF16")})
    logger.info(
        "CPU weights: GGUF %s blocks computed in place (float32 activations, %s kernels, %d threads); "
        "steps over %d tokens dequantize panels for BLAS%s",
        "/".join(kept) or "no", cpu_isa(), threads, config.max_packed_rows,
        f"; {'/'.join(dense)} tensors dequantized (no kernel)" if dense else "",
    )
    return config


def _select_gpu(model_config: Any) -> GGUFConfig:
    """CUDA, bfloat16 / float16: linears of the types with a kernel compute on their blocks."""
    from pagedllm.loader.gguf_weights import gguf_tensor_types

    types = gguf_tensor_types(model_config.source.path)
    config = GGUFConfig(types, tie_word_embeddings=bool(getattr(model_config.hf_config, "tie_word_embeddings",
                                                                False)), gpu=True)
    kept = sorted({t for t in types.values() if t in GPU_GGUF_TYPES})
    dense = sorted({t for t in types.values() if t not in GPU_GGUF_TYPES and t not in ("F32", "F16", "BF16")})
    logger.info("GPU weights: GGUF %s linears computed on their blocks (%s activations; the embedding table "
                "dense, an untied LM head on blocks)%s", "/".join(kept) or "no", model_config.dtype,
                f"; {'/'.join(dense)} tensors dequantized to dense (no kernel)" if dense else "")
    return config
