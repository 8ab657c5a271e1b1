"""W8A8 GEMMs, FP8 (e4m3) and INT8, with per-token activation scales and per-channel weight scales.

    x (M, K) float  --quantize-->  xq (M, K) fp8/int8, x_scale (M, 1) fp32   (dynamic: amax per row,
                                                                             static: one checkpoint scale)
    y = (xq @ wq^T) * x_scale * w_scale[None, :] + bias     wq (N, K) fp8/int8, w_scale (N,) fp32

A per-tensor weight scale is the per-channel case with equal entries (fused q/k/v shards each keep
their own scale as rows of w_scale, so nothing is requantized at load).

Where each runs (`w8a8_linear`, `choose_path`):
    CPU                    `scaled_mm_ref`: the quantized values dequantized in fp32 and multiplied
                           (exact products; fp32 sums), which is also every kernel's reference
    CUDA, small M          "w8a16": kernels/w8a16_gemv.py, the 8-bit weights dequantized in registers
                           against the unquantized activations (no quant launch; weight streaming)
    CUDA, FP8              "cublas": torch._scaled_mm (FP8 tensor cores, row-wise scales, bf16 out)
    CUDA, INT8             "triton": kernels/w8a8_gemm.py (int8 wgmma, scales fused in the epilogue);
                           "cublas" = torch._int_mm (M padded to >= 32 rows) + a scale epilogue
    CUDA, K or N % 16      `_scaled_gemm_kernel` (Triton, any shape)
Activations are quantized on CUDA by one Triton kernel (kernels/quant_act.py).

The Triton kernel takes int8 or fp8 operands (int32 or fp32 accumulators) and applies both scales
and the bias in its epilogue; it is checked against `scaled_mm_ref` under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.envs import environment_variables
from pagedllm.kernels.quant_act import quantize_activation_triton, scale_epilogue
from pagedllm.kernels.quantized_activation import QuantizedActivation, ScaledOutput
from pagedllm.kernels.w8a8_gemm import W8A8Config, decode_config, w8a8_gemm, w8a8_gemm_config
from pagedllm.kernels.w8a16_gemv import KERNEL_MAX_M, w8a16_linear

__all__ = ["FP8_DTYPE", "FP8_MAX", "INT8_MAX", "PATHS", "QuantizedActivation", "ScaledOutput", "choose_path",
           "defers_scales", "ensure_unit_scale", "materialize", "prequantized_path",
           "quantize_activation", "rowwise_scaled_mm_supported", "scaled_gemm_triton", "scaled_mm_ref", "w8a8_linear"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INT8_MAX = 127.0


def quantize_activation(x: torch.Tensor, qdtype: torch.dtype,
                        static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (xq (M, K) qdtype, scale (M, 1) fp32) with x ~= xq * scale.

    Dynamic (static_scale None): scale = amax(|row|) / qmax, per token, as vLLM's per-token dynamic
    quantization; INT8 rounds half to even (torch.round), as compressed-tensors does.
    """
    xf = x.float()
    qmax = FP8_MAX if qdtype == FP8_DTYPE else INT8_MAX
    if static_scale is None:
        # Divided by a tensor, not a Python float: torch's CUDA division by a CPU scalar multiplies by
        # its reciprocal (an ulp off IEEE now and then), and the Triton kernel divides (div_rn).
        amax = xf.abs().amax(dim=-1, keepdim=True)
        scale = (amax / torch.full_like(amax, qmax)).clamp(min=1e-12)
    else:
        scale = static_scale.float().reshape(1, 1).expand(xf.shape[0], 1)
    y = xf / scale
    if qdtype == FP8_DTYPE:
        return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.contiguous()
    return torch.round(y).clamp(-128, 127).to(torch.int8), scale.contiguous()


