"""Block-wise FP8 linear (DeepSeek-V3 / Qwen3-FP8 checkpoints, `weight_block_size` [block_n, block_k]).

    weight     q (N, K) float8_e4m3fn
    scale_inv  sw (ceil(N / bn), ceil(K / bk)) fp32; despite the name a multiplier:
               w[n, k] = q[n, k] * sw[n // bn, k // bk]                       (DeepSeek's weight_dequant)
    x (M, K)   quantized per token and group of bk inputs (dynamic, as vLLM's per_token_group_quant_fp8):
               s[m, g] = max(amax(|x[m, g*bk : (g+1)*bk]|) / 448, 1e-12),  qa = (x / s).clamp(+-448) -> e4m3
    y[m, n]  = sum_g s[m, g] * sw[n // bn, g] * sum_{k in group g} qa[m, k] * q[n, k]   (fp32) + bias

Worked example of the grids: N 100, K 200, block (64, 48): sw is (2, 5); rows 64..99 share sw[1, :],
inputs 192..199 (a ragged last group of 8) share sw[:, 4] and each token's s[:, 4].

Where each runs (`fp8_block_linear`):
    CPU    `fp8_block_linear_ref`: the activations quantized in torch, both operands dequantized in
           fp32 and multiplied (exact products, fp32 sums): what transformers computes on the
           dequantized weights with the same activation rounding (tests/quantization)
    sm_90  bf16 activations, 128 x 128 blocks (N whole blocks, K whole groups of 4 blocks), CUDA >= 12.9:
           the quantizer below, its scales column-major, rows padded to 4, then cuBLASLt's block-scaled GEMM
           (`fp8_block_gemm_cublas`; PAGEDLLM_FP8_BLOCK_CUBLAS=0 keeps the Triton GEMM)
    CUDA   `per_token_group_quant_fp8` (Triton, ~1024 inputs of one token a program), then
           `fp8_block_gemm` (Triton): one fp8 `tl.dot` per K group, its fp32 partial scaled by
           s[:, g] x sw[:, g] before it joins the accumulator (the design of vLLM's
           `_w8a8_block_fp8_matmul`); bias and the cast to the activation dtype in the epilogue.
           Where block_n is a multiple of BLOCK_N (128 x 128 blocks) a tile's columns share one
           weight scale per group, loaded as a scalar: at (128, 128) tiles that took the kernel from
           255 registers and a spill to 180 (tests/kernels/sm90_compile_check.py).

The GEMM's reference is `fp8_block_gemm_ref` (the same group-wise sums in torch); the quantizer's is
`per_token_group_quant_fp8_ref`. Both Triton kernels are held to them under TRITON_INTERPRET=1, whose
fp8 `tl.dot` takes e4m3 operands as the W8A8 GEMM's tests do (tests/kernels/test_fp8_block_gemm.py).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.envs import environment_variables
from pagedllm.kernels.device_info import device_index, is_sm90
from pagedllm.kernels.tile_order import grouped_tile

__all__ = ["Fp8BlockConfig", "fp8_block_gemm", "fp8_block_gemm_config", "fp8_block_gemm_ref", "fp8_block_linear",
           "fp8_block_linear_ref", "per_token_group_quant_fp8", "per_token_group_quant_fp8_ref"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FLOOR = 1e-12  # an all-zero group keeps a finite, non-zero scale (its codes are all 0)
_QMAX = tl.constexpr(FP8_MAX)  # the kernels' copies (a @jit function reads only constexpr globals)
_FLOOR = tl.constexpr(SCALE_FLOOR)
CUBLAS_BLOCK = environment_variables["PAGEDLLM_FP8_BLOCK_CUBLAS"]()
logger = logging.getLogger(__name__)


# -- activations: per token, per group of `group` inputs ----------------------------------------------
def per_token_group_quant_fp8_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (qa (M, K) float8_e4m3fn, s (M, ceil(K / group)) fp32), x ~= qa * s per group.

    The last group may be ragged (K % group): its amax is over the inputs it has.
    """
    m, k = x.shape
    groups = triton.cdiv(k, group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k))  # zeros change no amax
    xg = xf.reshape(m, groups, group)
    amax = xg.abs().amax(dim=-1)
    # Divided by a tensor, not a Python float, as scaled_mm.quantize_activation (and the kernel: div_rn)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=SCALE_FLOOR)
    qa = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(m, groups * group)[:, :k]
    return qa.contiguous(), scale


