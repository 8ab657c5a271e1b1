"""Int4 weight x 16-bit activation GEMV for one decode row (M = 1): short programs, many in flight.

Layout: kernels/wna16_gemm.py, untouched (qweight (K // 8, N) int32, nibble i of word r holds input
8r + i; scales / zeros (K // G, N)), so no second copy and no load-time repack beyond act-order's.

Why: at M = 1 a linear is weight streaming (Llama-3.1-8B gate_up: 58.7 MB of int4 words, 12 us at
the H200's 4.8 TB/s), and the H200 round of the tensor-core kernel (wna16_tc.py) and the FMA GEMV
(wna16_gemv.py) measured 0.8-1.55 TB/s: each of their programs walks 7-16 dependent 128-input
steps, and every step waits on loads (x, scales) that the pipeliner does not stream. The bf16 GEMV
(gemv.py) reaches ~88% of the bf16 floor the other way round: thousands of short programs with no
loop-carried pipeline, so the SM's many resident programs keep the loads in flight. Here:

    program (pn, pk): output columns [pn * BLOCK_N, +BLOCK_N), inputs [pk * STEPS * BLOCK_K, +STEPS * BLOCK_K)
    STEPS is a constexpr: the loop is unrolled, so every load of the program (words, scales, zero
    points, x) is independent of the arithmetic and the compiler may issue them all up front.

Values without int -> float conversions, one LOP3 each (fp32 magic numbers, exact):

    bits((w & (0xF << 15)) | 0x43800000) = 256 + q     (nibble at bits 15..18 of 2^8's mantissa: ULP 1)
    bits((w & (0xF << 19)) | 0x41800000) =  16 + q     (nibble at bits 19..22 of 2^4's mantissa: ULP 1)

with w = word << 15 (nibbles 0, 1), << 7 (2, 3), >> 1 (4, 5), >> 9 (6, 7): four shifts and eight
LOP3 a word (the mantissa ends at bit 22, so no pair of 4-bit-aligned places fits). The offsets are
not subtracted per value; with OFF_i = 256 (even i) or 16 (odd i), for one group g and output n

    sum_k x[k] (q[k] - z) = sum_k x[k] (OFF_i(k) + q[k]) - sum_k x[k] (OFF_i(k) + z)

so a value costs one FFMA into the step's (BLOCK_KW, BLOCK_N) partial, and each row r of word rows
carries xo[r] = sum_i OFF_i x[8r + i] and xs[r] = sum_i x[8r + i] (shared by the BLOCK_N columns);
acc += s * (part - xo - z * xs) once a step. STEP_SUMS instead takes the offsets and zero points
out of the per-word work altogether: acc += s * part, and per column corr += s * (XO + z * XS) with
XO, XS the whole step's sums of OFF * x and x (one (BLOCK_K,) x load, two block reductions),
subtracted once at the end (sm_90 SASS: ~34-37 instructions a word against ~36-38). PREFETCH loads
step i + 1's words before step i's arithmetic (ptxas alone issues them after it). The cancellation costs ~5-8 of fp32's 24 bits (|OFF +
q| <= 271 against |q - z| ~ 8), far below the bf16 output's rounding. Accumulation is fp32.

Split-K epilogue (SPLIT = cdiv(K, STEPS * BLOCK_K) programs per N block): each program stores its
(BLOCK_N,) fp32 partial to a workspace (SPLIT, N); the last of an N block's programs to arrive
(a self-resetting counter, as gemv.py) loads the partials RED rows at a time as one 2-D tile and
sums them in a fixed order (deterministic: the same bits whoever arrives last), adds the bias and
writes y. One launch, no memset; CUDA graphs: no host sync, the workspace is made outside any
capture (a call that would first make it inside a capture runs wna16_tc.py instead).

Reference: `wna16_gemm.wna16_linear_ref`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels.gemv import split_k_workspace
from pagedllm.kernels.wna16_tc import TCConfig, wna16_tc_linear

__all__ = ["StreamConfig", "stream_config", "stream_supported", "wna16_stream_linear"]

_WS_FLOATS = 1 << 22  # 16 MB of fp32 split-K partials per device, allocated once
_WS_COUNTERS = 1 << 15
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
RED = 16  # partial rows the last program of an N block loads at once
MAGIC_EVEN = 0x43800000  # fp32 256.0: a nibble at bits 15..18 reads as 256 + q
MAGIC_ODD = 0x41800000  # fp32 16.0: a nibble at bits 19..22 reads as 16 + q


class StreamConfig(NamedTuple):
    BLOCK_N: int  # output columns per program
    STEPS: int  # group-aligned BLOCK_K steps per program (the loop is unrolled); fewer when K has fewer
    num_warps: int
    BLOCK_KW: int = 16  # word rows a step (BLOCK_K = 8 * BLOCK_KW inputs, dividing the group size)
    # Both measured slower on the H200 at every 8B shape (BENCHMARKS.md, h40); kept for sweeps elsewhere.
    STEP_SUMS: bool = False  # offsets / zero points from whole-step x sums (block reductions), not per word row
    PREFETCH: bool = False  # issue step i + 1's word / scale loads before step i's arithmetic
    num_stages: int = 1  # no loop-carried pipeline: the programs in flight hide the latency


@triton.jit
def _nibble(w_a, w_b, w_c, w_d, magic_even, magic_odd, J: tl.constexpr):
    """OFF_J + q_J as fp32 for nibble J of each word (OFF 256 for even J, 16 for odd J), one LOP3:
    w_a..w_d are the words shifted so that nibbles (0, 1), (2, 3), (4, 5), (6, 7) sit at bits 15..18
    and 19..22 (inside the 23-bit mantissa). The magic exponents come in as runtime values: as
    immediates the compiler splits (w & mask) | magic into two LOP3s (one immediate each)."""
    if J < 2:
        w = w_a
    elif J < 4:
        w = w_b
    elif J < 6:
        w = w_c
    else:
        w = w_d
    if J % 2 == 0:
        bits = (w & 0x00078000) | magic_even
    else:
        bits = (w & 0x00780000) | magic_odd
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _x_col(x_ptr, perm_ptr, cols, HAS_PERM: tl.constexpr):
    """x at input columns `cols` as fp32 (act-order: weight row k holds input perm[k])."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + cols)
    return tl.load(x_ptr + cols).to(tl.float32)


