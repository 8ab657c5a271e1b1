"""Activation quantization for the W8A8 GEMMs, and their scale epilogue: one Triton kernel each.

    quantize_activation_triton  x (M, K) bf16/fp16/fp32 -> xq (M_pad, K) fp8/int8, scale (M_pad, 1) fp32
        dynamic: one program per row: amax(|row|), scale = max(amax / qmax, 1e-12),
                 xq = cast(clamp(x / scale)) (rows <= 16384 wide read once; wider: a second pass)
        static:  scale = the checkpoint's one scalar, read on the device (no .item(): graph-safe)
        INT8 rounds half to even ((y + 1.5 * 2^23) - 1.5 * 2^23, exact for |y| <= 2^22), as
        torch.round in the reference; FP8 rounds to nearest even in the conversion, saturating at 448.
        M_pad >= M: rows past M are left unwritten (torch._int_mm needs M > 16: the GEMM runs on
        garbage rows there whose outputs nobody reads, instead of a copy to pad x).

    scale_epilogue  acc (M_pad, N) int32/bf16/fp32 -> out (M, N) = acc * x_scale * w_scale[None] + bias
        after a GEMM that could not apply the scales itself (torch._int_mm; per-tensor _scaled_mm).

    rms_norm_quant       (residual add +) RMSNorm and the dynamic quantization of its output in one program
                         a row: the normed row is rounded to x's dtype (what the unfused norm stores and
                         the quantizer reads) and quantized from registers; = quantize_activation(rms_norm(..))
    silu_and_mul_quant   SwiGLU's silu(gate) * up, rounded to x's dtype, then quantized the same way: one
                         launch and no (M, I) 16-bit intermediate in memory
Both fused ones take `in_scales` (a ScaledOutput's row and column scales, PAGEDLLM_FP8_DEFER_SCALES=1): x is
then the FP8 GEMM's unscaled sums, scaled and rounded to x's dtype in the kernel as materialize would.
The two fused ones feed a W8A8 linear (scaled_mm.QuantizedActivation) in place of the norm or activation
kernel followed by the quantizer: one launch instead of two at every linear they precede.

Replaces what was five to eight torch ops over the activations (x.float(), abs, amax, divide, clamp,
cast): at M = 2048, K = 14336 those passes cost more than the FP8 GEMM they fed (BENCHMARKS.md).
Reference: `scaled_mm.quantize_activation` (torch) and `scaled_mm.scaled_mm_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.quantized_activation import apply_in_scales, check_in_scales
from pagedllm.kernels.rmsnorm import add_residual_rms_norm

__all__ = ["quantize_activation_triton", "rms_norm_quant", "rms_norm_quant_ref", "scale_epilogue", "silu_and_mul_quant",
           "silu_and_mul_quant_ref"]

_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: adding and subtracting it rounds an fp32 to an integer, ties to even


def row_warps(block: int, most: int = 16) -> int:
    """Warps of a one-row-a-program kernel over `block` values: one per 256 values, at most `most`.
    SwiGLU applying a deferring gate_up's scales takes up to 32: on the H200 its 16,384-value rows ran
    1.15-1.2x faster at 32 warps than at 16 from 32 to 8192 rows, the same bytes out; the other row
    kernels (and SwiGLU without scales) were fastest at 16 (BENCHMARKS.md, issue 19, eighteenth session)."""
    return max(1, min(most, block // 256))


@triton.jit
def _quantize(x, scale, QMAX: tl.constexpr, IS_INT: tl.constexpr):
    # IEEE division (tl.math.div_rn), as torch divides: Triton's `/` is the approximate div.full.f32,
    # which moved roundings off the reference's on the H200.
    # fp32 values ready for the cast to int8 (integral) or fp8 (the conversion rounds to nearest even).
    y = tl.math.div_rn(x, scale)
    if IS_INT:
        y = tl.minimum(tl.maximum(y, -128.0), 127.0)
        y = (y + _ROUND_MAGIC) - _ROUND_MAGIC
    else:
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    return y


@triton.jit
def _quant_row_kernel(
    x_ptr, xq_ptr, scale_ptr, static_ptr,
    K, stride_xm, stride_qm,
    QMAX: tl.constexpr, IS_INT: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    q_row = xq_ptr + row * stride_qm
    if ONE_PASS:  # the whole row in registers (K <= BLOCK): read once
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), QMAX), 1e-12)
        tl.store(scale_ptr + row, scale)
        tl.store(q_row + offs, _quantize(x, scale, QMAX, IS_INT).to(xq_ptr.dtype.element_ty), mask=mask)
    else:
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), QMAX), 1e-12)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, _quantize(x, scale, QMAX, IS_INT).to(xq_ptr.dtype.element_ty), mask=mask)


def quantize_activation_triton(x: torch.Tensor, qdtype: torch.dtype, static_scale: torch.Tensor | None = None,
                               rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (xq (rows, K) qdtype, scale (rows, 1) fp32), rows = max(M, `rows`); the first M rows
    equal `scaled_mm.quantize_activation(x, qdtype, static_scale)`."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected a row-major (M, K) activation, got shape {tuple(x.shape)} strides {x.stride()}")
    if qdtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"activations quantize to int8 or float8_e4m3fn, not {qdtype}")
    m, k = x.shape
    total = max(m, rows or 0)
    xq = torch.empty((total, k), dtype=qdtype, device=x.device)
    scale = torch.empty((total, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return xq, scale
    is_int = qdtype == torch.int8
    # Rows up to 16384 wide (Llama-3.1-8B's 14336 included) are read once, from registers (16 warps:
    # 32 values a thread); wider rows take two passes of 4096.
    one_pass = k <= 16384
    block = triton.next_power_of_2(k) if one_pass else 4096
    _quant_row_kernel[(m,)](
        x, xq, scale, static_scale if static_scale is not None else scale, k, x.stride(0), xq.stride(0),
        QMAX=127.0 if is_int else 448.0, IS_INT=is_int, STATIC=static_scale is not None, BLOCK=block,
        ONE_PASS=one_pass, num_warps=row_warps(block),
    )
    return xq, scale


@triton.jit
def _scale_epilogue_kernel(
    acc_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, stride_am, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask = mask_m[:, None] & mask_n[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    acc = tl.load(acc_ptr + rows * stride_am + offs_n[None, :], mask=mask, other=0).to(tl.float32)
    xs = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
    ws = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    out = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def scale_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   m: int, out_dtype: torch.dtype) -> torch.Tensor:
    """out (m, N) = acc[:m] * x_scale[:m] * w_scale[None, :] (+ bias), computed in fp32. acc (>= m, N)
    row-major; x_scale (>= m, 1) and w_scale (N,) fp32."""
    n = acc.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    if m == 0:
        return out
    block_m, block_n = 16, 256
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _scale_epilogue_kernel[grid](
        acc, x_scale, w_scale, bias if bias is not None else w_scale, out, m, n, acc.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )
    return out


@triton.jit
def _quant_store_row(y, mask, q_row, scale_ptr, row, QMAX: tl.constexpr, IS_INT: tl.constexpr):
    """Dynamic per-row quantization of y (BLOCK,) fp32 (already rounded to the activation dtype)."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), 0), QMAX), 1e-12)
    tl.store(scale_ptr + row, scale)
    tl.store(q_row + tl.arange(0, y.shape[0]), _quantize(y, scale, QMAX, IS_INT).to(q_row.dtype.element_ty),
             mask=mask)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, residual_ptr, weight_ptr, xq_ptr, scale_ptr, residual_out_ptr, row_scale_ptr, col_scale_ptr,
    hidden, eps, stride_x, stride_r, stride_q, stride_ro,
    QMAX: tl.constexpr, IS_INT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, IN_SCALES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row; the arithmetic of rmsnorm._rms_norm_kernel (add_residual_rms_norm), then the quantizer's. IN_SCALES: x is
    # a ScaledOutput's unscaled sums, scaled here by the row's and the columns' scales and rounded to the
    # activation dtype, as kernels/scaled_mm.materialize would store it.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    act_dtype = x.dtype
    x = x.to(tl.float32)
    if IN_SCALES:
        cs = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
        x = (x * tl.load(row_scale_ptr + row) * cs).to(act_dtype).to(tl.float32)
    y = add_residual_rms_norm(x, row, cols, mask, residual_ptr, residual_out_ptr, weight_ptr, stride_r, stride_ro,
                              hidden, eps, HAS_RESIDUAL)
    y = y.to(act_dtype).to(tl.float32)  # the normed activation as the unfused norm stores it
    _quant_store_row(y, mask, xq_ptr + row * stride_q, scale_ptr, row, QMAX, IS_INT)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr, xq_ptr, scale_ptr, row_scale_ptr, col_scale_ptr, inter, stride_x, stride_q,
    QMAX: tl.constexpr, IS_INT: tl.constexpr, IN_SCALES: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per row (the whole intermediate row in registers: the per-row amax needs all of it);
    # the arithmetic of activation._silu_and_mul_kernel, then the quantizer's. IN_SCALES: x is a
    # ScaledOutput's unscaled sums; gate (columns c) and up (columns I + c) are each scaled by the row's and
    # their columns' scales and rounded to the activation dtype first, as kernels/scaled_mm.materialize
    # would store them.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    act_dtype = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if IN_SCALES:
        rs = tl.load(row_scale_ptr + row)
        gate = (gate * rs * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)).to(act_dtype).to(tl.float32)
        up = (up * rs * tl.load(col_scale_ptr + inter + cols, mask=mask, other=0.0)).to(act_dtype).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(act_dtype).to(tl.float32)
    _quant_store_row(y, mask, xq_ptr + row * stride_q, scale_ptr, row, QMAX, IS_INT)