def scaled_mm_ref(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(xq @ wq^T) * x_scale * w_scale + bias in fp32, cast to out_dtype."""
    out = (xq.float() @ wq.float().t()) * x_scale.float() * w_scale.float().reshape(1, -1)
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


@triton.jit
def _scaled_gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, out_ptr,
    M, N, K, stride_am, stride_bn, stride_om,
    HAS_BIAS: tl.constexpr, IS_INT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if IS_INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a_mask = m_mask[:, None] & k_mask[None, :]
        b_mask = k_mask[:, None] & n_mask[None, :]
        # b is (N, K) row-major; the tile is read as (BLOCK_K, BLOCK_N) = W^T.
        if IS_INT:
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=a_mask, other=0)
            b = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None], mask=b_mask, other=0)
            acc += tl.dot(a, b, out_dtype=tl.int32)
        else:
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=a_mask, other=0.0)
            b = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None], mask=b_mask, other=0.0)
            acc += tl.dot(a, b, out_dtype=tl.float32)  # fp8 x fp8 on tensor cores (sm_89+)
    a_s = tl.load(as_ptr + offs_m, mask=m_mask, other=0.0)
    b_s = tl.load(bs_ptr + offs_n, mask=n_mask, other=0.0)
    out = acc.to(tl.float32) * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def scaled_gemm_triton(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype,
                       block: tuple[int, int, int] = (16, 64, 128)) -> torch.Tensor:
    """The Triton W8A8 GEMM (int8 or fp8 operands); same contract as `scaled_mm_ref`."""
    m, k = xq.shape
    n = wq.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    bm, bn, bk = block
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _scaled_gemm_kernel[grid](
        xq, wq, x_scale.reshape(-1).float().contiguous(), w_scale.reshape(-1).float().contiguous(),
        bias if bias is not None else out, out, m, n, k, xq.stride(0), wq.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, IS_INT=xq.dtype == torch.int8, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )
    return out


_rowwise: dict[torch.device, bool] = {}


def rowwise_scaled_mm_supported(device: torch.device) -> bool:
    """Whether torch._scaled_mm takes row-wise scales (scale_a (M, 1), scale_b (1, N) fp32, bf16 out) on
    `device` (torch >= 2.5 on sm_90 does). Probed once per device with a tiny GEMM, outside graph
    capture: W8A8LinearMethod calls it after loading; a first call inside a capture answers False."""
    if device not in _rowwise:
        if torch.cuda.is_current_stream_capturing():
            return False
        a = torch.ones(1, 32, device=device).to(FP8_DTYPE)
        b = torch.ones(32, 32, device=device).to(FP8_DTYPE)
        try:
            out = torch._scaled_mm(a, b.t(), scale_a=torch.ones(1, 1, device=device),
                                   scale_b=torch.ones(1, 32, device=device), out_dtype=torch.bfloat16)
            _rowwise[device] = bool((out == 32).all())
        except (RuntimeError, ValueError):
            _rowwise[device] = False
    return _rowwise[device]


# torch._scaled_mm's use_fast_accum (FP8 sums kept in the tensor cores' reduced-precision accumulator
# between promotions), as vLLM's sm_90 CUTLASS FP8 kernels do: on the H200 (scripts/gpu_quant_speed.py,
# Llama-3.1-8B shapes) 5-11% faster at M = 2048 and up to 29% at M = 1, max error vs `scaled_mm_ref`
# 1e-2 of the output's scale instead of 3e-3.
FAST_ACCUM = True


def _fp8_cuda(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None, m: int, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLASLt / CUTLASS FP8: row-wise scales in the GEMM where torch has them, else unit per-tensor
    scales, a bf16 product and the scales applied by `scale_epilogue` (bf16 keeps 8 significant bits
    of the unscaled sum either way)."""
    if rowwise_scaled_mm_supported(xq.device):
        out = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.reshape(1, -1),
                               bias=bias if bias is not None and bias.dtype == torch.bfloat16 else None,
                               out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)
        if bias is not None and bias.dtype != torch.bfloat16:
            out = out + bias
        return out[:m].to(out_dtype)
    one = torch.ones((), dtype=torch.float32, device=xq.device)
    acc = torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)
    return scale_epilogue(acc, x_scale, w_scale, bias, m, out_dtype)