@triton.jit
def _step_loads(qw_ptr, s_ptr, z_ptr, N, offs_n, mask_n, offs_kw, k0, GROUP_SIZE: tl.constexpr):
    """One step's (BLOCK_KW, BLOCK_N) words and its group's scales and zero points (as stored). K is a
    whole number of programs' ranges (the host picks STEPS so), so only N is masked."""
    words = tl.load(qw_ptr + ((k0 // 8) + offs_kw)[:, None].to(tl.int64) * N + offs_n[None, :],
                    mask=mask_n[None, :], other=0, eviction_policy="evict_first")
    g = k0 // GROUP_SIZE
    s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0)
    z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0)
    return words, s, z


@triton.jit
def _stepwise(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, N, magic_even, magic_odd, offs_n, mask_n, offs_kw, k_start,
              GROUP_SIZE: tl.constexpr, STEPS: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_KW: tl.constexpr, STEP_SUMS: tl.constexpr, PREFETCH: tl.constexpr):
    """The program's (BLOCK_N,) fp32 partial, one (BLOCK_KW, BLOCK_N) word tile a step (unrolled).
    PREFETCH: step i + 1's words, scales and zero points are loaded before step i's arithmetic (by
    hand: in the unrolled code ptxas otherwise issues each step's loads after the previous step's work,
    sm_90 SASS)."""
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    acc = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
    corr = tl.zeros((BLOCK_N,), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    off_k = tl.where(offs_k % 2 == 0, 256.0, 16.0)  # OFF of input k0 + kk: nibble kk % 8, even or odd
    if PREFETCH:
        words_n, s_n, z_n = _step_loads(qw_ptr, s_ptr, z_ptr, N, offs_n, mask_n, offs_kw, k_start, GROUP_SIZE)
    for i in tl.static_range(STEPS):
        k0 = k_start + i * BLOCK_K
        if PREFETCH:
            words, s, z = words_n, s_n, z_n
            if i + 1 < STEPS:
                words_n, s_n, z_n = _step_loads(qw_ptr, s_ptr, z_ptr, N, offs_n, mask_n, offs_kw, k0 + BLOCK_K,
                                                GROUP_SIZE)
        else:
            words, s, z = _step_loads(qw_ptr, s_ptr, z_ptr, N, offs_n, mask_n, offs_kw, k0, GROUP_SIZE)
        s = s.to(tl.float32)
        z = z.to(tl.float32)
        cols = k0 + offs_kw * 8
        w_a = words << 15
        w_b = words << 7
        w_c = words >> 1
        w_d = words >> 9
        x0 = _x_col(x_ptr, perm_ptr, cols + 0, HAS_PERM)
        x1 = _x_col(x_ptr, perm_ptr, cols + 1, HAS_PERM)
        x2 = _x_col(x_ptr, perm_ptr, cols + 2, HAS_PERM)
        x3 = _x_col(x_ptr, perm_ptr, cols + 3, HAS_PERM)
        x4 = _x_col(x_ptr, perm_ptr, cols + 4, HAS_PERM)
        x5 = _x_col(x_ptr, perm_ptr, cols + 5, HAS_PERM)
        x6 = _x_col(x_ptr, perm_ptr, cols + 6, HAS_PERM)
        x7 = _x_col(x_ptr, perm_ptr, cols + 7, HAS_PERM)
        part = x0[:, None] * _nibble(w_a, w_b, w_c, w_d, magic_even, magic_odd, 0)
        part += x1[:, None] * _nibble(w_a, w_b, w_c, w_d, magic_even, magic_odd, 1)
        part += x2[:, None] * _nibble(w_a, w_b, w_c, w_d, magic_even, magic_odd, 2)
        part += x3[:, None] * _nibble(w_a, w_b, w_c, w_d, magic_even, magic_odd, 3)
        part += x4[:, None] * _nibble(w_a, w_b, w_c, w_d, magic_even, magic_odd, 4)
        part += x5[:, None] * _nibble(w_a, w_b, w_c, w_d, magic_even, magic_odd, 5)
        part += x6[:, None] * _nibble(w_a, w_b, w_c, w_d, magic_even, magic_odd, 6)
        part += x7[:, None] * _nibble(w_a, w_b, w_c, w_d, magic_even, magic_odd, 7)
        if STEP_SUMS:
            # the offsets and zero points once a step and column: sum_k x (OFF + z) from the step's
            # x as one vector (two block reductions), subtracted from the program's sum at the end
            xv = _x_col(x_ptr, perm_ptr, k0 + offs_k, HAS_PERM)
            corr += s * (tl.sum(xv * off_k, axis=0) + z * tl.sum(xv, axis=0))
            acc += s[None, :] * part
        else:
            x_even = (x0 + x2) + (x4 + x6)
            x_odd = (x1 + x3) + (x5 + x7)
            xs = x_even + x_odd
            xo = x_even * 256.0 + x_odd * 16.0
            acc += s[None, :] * (part - (xo[:, None] + z[None, :] * xs[:, None]))
    return tl.sum(acc, axis=0) - corr  # (BLOCK_N,)


@triton.jit
def _wna16_stream_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, perm_ptr, out_ptr, ws_ptr, counter_ptr,
    N, SPLIT, magic_even, magic_odd,
    GROUP_SIZE: tl.constexpr, STEPS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PERM: tl.constexpr,
    USE_SPLIT: tl.constexpr, RED_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    STEP_SUMS: tl.constexpr, PREFETCH: tl.constexpr,
):
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_kw = tl.arange(0, BLOCK_KW)
    k_start = pid_k * (STEPS * BLOCK_K)
    res = _stepwise(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, N, magic_even, magic_odd, offs_n, mask_n, offs_kw,
                    k_start, GROUP_SIZE, STEPS, HAS_PERM, BLOCK_N, BLOCK_KW, STEP_SUMS, PREFETCH)
    if not USE_SPLIT:
        if HAS_BIAS:
            res += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, res.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(ws_ptr + pid_k * N + offs_n, res, mask=mask_n)
        # Every thread's partial is written (block barrier) before the release-acquire increment
        # publishes it at GPU scope; the last arrival then reads all partials from L2.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            offs_r = tl.arange(0, RED_ROWS)
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for r0 in range(0, SPLIT, RED_ROWS):
                rows = r0 + offs_r
                parts = tl.load(ws_ptr + rows[:, None] * N + offs_n[None, :],
                                mask=(rows < SPLIT)[:, None] & mask_n[None, :], other=0.0, cache_modifier=".cg")
                total += tl.sum(parts, axis=0)
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask_n)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next call, no memset needed


