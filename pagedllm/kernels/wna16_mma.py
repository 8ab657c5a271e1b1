"""Int4 weight x 16-bit activation GEMM for decode batches of 2..~1024 rows: one tensor-core dot per
128-input step (wgmma on sm_90), computed transposed, out^T = W^T x^T, so that the weights, dequantized in
registers, are the dot's register operand and x^T the shared-memory one.

Layout: kernels/wna16_gemm.py's, untouched (qweight (K // 8, N) int32, nibble i of word row r holds
input 8r + i; scales / zeros (K // G, N)).

Why a third int4 kernel (H200, BENCHMARKS.md issue 19): from ~64 rows on the tensor-core GEMV
(wna16_tc.py: one K = 16 dot per nibble plane, 8 a step) lost to dequantize + cuBLAS, which writes and
re-reads the whole weight in bf16 every call (Llama-3.1-8B gate_up at 256 rows: 170 us against bf16
cuBLAS's 93). A step here:

    words (BLOCK_KW, BLOCK_N) int32, transposed (a layout, not a move)
      --LOP3 + 2 HFMA2 a register--> 8 tiles w_i (BLOCK_N, BLOCK_KW) = (q_i - z) * s in x's dtype
      --join x3, reshape--> W^T (BLOCK_N, BLOCK_K), column 8r + i = w_i[:, r]   (natural input order)
    acc (BLOCK_N, BLOCK_M) fp32 = tl.dot(W^T, x[rows, k0:k0 + BLOCK_K]^T, acc)

The dequantization is wna16_tc's PRESCALE arithmetic: OFF + q by one LOP3 with a magic exponent, then
+ -(OFF + z) (exact) and * s (the one rounding, as a dequantized weight), two packed FMAs for two values.
The join order: join(join(join(w0, w4), join(w2, w6)), join(join(w1, w5), join(w3, w7))) holds
w_(4a + 2b + c) at [n, r, a, b, c], so the reshape's column is r * 8 + 4a + 2b + c. Worked example,
BLOCK_KW = 16: 16 word rows -> the BLOCK_N x 128 tile of inputs k0 .. k0 + 127, one group's scale and
zero point (BLOCK_K divides the group size).

Why transposed: as the dot's second operand the dequantized tile must go to shared memory every step
and Triton (3.6-3.9, sm_90) then waits on each wgmma before the next step's dequantization (no overlap:
the first form measured ~45% of cuBLAS's rate at 2048 rows); as the first operand it stays in registers
(wgmma reads A from registers), the wgmma runs asynchronously beside the next step's unpacking, and
BLOCK_M, wgmma's N, may be as small as 16, which suits decode batches.

Program (pid, pk): pid -> (M block, N block) with M blocks fastest (the programs that read the same
words run together, so the repeats come from L2), K range [pk * K_PER_SPLIT, +K_PER_SPLIT); split-K
partials summed by the last program of a tile (kernels/gemv.py `store_split_k_output`: one launch,
deterministic, CUDA-graph safe). Scales and zero points are loaded one step ahead (the tc kernel's
reason: a plain load of the step's own scales waits a DRAM round trip every step).

USE_ASM: inline PTX (the interpreter cannot run it); USE_ASM=False computes the same values with
shifts and converts (the interpreter's path). Launches: kernels/wna16_mma_config.py. Reference:
`wna16_gemm.wna16_linear_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.gemv import split_k_plan, store_split_k_output
from pagedllm.kernels.wna16_mma_config import MMAConfig, mma_choice
from pagedllm.kernels.wna16_tc import _weights, int4_steps_supported, magic_offset

__all__ = ["MMAConfig", "mma_supported", "wna16_mma_linear"]

_WS_FLOATS = 1 << 23  # 32 MB of fp32 split-K partials per device, allocated once
_WS_COUNTERS = 1 << 15
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


@triton.jit
def _join_cols(w0, w1, w2, w3, w4, w5, w6, w7, BLOCK_K: tl.constexpr):
    """8 (BLOCK_N, BLOCK_KW) tiles, tile i = input 8r + i at column r -> one (BLOCK_N, BLOCK_K) tile in
    natural input order: [n, r, a, b, c] = w_(4a + 2b + c)[n, r], flattened to column 8r + 4a + 2b + c."""
    t = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
    return tl.reshape(t, (w0.shape[0], BLOCK_K))


@triton.jit
def _wna16_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, K, stride_xm, stride_om, K_PER_SPLIT, SPLIT_K,
    GROUP_SIZE: tl.constexpr, MAGIC: tl.constexpr, OFF: tl.constexpr, USE_ASM: tl.constexpr,
    HAS_BIAS: tl.constexpr, USE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
):
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    m_blocks = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = pid % m_blocks
    pid_n = pid // m_blocks
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_kw = tl.arange(0, BLOCK_KW)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    w_ptrs = qw_ptr + ((k_start // 8) + offs_kw)[:, None].to(tl.int64) * N + offs_n[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_start + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T
    g0 = k_start // GROUP_SIZE
    s_next = tl.load(s_ptr + g0 * N + offs_n, mask=mask_n, other=0.0)
    z_next = tl.load(z_ptr + g0 * N + offs_n, mask=mask_n, other=0)
    for k0 in range(k_start, k_end, BLOCK_K):
        words = tl.load(w_ptrs, mask=mask_n[None, :], other=0)
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        s = s_next.to(tl.float32)
        z = z_next.to(tl.float32)
        g_next = tl.minimum(k0 + BLOCK_K, K - 1) // GROUP_SIZE  # the last step reads a valid, unused group
        s_next = tl.load(s_ptr + g_next * N + offs_n, mask=mask_n, other=0.0)
        z_next = tl.load(z_ptr + g_next * N + offs_n, mask=mask_n, other=0)
        # wna16_tc's PRESCALE arithmetic on the transposed words: scales along rows
        w0, w1, w2, w3, w4, w5, w6, w7 = _weights(tl.trans(words), x_ptr, z[:, None], s[:, None], MAGIC, OFF, USE_ASM)
        acc = tl.dot(_join_cols(w0, w1, w2, w3, w4, w5, w6, w7, BLOCK_K), tl.trans(x), acc,
                     input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_KW * N
        x_ptrs += BLOCK_K
    store_split_k_output(tl.trans(acc), out_ptr, bias_ptr, ws_ptr, counter_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
                         M, N, pid_k, pid, SPLIT_K, HAS_BIAS, USE_SPLIT, BLOCK_M, BLOCK_N)


mma_supported = int4_steps_supported  # the tensor-core GEMV's shapes, any number of rows


def wna16_mma_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                     config: MMAConfig | None = None, use_asm: bool | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N) in x's dtype, int4 weights in the layout above; perm (K,) (act-order):
    weight row k holds input perm[k], so x is gathered once by it."""
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"x has {k} inputs, the packed weight {qweight.shape[0] * 8}")
    cfg = config or mma_choice(m, n, k) or MMAConfig(64, 64, 1, 4, 3)  # any shape runs
    block_k = cfg.BLOCK_KW * 8
    if group_size % block_k or k % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide the group size {group_size} and K {k}")
    if perm is not None:
        x = x.index_select(1, perm)
    if x.stride(1) != 1:
        x = x.contiguous()
    if use_asm is None:
        use_asm = x.is_cuda
    magic, off = magic_offset(x.dtype, use_asm, "wna16_mma_linear")
    tiles = triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, k_per_split, ws = split_k_plan(_workspaces, out, k // block_k, block_k, cfg.SPLIT_K, tiles, _WS_FLOATS,
                                          _WS_COUNTERS)
    _wna16_mma_kernel[(tiles, split)](
        x, qweight, scales, zeros, bias if bias is not None else out, out, ws[0], ws[1],
        m, n, k, x.stride(0), out.stride(0), k_per_split, split,
        GROUP_SIZE=group_size, MAGIC=magic, OFF=off, USE_ASM=use_asm, HAS_BIAS=bias is not None,
        USE_SPLIT=split > 1, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_KW=cfg.BLOCK_KW,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