PATHS = ("w8a16", "triton", "cublas")
# Dispatch thresholds, from the H200 sweep of scripts/gpu_w8a8_sweep.py (2026-12-01, Llama-3.1-8B
# linears; one decoder layer's four linears summed, bf16 = 1.00x; BENCHMARKS.md, issue 19):
#   M = 1       "w8a16": fp8 1.48x, int8 1.21x (cuBLAS W8A8 0.91x / 1.05x: one-row FP8 GEMMs + the quant launch)
#   M = 2..16   "w8a16", fp8 1.18-1.21x, int8 1.40-1.45x; fp8 on the widest weights (N >= W8A16_MAX_N:
#               gate_up) "triton" (35.6 us vs 43.1: e4m3 -> bf16 costs three conversions a value)
#   M = 17..64  "triton": fp8 1.33x (cuBLAS 1.14x), int8 1.27x (cuBLAS 1.10x)
#   M > 64      fp8 "cublas" (M = 256 / 2048 / 8192: 1.35 / 1.68 / 1.71x; Triton 1.19 / 1.55 / 1.55x);
#               int8 "triton" (1.12 / 1.27 / 1.37x with the first tiles; cuBLAS _int_mm 0.76 / 0.95 / 1.00x)
W8A16_MAX_M = 16
W8A16_MAX_N = {FP8_DTYPE: 16383, torch.int8: 1 << 62}
TRITON_MAX_M = {FP8_DTYPE: 64, torch.int8: 1 << 62}
# PAGEDLLM_W8A8_SPLIT_K (on by default; 0: the thresholds above alone): FP8 linears of the shapes that
# w8a8_gemm.DECODE_TABLE has take its measured pick at 17-256 rows (a Triton tile, K split in one launch where
# that was faster, or cuBLAS): a Llama-3.1-8B layer's four at M = 32 / 64 / 128 / 192 / 256 in 78.7 / 76.1 /
# 81.4 / 107.6 / 111.1 us against 113.7 / 77.2 / 99.8 / 115.4 / 116.7 before; W1 12,618 against 12,313 tok/s
# (H200, one call, BENCHMARKS.md h51).
SPLIT_K = environment_variables["PAGEDLLM_W8A8_SPLIT_K"]()


def _table_config(m: int, n: int, k: int, qdtype: torch.dtype) -> tuple[bool, W8A8Config | None]:
    """decode_config where the switch is on and the weights are FP8 (the table is FP8's), else (False, None)."""
    if SPLIT_K and qdtype == FP8_DTYPE:
        return decode_config(m, n, k)
    return False, None


def choose_path(m: int, n: int, k: int, qdtype: torch.dtype) -> str:
    """The CUDA path for an (m, k) x (n, k)^T W8A8 linear with K and N multiples of 16."""
    if m == 1 or (m <= W8A16_MAX_M and n <= W8A16_MAX_N[qdtype]):
        return "w8a16"
    found, cfg = _table_config(m, n, k, qdtype)
    if found:
        return "triton" if cfg is not None else "cublas"
    return "triton" if m <= TRITON_MAX_M[qdtype] else "cublas"


def triton_config(m: int, n: int, k: int, qdtype: torch.dtype) -> W8A8Config:
    """The Triton W8A8 GEMM's launch for a linear on the "triton" path: the table's pick, else the M buckets."""
    found, cfg = _table_config(m, n, k, qdtype)
    return cfg if found and cfg is not None else w8a8_gemm_config(m, n, k)


def prequantized_path(m: int, n: int, k: int, qdtype: torch.dtype) -> bool:
    """Whether a producer should hand an (m, k) activation to a dynamic W8A8 linear with (n, k) weights
    already quantized (`QuantizedActivation`): on the paths that quantize it first anyway, "triton" and
    FP8's "cublas" (INT8's cuBLAS path pads rows, which a producer's tensor lacks), K and N multiples of 16."""
    if k % 16 or n % 16:
        return False
    path = choose_path(m, n, k, qdtype)
    return path == "triton" or (path == "cublas" and qdtype == FP8_DTYPE)