def stream_supported(x: torch.Tensor, bits: int, group_size: int, k: int) -> bool:
    """One row, int4, groups (and K) a whole number of 128-input steps; 16-bit x (fp32 too off the
    GPU, in the interpreter), as the tensor-core kernel this falls back to."""
    dtype_ok = x.dtype in (torch.bfloat16, torch.float16) or (x.dtype == torch.float32 and not x.is_cuda)
    return x.shape[0] == 1 and bits == 4 and dtype_ok and group_size % 128 == 0 and k % 128 == 0


# One-row launch table keyed by (N, K), from the H200 sweep of scripts/gpu_wna16_stream.py (2026-12-01,
# BENCHMARKS.md, issue 19, the h40 subsection; CUDA-graph replays over rotating weight copies):
#   qkv  6144 x 4096    64 columns, 2 warps, 8 steps   11.2 us (128 x 2 x 4: 11.7; tensor-core kernel 14.8)
#   o    4096 x 4096    128 columns, 4 warps, 2 steps   8.2 us (tensor-core kernel 10.1)
#   down 4096 x 14336   64 columns, 2 warps, 8 steps   19.5 us (tensor-core kernel 19.8)
#   gate_up 28672 x 4096: the tensor-core kernel with K split 4 ways, 33.1 us (here 128 x 2 x 4: 34.2)
# Other shapes: 128 columns, 4 warps, 2 steps, the best over the four shapes together (76.4 us a layer).
_TABLE: dict[tuple[int, int], StreamConfig | TCConfig] = {
    (6144, 4096): StreamConfig(64, 8, 2),
    (4096, 4096): StreamConfig(128, 2, 4),
    (4096, 14336): StreamConfig(64, 8, 2),
    (28672, 4096): TCConfig(128, 4, 4, 3),
}
_DEFAULT = StreamConfig(128, 2, 4)