_FUSED_MAX_WIDTH = 16384  # a row in one program's registers (16 warps: 32 values a thread)


def _check_fused(x: torch.Tensor, width: int, qdtype: torch.dtype, what: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{what}: expected a row-major (M, K) activation, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if qdtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"{what}: activations quantize to int8 or float8_e4m3fn, not {qdtype}")
    if width > _FUSED_MAX_WIDTH:
        raise ValueError(f"{what}: rows of {width} values exceed the fused kernel's {_FUSED_MAX_WIDTH}")


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, qdtype: torch.dtype,
                   residual: torch.Tensor | None = None,
                   in_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x (M, K) [+ residual (M, K)] -> (xq (M, K) qdtype, scale (M, 1) fp32, x + residual or None):
    `rms_norm_quant_ref`, in one launch. in_scales (row (M, 1), col (K,) fp32): x is a ScaledOutput's unscaled
    sums, x * row * col the activation."""
    _check_fused(x, x.shape[-1], qdtype, "rms_norm_quant")
    m, k = x.shape
    check_in_scales(in_scales, m, k, "rms_norm_quant")
    if weight.shape != (k,):
        raise ValueError(f"rms_norm_quant: weight must have shape ({k},), got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"rms_norm_quant: residual {tuple(residual.shape)} must be a row-major {tuple(x.shape)}")
    xq = torch.empty((m, k), dtype=qdtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else None
    if m:
        block = triton.next_power_of_2(k)
        is_int = qdtype == torch.int8
        rs, cs = in_scales if in_scales is not None else (scale, scale)
        _rms_norm_quant_kernel[(m,)](
            x, residual if residual is not None else x, weight, xq, scale, r_out if r_out is not None else x,
            rs, cs, k, eps, x.stride(0), residual.stride(0) if residual is not None else 0, xq.stride(0),
            r_out.stride(0) if r_out is not None else 0,
            QMAX=127.0 if is_int else 448.0, IS_INT=is_int, HAS_RESIDUAL=residual is not None,
            IN_SCALES=in_scales is not None, BLOCK=block, num_warps=row_warps(block),
        )
    return xq, scale, r_out


def silu_and_mul_quant(x: torch.Tensor, qdtype: torch.dtype,
                       in_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, 2 * I) = [gate | up] -> (xq (M, I) qdtype, scale (M, 1) fp32): `silu_and_mul_quant_ref`, in one
    launch. in_scales (row (M, 1), col (2 * I,) fp32): x is a ScaledOutput's unscaled sums (gate_up_proj's),
    x * row * col the activation."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul_quant: last dim must be even (gate and up halves), got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    _check_fused(x, inter, qdtype, "silu_and_mul_quant")
    m = x.shape[0]
    check_in_scales(in_scales, m, 2 * inter, "silu_and_mul_quant")
    xq = torch.empty((m, inter), dtype=qdtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(inter)
        is_int = qdtype == torch.int8
        rs, cs = in_scales if in_scales is not None else (scale, scale)
        warps = row_warps(block, 32 if in_scales is not None else 16)
        _silu_and_mul_quant_kernel[(m,)](
            x, xq, scale, rs, cs, inter, x.stride(0), xq.stride(0), QMAX=127.0 if is_int else 448.0, IS_INT=is_int,
            IN_SCALES=in_scales is not None, BLOCK=block, num_warps=warps,
        )
    return xq, scale


def rms_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, qdtype: torch.dtype,
                       residual: torch.Tensor | None = None,
                       in_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The unfused pair: rmsnorm.rms_norm_ref, then scaled_mm.quantize_activation (dynamic); in_scales
    applied to x first (x * row * col in fp32, rounded to x's dtype)."""
    from pagedllm.kernels.rmsnorm import rms_norm_ref
    from pagedllm.kernels.scaled_mm import quantize_activation

    x = apply_in_scales(x, in_scales)
    if residual is None:
        normed, r_out = rms_norm_ref(x, weight, eps), None
    else:
        normed, r_out = rms_norm_ref(x, weight, eps, residual)
    xq, scale = quantize_activation(normed, qdtype)
    return xq, scale, r_out


def silu_and_mul_quant_ref(x: torch.Tensor, qdtype: torch.dtype,
                           in_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused pair: activation.silu_and_mul_ref, then scaled_mm.quantize_activation (dynamic); in_scales
    applied to x first (x * row * col in fp32, rounded to x's dtype)."""
    from pagedllm.kernels.activation import silu_and_mul_ref
    from pagedllm.kernels.scaled_mm import quantize_activation

    return quantize_activation(silu_and_mul_ref(apply_in_scales(x, in_scales)), qdtype)