# PAGEDLLM_FP8_DEFER_SCALES (on by default; W1 on the H200 with all four linears deferring 12,938 tok/s against
# 12,439 without, a model's log-probabilities as close to its bf16 run's: BENCHMARKS.md, seventeenth session):
# an FP8 linear of the plain Llama layers (TP 1) whose consumer applies the scales (models/llama.py mark_deferred_scales, PAGEDLLM_FP8_DEFER_LINEARS) runs 17-256 rows through cuBLASLt's
# per-tensor FP8 GEMM with unit scales and returns a `ScaledOutput`; the consumer's kernel applies the per-token
# and per-channel scales: the residual add + RMSNorm after o_proj / down_proj (layers/quant_fusion.rms_norm_into),
# SwiGLU after gate_up_proj (silu_and_mul_into), the fused rotary + K/V write after qkv_proj
# (attention/layer.py forward_qkv). cuBLASLt there: o 7.5-9.8 us, down 18.1-27.2 us against the table's
# 9.1-12.6 / 22.0-33.3 (H200, BENCHMARKS.md h51); qkv and gate_up: pagedllm/envs.py PAGEDLLM_FP8_DEFER_LINEARS.
DEFER_SCALES = environment_variables["PAGEDLLM_FP8_DEFER_SCALES"]()
DEFER_MIN_M, DEFER_MAX_M = 17, 256
_unit_scales: dict[torch.device, torch.Tensor] = {}


def ensure_unit_scale(device: torch.device) -> torch.Tensor | None:
    """The device's fp32 1.0 for the unit-scale GEMM (made once, outside any capture; None if first asked
    inside one)."""
    one = _unit_scales.get(device)
    if one is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        one = _unit_scales[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def defers_scales(m: int, n: int, k: int, qdtype: torch.dtype, act_dtype: torch.dtype, dynamic: bool,
                  has_bias: bool) -> bool:
    """Whether an FP8 linear asked to defer its scales does: dynamic per-token activations, bf16, no bias,
    DEFER_MIN_M..DEFER_MAX_M rows, K and N multiples of 16 (elsewhere it returns its scaled output)."""
    return (qdtype == FP8_DTYPE and act_dtype == torch.bfloat16 and dynamic and not has_bias
            and DEFER_MIN_M <= m <= DEFER_MAX_M and k % 16 == 0 and n % 16 == 0)


def materialize(y: ScaledOutput) -> torch.Tensor:
    """y.acc * y.row_scale * y.col_scale in fp32, rounded to y's dtype: what the linear would have returned."""
    return scale_epilogue(y.acc, y.row_scale, y.col_scale, None, y.acc.shape[0], y.acc.dtype)


def _deferred_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                   act_dtype: torch.dtype) -> ScaledOutput | None:
    """cuBLASLt's FP8 GEMM with unit per-tensor scales, the scales left to the consumer; None without a
    unit-scale tensor (first asked inside a capture)."""
    one = ensure_unit_scale(xq.device)
    if one is None:
        return None
    acc = torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=act_dtype, use_fast_accum=FAST_ACCUM)
    return ScaledOutput(acc, x_scale, w_scale)