def stream_config(n: int, k: int) -> StreamConfig | TCConfig:
    """The one-row launch for an (N, K) int4 weight: a StreamConfig for this kernel, or a TCConfig
    where the tensor-core kernel (wna16_tc.py) measured faster."""
    return _TABLE.get((n, k), _DEFAULT)


def wna16_stream_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int, bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                        config: StreamConfig | TCConfig | None = None) -> torch.Tensor:
    """x (1, K) -> (1, N), int4 weights in the layout above. perm (K,) int32 / int64 (act-order):
    weight row k holds input perm[k]; the kernel reads x through it (no gather launch). The launch
    is `stream_config(N, K)` unless given; a TCConfig sends the row to the tensor-core kernel."""
    m, k = x.shape
    n = qweight.shape[1]
    if m != 1:
        raise ValueError(f"wna16_stream_linear takes one row, got {m}")
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"x has {k} inputs, the packed weight {qweight.shape[0] * 8}")
    cfg = config or stream_config(n, k)
    if isinstance(cfg, TCConfig):
        return wna16_tc_linear(x, qweight, scales, zeros, group_size, bias, perm, config=cfg)
    block_k = cfg.BLOCK_KW * 8
    if group_size % block_k or k % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide the group size {group_size} and K {k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    steps_total = k // block_k
    steps = max(1, min(cfg.STEPS, steps_total))
    while steps_total % steps:  # whole programs: no masked K tail (and a power of two stays one)
        steps //= 2
    split = steps_total // steps
    n_blocks = triton.cdiv(n, cfg.BLOCK_N)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    ws = split_k_workspace(_workspaces, x.device, _WS_FLOATS, _WS_COUNTERS) if split > 1 else None
    if split == 1:
        ws = (out, out)  # never read: the split-K branch is compiled out
    elif ws is None or split * n > _WS_FLOATS or n_blocks > _WS_COUNTERS:
        # no workspace (first made inside a capture) or too little: the tensor-core kernel, which
        # loops over K, instead of unrolling all of K here
        return wna16_tc_linear(x, qweight, scales, zeros, group_size, bias, perm)
    _wna16_stream_kernel[(n_blocks, split)](
        x, qweight, scales, zeros, bias if bias is not None else out, perm if perm is not None else out,
        out, ws[0], ws[1], n, split, MAGIC_EVEN, MAGIC_ODD,
        GROUP_SIZE=group_size, STEPS=steps, HAS_BIAS=bias is not None, HAS_PERM=perm is not None,
        USE_SPLIT=split > 1, RED_ROWS=min(RED, triton.next_power_of_2(split)),
        BLOCK_N=cfg.BLOCK_N, BLOCK_KW=cfg.BLOCK_KW, STEP_SUMS=cfg.STEP_SUMS, PREFETCH=cfg.PREFETCH, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