@triton.jit
def _per_token_group_quant_kernel(x_ptr, q_ptr, s_ptr, K, GROUP, GROUPS, stride_xm, stride_qm, stride_sm, stride_sg,
                                  BLOCK: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr):
    # program (row, p): groups [p * GPP, (p + 1) * GPP) of one token as a (GPP, BLOCK) tile, group g holding
    # inputs [g * GROUP, min((g + 1) * GROUP, K)); BLOCK = next_pow2(GROUP), the extra lanes masked
    row = tl.program_id(0).to(tl.int64)
    gs = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)  # (GPP,)
    lane = tl.arange(0, BLOCK)
    offs = gs[:, None] * GROUP + lane[None, :]
    mask = (lane[None, :] < GROUP) & (offs < K) & (gs[:, None] < GROUPS)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions (div_rn), as torch divides: the approximate `/` moves roundings off the reference's
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 1), _QMAX), _FLOOR)  # (GPP,)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -_QMAX), _QMAX)
    tl.store(q_ptr + row * stride_qm + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + gs * stride_sg, scale, mask=gs < GROUPS)


def per_token_group_quant_fp8(x: torch.Tensor, group: int, column_major_scales: bool = False,
                              row_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`per_token_group_quant_fp8_ref` in one Triton launch: x (M, K) row-major -> (qa (M', K) fp8,
    s (M', ceil(K / group)) fp32), M' = M rounded up to `row_multiple` (rows past M are left unwritten: a
    GEMM's rows from them are dropped). s row-major or, with `column_major_scales`, strides (1, M') (the
    layout cuBLASLt's 1 x 128 scales take). No host syncs (graph-capturable)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected a row-major (M, K) activation, got shape {tuple(x.shape)} strides {x.stride()}")
    if group <= 0:
        raise ValueError(f"the quantization group must be positive, got {group}")
    m, k = x.shape
    rows = -(-m // row_multiple) * row_multiple
    groups = triton.cdiv(k, group)
    qa = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    if column_major_scales:
        scale = torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return qa, scale
    block = triton.next_power_of_2(group)
    # ~1024 inputs a program: one program per 128-input group made a million programs of one warp at 8192
    # tokens x 14336 inputs (BENCHMARKS.md, twenty-third session)
    gpp = max(1, min(triton.next_power_of_2(groups), 1024 // block))
    _per_token_group_quant_kernel[(m, triton.cdiv(groups, gpp))](
        x, qa, scale, k, group, groups, x.stride(0), qa.stride(0), scale.stride(0), scale.stride(1),
        BLOCK=block, GROUPS_PER_PROGRAM=gpp, num_warps=max(1, min(8, gpp * block // 256)),
    )
    return qa, scale


# -- the GEMM on quantized operands --------------------------------------------------------------------
def _expand_scales(sw: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """sw (ceil(n / bn), ceil(k / bk)) -> (n, k): each block's scale on each of its elements."""
    bn, bk = block
    return sw.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def fp8_block_gemm_ref(qa: torch.Tensor, a_scales: torch.Tensor, qweight: torch.Tensor, scale_inv: torch.Tensor,
                       block: tuple[int, int], out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[m, n] = sum_g a_s[m, g] * sw[n // bn, g] * (qa[m, group g] . q[n, group g]) + bias, in fp32, as
    `fp8_block_gemm` sums (one fp32 product per group, scaled, then accumulated group by group).

    qa (M, K) fp8, a_scales (M, G) fp32, qweight (N, K) fp8, scale_inv (ceil(N / bn), G), G = ceil(K / bk).
    """
    bn, bk = block
    m, k = qa.shape
    n = qweight.shape[0]
    w_rows = scale_inv.float().repeat_interleave(bn, dim=0)[:n]  # (N, G): each output row's group scales
    acc = torch.zeros(m, n, dtype=torch.float32, device=qa.device)
    for g in range(triton.cdiv(k, bk)):
        part = qa[:, g * bk:(g + 1) * bk].float() @ qweight[:, g * bk:(g + 1) * bk].float().t()
        acc += part * a_scales[:, g:g + 1].float() * w_rows[None, :, g].reshape(1, n)
    if bias is not None:
        acc += bias.float()
    return acc.to(out_dtype)


class Fp8BlockConfig(NamedTuple):
    BLOCK_M: int
    BLOCK_N: int
    GROUP_M: int  # row blocks walked per column group (L2 reuse of the weight tiles, kernels/tile_order.py)
    num_warps: int
    num_stages: int


def fp8_block_gemm_config(m: int, n: int) -> Fp8BlockConfig:
    """The tile per row bucket (BLOCK_K is the checkpoint's block_k). Not yet swept on a GPU: the shapes of
    vLLM's untuned default (64-row tiles, BLOCK_N 128) above 16 rows; 16-row tiles of 64 columns below, so a
    decode step of Llama-3.1-8B's widths (N 4096) still spreads over 64 programs."""
    if m <= 16:
        return Fp8BlockConfig(16, 64, 8, 4, 4)
    if m <= 128:
        return Fp8BlockConfig(64, 128, 8, 4, 3)
    return Fp8BlockConfig(128, 128, 8, 8, 3)


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, out_ptr,
    M, N, K, GROUP_N, GROUP_K,
    stride_am, stride_bn, stride_asm, stride_asg, stride_bsn, stride_bsg, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, ONE_BLOCK_ROW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # a (M, K) fp8 row-major, b (N, K) fp8 row-major (nn.Linear's layout: K-major for the B operand, so
    # tl.trans(b) feeds the 8-bit wgmma without a shuffle, as kernels/w8a8_gemm.py); as (M, G) and
    # bs (ceil(N / GROUP_N), G) fp32 with G = cdiv(K, GROUP_K). Step g covers inputs [g * GROUP_K, +GROUP_K):
    # BLOCK_K = GROUP_K (a power of two >= 32) or the next power of two above it, the extra lanes masked.
    pid = tl.program_id(0)
    pm, pn = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Edge rows / columns read row 0 instead of being masked (their results are never stored).
    rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_b = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + offs_k[None, :]  # (BLOCK_N, BLOCK_K), K contiguous
    as_ptrs = as_ptr + rows_a * stride_asm  # (BLOCK_M,) this tile's rows' scales of group 0
    if ONE_BLOCK_ROW:  # GROUP_N a multiple of BLOCK_N: the tile's columns share one weight scale per group
        bs_ptrs = bs_ptr + ((pn * BLOCK_N) // GROUP_N) * stride_bsn
    else:  # (BLOCK_N,) each column's block row, group 0
        bs_ptrs = bs_ptr + (rows_b // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, GROUP_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:  # a ragged last group, or BLOCK_K wider than the group
            k_mask = (offs_k < GROUP_K) & (g * GROUP_K + offs_k < K)
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[None, :], other=0.0)
        a_s = tl.load(as_ptrs + g * stride_asg)
        b_s = tl.load(bs_ptrs + g * stride_bsg)
        # One group's exact-product fp32 sum, scaled by its token and weight-block scales, then accumulated.
        if ONE_BLOCK_ROW:
            scale = a_s[:, None] * b_s
        else:
            scale = a_s[:, None] * b_s[None, :]
        acc += tl.dot(a, tl.trans(b), out_dtype=tl.float32) * scale
        a_ptrs += GROUP_K
        b_ptrs += GROUP_K
    m_mask = offs_m < M
    n_mask = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _check_operands(qa: torch.Tensor, a_scales: torch.Tensor, qweight: torch.Tensor, scale_inv: torch.Tensor,
                    block: tuple[int, int]) -> None:
    bn, bk = block
    if qa.dtype != FP8_DTYPE or qweight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_block_gemm takes float8_e4m3fn operands, got {qa.dtype} and {qweight.dtype}")
    if qa.dim() != 2 or qweight.dim() != 2 or qa.shape[1] != qweight.shape[1]:
        raise ValueError(f"expected qa (M, K) and qweight (N, K), got {tuple(qa.shape)} and {tuple(qweight.shape)}")
    (m, k), n = qa.shape, qweight.shape[0]
    groups = triton.cdiv(k, bk)
    if tuple(a_scales.shape) != (m, groups) or tuple(scale_inv.shape) != (triton.cdiv(n, bn), groups):
        raise ValueError(f"block ({bn}, {bk}), qa {tuple(qa.shape)}, qweight {tuple(qweight.shape)}: expected a_scales "
                         f"({m}, {groups}) and scale_inv ({triton.cdiv(n, bn)}, {groups}), got "
                         f"{tuple(a_scales.shape)} and {tuple(scale_inv.shape)}")
    if qa.stride(1) != 1 or qweight.stride(1) != 1:
        raise ValueError("fp8_block_gemm needs K-contiguous operands")


def fp8_block_gemm(qa: torch.Tensor, a_scales: torch.Tensor, qweight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int], out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                   config: Fp8BlockConfig | None = None) -> torch.Tensor:
    """`fp8_block_gemm_ref`'s contract in one Triton launch -> (M, N) out_dtype. Any M, N, K (ragged tiles
    and a ragged last group); block_k any positive size (BLOCK_K its next power of two >= 32, masked where
    wider). No host syncs (graph-capturable)."""
    _check_operands(qa, a_scales, qweight, scale_inv, block)
    bn, bk = block
    (m, k), n = qa.shape, qweight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=qa.device)
    if m == 0 or n == 0:
        return out
    cfg = config or fp8_block_gemm_config(m, n)
    block_k = max(32, triton.next_power_of_2(bk))  # 8-bit dots take K >= 32
    grid = (triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N),)
    _fp8_block_gemm_kernel[grid](
        qa, qweight, a_scales, scale_inv, bias if bias is not None else scale_inv, out,
        m, n, k, bn, bk,
        qa.stride(0), qweight.stride(0), a_scales.stride(0), a_scales.stride(1), scale_inv.stride(0),
        scale_inv.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=block_k == bk and k % bk == 0, ONE_BLOCK_ROW=bn % cfg.BLOCK_N == 0,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=block_k, GROUP_M=cfg.GROUP_M,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# -- the linear ---------------------------------------------------------------------------------------
def fp8_block_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N) in x's dtype: the activations quantized per token group, then the dequantized
    operands multiplied in fp32 (qa * s) @ (q * sw)^T + bias. The CPU path and the whole method's reference."""
    n, k = qweight.shape
    bk = block[1]
    qa, s = per_token_group_quant_fp8_ref(x, bk)
    xd = qa.float() * s.repeat_interleave(bk, dim=1)[:, :k]  # (M, K)
    wd = qweight.float() * _expand_scales(scale_inv, n, k, block)  # (N, K)
    out = xd @ wd.t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


_CUBLAS_BLOCK_DEVICES: dict[int, bool] = {}  # device index -> cuBLASLt's block-scaled GEMM ran there


def _cublas_block_device(index: int) -> bool:
    """cuBLASLt's block-scaled FP8 GEMM exists on sm_90 from CUDA 12.9 (torch's _scaled_mm takes it there); the
    first call on a device also runs one small such GEMM, since the cuBLAS library loaded may still refuse it
    (then the Triton kernel runs, and the log says why). Never probed inside a CUDA-graph capture: the start-up's
    eager passes come first, and a capture before any of them gets the Triton kernel."""
    known = _CUBLAS_BLOCK_DEVICES.get(index)
    if known is not None:
        return known
    if torch.cuda.is_current_stream_capturing():
        return False
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    ok = is_sm90(index) and cuda >= (12, 9)
    if ok:
        dev = torch.device("cuda", index)
        try:  # M 4, N 128, K 512: the smallest shapes the rules below let through
            fp8_block_gemm_cublas(torch.zeros(4, 512, dtype=FP8_DTYPE, device=dev),
                                  torch.ones(4, 4, device=dev).t(), torch.zeros(128, 512, dtype=FP8_DTYPE, device=dev),
                                  torch.ones(1, 4, device=dev), torch.bfloat16)
        except RuntimeError as e:
            logger.warning("block-wise FP8 on cuda:%d: cuBLASLt's block-scaled GEMM failed (%s); the Triton "
                           "kernel runs instead", index, str(e).splitlines()[0][:200])
            ok = False
    _CUBLAS_BLOCK_DEVICES[index] = ok
    return ok


def cublas_block_shape_ok(n: int, k: int, block: tuple[int, int]) -> bool:
    """The shapes cuBLASLt's block-scaled GEMM takes from us: 128 x 128 blocks, N and K whole blocks, and K/128 a
    multiple of 4 (cuBLASLt reads the weight grid as a (K/128, N/128) matrix whose columns are padded to 4; ours
    is unpadded)."""
    return tuple(block) == (128, 128) and n % 128 == 0 and k % 512 == 0


def cublas_block_ok(x: torch.Tensor, qweight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether `fp8_block_linear` runs cuBLASLt's 1 x 128 x 128 x 128 GEMM: `CUBLAS_BLOCK` on, a CUDA sm_90
    device with CUDA >= 12.9, bf16 activations (the output dtype measured and probed; fp16 models keep the
    Triton GEMM) and `cublas_block_shape_ok`."""
    return (CUBLAS_BLOCK and x.is_cuda and x.dtype == torch.bfloat16
            and cublas_block_shape_ok(*qweight.shape, block) and _cublas_block_device(device_index(x)))


def fp8_block_gemm_cublas(qa: torch.Tensor, a_scales: torch.Tensor, qweight: torch.Tensor,
                          scale_inv: torch.Tensor, out_dtype: torch.dtype,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_block_gemm_ref`'s contract for 128 x 128 blocks on cuBLASLt: a_scales (M, K/128) with strides
    (1, M) (`per_token_group_quant_fp8(..., column_major_scales=True)`), M a multiple of 4 (cuBLASLt finds no
    algorithm otherwise: CUBLAS_STATUS_NOT_SUPPORTED at M 1-3, 5, 7, 15, 17 on an H100), scale_inv (N/128, K/128)
    row-major, passed as its transpose (strides (1, K/128))."""
    out = torch._scaled_mm(qa, qweight.t(), scale_a=a_scales, scale_b=scale_inv.t(), out_dtype=out_dtype)
    return out if bias is None else out.add_(bias)


def fp8_block_linear(x: torch.Tensor, qweight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + bias for a block-wise FP8 weight; x (..., K) -> (..., N) in x's dtype."""
    k = qweight.shape[1]
    x2 = x.reshape(-1, k)
    if cublas_block_ok(x, qweight, block):
        # cuBLASLt takes the 1 x 128 grid only with a row count that is a multiple of 4: padded rows, dropped
        qa, s = per_token_group_quant_fp8(x2.contiguous(), 128, column_major_scales=True, row_multiple=4)
        out = fp8_block_gemm_cublas(qa, s, qweight, scale_inv, x.dtype, bias)[:x2.shape[0]]
    elif x.is_cuda:
        qa, s = per_token_group_quant_fp8(x2.contiguous(), block[1])
        out = fp8_block_gemm(qa, s, qweight, scale_inv, block, x.dtype, bias)
    else:
        out = fp8_block_linear_ref(x2, qweight, scale_inv, block, bias)
    return out.reshape(*x.shape[:-1], qweight.shape[0])