def w8a8_linear(x: torch.Tensor | QuantizedActivation, wq: torch.Tensor, w_scale: torch.Tensor,
                input_scale: torch.Tensor | None, bias: torch.Tensor | None, path: str | None = None,
                defer_scales: bool = False) -> torch.Tensor | ScaledOutput:
    """x (M, K) float -> (M, N) in x's dtype through the fastest path for the device:

    CPU              quantize_activation + scaled_mm_ref (torch)
    CUDA "w8a16"     w8a16_linear: no activation quantization (input_scale unused: the activations
                     keep their 16 bits), one launch
    CUDA "triton"    quantize_activation_triton + w8a8_gemm (scales and bias in its epilogue)
    CUDA "cublas"    FP8: quantize_activation_triton + torch._scaled_mm; INT8: the quant kernel (rows
                     padded to >= 32: _int_mm needs M > 16) + torch._int_mm + scale_epilogue
    K or N not a multiple of 16: the Triton GEMM (`scaled_gemm_triton`) after the quant kernel.
    `path` (one of PATHS) overrides `choose_path` (the sweep and the tests use it).
    No host syncs on CUDA (graph-capturable). w_scale (N,) fp32; input_scale (1,) or None (dynamic).
    x a `QuantizedActivation` (CUDA, dynamic scales, `prequantized_path` true): straight to the GEMM.
    defer_scales (the caller's consumer applies them): a `ScaledOutput` where `defers_scales` holds (CUDA).
    """
    if path is not None and path not in PATHS:
        raise ValueError(f"w8a8_linear path must be one of {PATHS}, got {path!r}")
    if isinstance(x, QuantizedActivation):
        if defer_scales and x.is_cuda and defers_scales(x.xq.shape[0], wq.shape[0], x.xq.shape[1], wq.dtype,
                                                        x.dtype, input_scale is None, bias is not None):
            out = _deferred_gemm(x.xq, x.scale, wq, w_scale, x.dtype)
            if out is not None:
                return out
        return _prequantized_linear(x, wq, w_scale, input_scale, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = wq.shape[0]
    if not x.is_cuda:
        xq, x_scale = quantize_activation(x2, wq.dtype, input_scale)
        return scaled_mm_ref(xq, wq, x_scale, w_scale, bias, x.dtype).reshape(*lead, n)
    if m == 0:
        return x.new_empty(*lead, n)
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    if defer_scales and x.dim() == 2 and defers_scales(m, n, k, wq.dtype, x.dtype, input_scale is None,
                                                       bias is not None):
        xq, x_scale = quantize_activation_triton(x2, wq.dtype)
        out = _deferred_gemm(xq, x_scale, wq, w_scale, x.dtype)
        if out is not None:
            return out
        return _fp8_cuda(xq, x_scale, wq, w_scale, None, m, x.dtype)
    aligned = k % 16 == 0 and n % 16 == 0
    is_int = wq.dtype == torch.int8
    path = path or choose_path(m, n, k, wq.dtype)
    if aligned and path == "w8a16" and m <= KERNEL_MAX_M:  # (the kernel's limit; dispatch stops at 16)
        return w8a16_linear(x2, wq, w_scale, bias).reshape(*lead, n)
    if aligned and path == "triton":
        xq, x_scale = quantize_activation_triton(x2, wq.dtype, input_scale)
        return w8a8_gemm(xq, wq, x_scale, w_scale, bias, x.dtype,
                         config=triton_config(m, n, k, wq.dtype)).reshape(*lead, n)
    pad = max(32, triton.cdiv(m, 8) * 8) if is_int and aligned else m  # _int_mm needs M > 16
    xq, x_scale = quantize_activation_triton(x2, wq.dtype, input_scale, rows=pad)
    if not aligned:
        out = scaled_gemm_triton(xq, wq, x_scale, w_scale, bias, x.dtype)
    elif is_int:
        out = scale_epilogue(torch._int_mm(xq, wq.t()), x_scale, w_scale, bias, m, x.dtype)
    else:
        out = _fp8_cuda(xq, x_scale, wq, w_scale, bias, m, x.dtype)
    return out.reshape(*lead, n)


def _prequantized_linear(x: QuantizedActivation, wq: torch.Tensor, w_scale: torch.Tensor,
                         input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.xq.shape
    n = wq.shape[0]
    if input_scale is not None or x.xq.dtype != wq.dtype or not prequantized_path(m, n, k, wq.dtype):
        raise ValueError(
            f"a pre-quantized {x.xq.dtype} activation ({m} x {k}) does not fit this linear ({wq.dtype} weights "
            f"{n} x {wq.shape[1]}, {'static' if input_scale is not None else 'dynamic'} input scale): its "
            "producer must check scaled_mm.prequantized_path")
    if not x.is_cuda:  # the reference (a test's interpreted producer kernels hand CPU tensors)
        return scaled_mm_ref(x.xq, wq, x.scale, w_scale, bias, x.dtype)
    if choose_path(m, n, k, wq.dtype) == "triton":
        return w8a8_gemm(x.xq, wq, x.scale, w_scale, bias, x.dtype, config=triton_config(m, n, k, wq.dtype))
    return _fp8_cuda(x.xq, x.scale, wq, w_scale, bias, m, x.dtype)
