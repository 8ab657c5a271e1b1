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

Packed fp16 math (MATH="f16x2"): the fp32 path spends ~36 sm_90 instructions a packed word (8 LOP3, 8
FFMA, 4 shifts, x loads and converts, the per-row offsets); here pairs of values share each
instruction. Nibbles s and s + 4 of a word sit at bits 4s and 16 + 4s, so (Marlin's dequantization)

    bits(w & 0x000F000F | 0x64006400)       = (1024 + q0, 1024 + q4)          as fp16 x2 (ULP 1: exact)
    bits(w & 0x00F000F0 | 0x64006400)       = (1024 + 16 q1, 1024 + 16 q5)
    the same of w >> 8                       -> (q2, q6), (q3, q7)

and one packed add of -(1024 + z) (or FMA by 1/16 with -(64 + z)) makes each pair (q - z) exactly;
four packed FMAs against x pairs (x[8r + s], x[8r + s + 4]) accumulate a word into a pair of fp16
sums, chained over ROWS consecutive words of the column (1, 2, 4), then the two lanes are converted
and added into the step's fp32 partial, which the group scale multiplies once: ~13 instructions a
word for the arithmetic (1 shift, 4 LOP3, 4 HADD2 / HFMA2, 4 HFMA2) plus 3 per ROWS words to leave
fp16 (sm_90 SASS of the whole unrolled program: ~23 a word at 64 columns x 8 steps, 2 warps,
against the fp32 path's ~36; scripts/wna16_sm90_sass.py). The x pairs are made once per step as a
(BLOCK_KW, 8) tile (each x converted by one thread, then moved to the threads of its rows).

Range and precision: the program scales its x by 2^-E, 2^E <= max |x| of its inputs < 2^(E+1) (one
block max, once), so |x'| < 2 and a lane's sum stays below 120 * ROWS (|q - z| <= 15): no outlier
can overflow fp16; 2^E goes back into the scale exactly. Each packed FMA rounds to fp16 (2^-11
relative to its running sum), so the error is that of fp16 sums over 4 * ROWS products, relative to
the program's largest |x| (smaller x lose bits below 2^-14 of it, fp16's normal range). The torch
emulation of exactly this arithmetic, `wna16_packed_emulation`, stays within 2e-3 of the fp32
reference's max (fp32 output; measured 2.3e-4 .. 7.6e-4, random and outlier x, K 4096, 1-4 rows);
the kernel equals the emulation up to fp32 summation order (the interpreter runs the emulation in
fp32 ops: inline PTX does not run there).

The kernel before the GEMV, in its x prologue (the program's max, the pairs), packed path only, so
batch-1 decode saves that kernel's launch:
    SwiGLU's activation (act="silu_and_mul", the down projection): x is the (1, 2K) gate_up row and
    the inputs silu(gate) * up, rounded to x's dtype as `activation.silu_and_mul` stores them;
    residual add + RMSNorm (`wna16_stream_linear_rms_norm`, qkv_proj and gate_up_proj): every program
    sums the squares of the whole row h = x + residual (2 x 8 KB at hidden 4096, from L2) for its
    rstd, its inputs are (h * rstd * w) rounded as `rmsnorm.rms_norm` stores them, and the first N
    block's programs store h (the new residual) for their K ranges.

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

from pagedllm import envs
from pagedllm.kernels.activation import silu_and_mul
from pagedllm.kernels.gemv import split_k_workspace
from pagedllm.kernels.rmsnorm import rms_norm
from pagedllm.kernels.wna16_tc import TCConfig, wna16_tc_linear

__all__ = ["StreamConfig", "program_steps", "stream_config", "stream_supported", "wna16_packed_emulation",
           "wna16_stream_linear", "wna16_stream_linear_rms_norm"]

_WS_FLOATS = 1 << 22  # 16 MB of fp32 split-K partials per device, allocated once
_WS_COUNTERS = 1 << 15
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
# Triton reads TRITON_INTERPRET when the kernels are decorated (at import): the interpreter cannot run
# inline PTX, so the packed path then takes its fp32-op emulation (the same roundings).
_USE_ASM = not envs.TRITON_INTERPRET
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
    # "fp32": one FFMA a value; "f16x2": packed fp16 math on pairs of values (module docstring), x
    # scaled by the program's power of two
    MATH: str = "fp32"
    ROWS: int = 1  # f16x2: word rows (8 inputs each) summed in fp16 before the sum joins fp32 (1, 2, 4)
    # f16x2: the x pairs of the program's inputs made once up front and stored to a small global
    # scratch (re-read per step from L1), instead of per step as a tile moved between threads
    X_SCRATCH: bool = False
    # f16x2: scales and zero points loaded in the word tile's layout, each row of the tile the same
    # (no exchange between threads a step; redundant loads where a thread holds several tile rows)
    SZ_TILE: bool = False
    # f16x2: the first step's words loaded before the x prologue, so their DRAM latency overlaps it
    EARLY: bool = False
    # f16x2: the layer before may hand its residual add + RMSNorm to this launch's prologue
    # (`wna16_stream_linear_rms_norm`; WNA16LinearMethod.fuses_rms_norm reads it)
    FUSE_NORM: bool = True


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
def _x_in(x_ptr, perm_ptr, cols, x_half, r_ptr, nw_ptr, rstd, HAS_PERM: tl.constexpr, X_ACT: tl.constexpr):
    """The GEMV's inputs at `cols` as fp32: x itself (X_ACT 0); (1) x the (1, 2K) gate_up row, gate then
    up: silu(x[c]) * x[x_half + c] rounded to x's dtype once, as `activation.silu_and_mul` stores it;
    (2) residual add + RMSNorm as `rmsnorm.rms_norm` stores them: h = (x + r) rounded to x's dtype,
    then (h * rstd * w) rounded (rstd of the whole row, from `_row_rstd`)."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + cols)
    if X_ACT == 1:
        gate = tl.load(x_ptr + cols).to(tl.float32)
        up = tl.load(x_ptr + x_half + cols).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    elif X_ACT == 2:
        h = (tl.load(x_ptr + cols).to(tl.float32) + tl.load(r_ptr + cols).to(tl.float32)).to(x_ptr.dtype.element_ty)
        w = tl.load(nw_ptr + cols).to(tl.float32)
        return (h.to(tl.float32) * rstd * w).to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        return tl.load(x_ptr + cols).to(tl.float32)


@triton.jit
def _row_rstd(x_ptr, r_ptr, hidden, eps, HIDDEN_PAD: tl.constexpr):
    """rsqrt(mean(h^2) + eps) of the whole row h = (x + r) rounded to x's dtype (`rmsnorm.rms_norm`)."""
    CHUNK: tl.constexpr = min(HIDDEN_PAD, 1024)  # a chunk at a time: registers stay bounded at any width
    ss = tl.zeros([CHUNK], tl.float32)
    for c0 in tl.static_range(0, HIDDEN_PAD, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        m = offs < hidden
        h = (tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
             + tl.load(r_ptr + offs, mask=m, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
        ss += h * h
    return tl.rsqrt(tl.sum(ss, 0) / hidden + eps)


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


# One word row of the packed path, per element: $1 the word, $2 the magic pair (1024, 1024), $3 / $4
# the zero pairs -(1024 + z) / -(64 + z), $5 (1/16, 1/16), $6..$9 the x pairs (x[8r + s], x[8r + s + 4]),
# s = 0..3, $10 the running pair sums -> $0 the new pair sums. Marlin's fp16 dequantization: nibbles
# (s, s + 4) = bits (4s, 16 + 4s); LOP3 with 0x000F000F gives (1024 + q, ...) for s = 0 (and 2, after
# one shift by 8), with 0x00F000F0 (1024 + 16 q, ...) for s = 1 (3): one add or one FMA by 1/16 makes
# q - z exactly (small integers); four packed FMAs against the x pairs.
_ROW_ASM = tl.constexpr("""
{
.reg .b32 t, v<4>;
shr.u32 t, $1, 8;
lop3.b32 v0, $1, 0x000F000F, $2, 0xEA;
lop3.b32 v1, $1, 0x00F000F0, $2, 0xEA;
lop3.b32 v2, t, 0x000F000F, $2, 0xEA;
lop3.b32 v3, t, 0x00F000F0, $2, 0xEA;
add.f16x2 v0, v0, $3;
fma.rn.f16x2 v1, v1, $5, $4;
add.f16x2 v2, v2, $3;
fma.rn.f16x2 v3, v3, $5, $4;
fma.rn.f16x2 $0, v0, $6, $10;
fma.rn.f16x2 $0, v1, $7, $0;
fma.rn.f16x2 $0, v2, $8, $0;
fma.rn.f16x2 $0, v3, $9, $0;
}
""")
# f16x2 pair sums -> their fp32 sum ($0), both lanes converted exactly.
_LANES_ASM = tl.constexpr("""
{
.reg .b16 h<2>;
.reg .f32 f<2>;
mov.b32 {h0, h1}, $1;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 $0, f0, f1;
}
""")
MAGIC16 = tl.constexpr(0x64006400)  # fp16 (1024, 1024): ULP 1, so 1024 + q exactly
INV16 = tl.constexpr(0x2C002C00)  # fp16 (1/16, 1/16)


@triton.jit
def _pairs_of(v):
    """An int32 tensor of fp16 bit pairs -> the two lanes as fp32 (low, high), exactly."""
    lo = (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = ((v >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _round16(v):
    """fp32 -> fp16 (nearest) -> fp32: one packed op's rounding, for the emulation."""
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _emulate_row(w, z_lo, z_hi, x_lo, x_hi, a_lo, a_hi, S: tl.constexpr):
    """_ROW_ASM's nibble pair S, in fp32 values rounded to fp16 after each packed op (the
    interpreter's path): q - z is exact, the FMA rounds once (a product of two fp16 is exact in
    fp32; the fp32 sum's rounding before the fp16 one can differ from the GPU's in a tie)."""
    q_lo = ((w >> (4 * S)) & 15).to(tl.float32)
    q_hi = ((w >> (16 + 4 * S)) & 15).to(tl.float32)
    a_lo = _round16(_round16(q_lo - z_lo) * x_lo + a_lo)
    a_hi = _round16(_round16(q_hi - z_hi) * x_hi + a_hi)
    return a_lo, a_hi


@triton.jit
def _x_pairs(x_ptr, perm_ptr, cols, inv, x_half, r_ptr, nw_ptr, rstd, HAS_PERM: tl.constexpr, X_ACT: tl.constexpr,
             USE_ASM: tl.constexpr):
    """x for word rows starting at input columns `cols` (R,), as 4 (R,) int32 tensors of fp16 pairs
    (x[c + s] * inv, x[c + s + 4] * inv), s = 0..3. The (R, 8) tile is loaded and converted once and
    split in registers (each x value converted by one thread, not by every thread sharing its row)."""
    R: tl.constexpr = cols.shape[0]
    xt = _x_in(x_ptr, perm_ptr, cols[:, None] + tl.arange(0, 8)[None, :], x_half, r_ptr, nw_ptr, rstd, HAS_PERM,
               X_ACT) * inv  # (R, 8)
    x3 = tl.permute(tl.reshape(xt, (R, 2, 4)), (0, 2, 1))  # [r, s, h] = x[c + 4h + s]
    lo, hi = tl.split(x3)  # (R, 4): x[c + s], x[c + s + 4]
    if USE_ASM:
        # not pure: the compiler would move a pure conversion past the layout change that follows, so
        # that every thread sharing a row would convert it again
        pr = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                       is_pure=False, pack=1)
    else:
        lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        pr = lo16 | (hi16 << 16)
    e0, e1 = tl.split(tl.reshape(pr, (R, 2, 2)))  # [r, a] = pr[r, 2a] / pr[r, 2a + 1]
    p0, p2 = tl.split(e0)
    p1, p3 = tl.split(e1)
    return p0, p1, p2, p3


@triton.jit
def _x_pairs_to_scratch(x_ptr, perm_ptr, xp_ptr, k_start, inv, x_half, r_ptr, nw_ptr, rstd, SPAN: tl.constexpr,
                        HAS_PERM: tl.constexpr, X_ACT: tl.constexpr, USE_ASM: tl.constexpr):
    """The program's SPAN inputs as fp16 pairs (x[8r + s], x[8r + s + 4]) * inv, stored at xp_ptr +
    4r + s (word row r of the span): (SPAN // 8, 4) int32, each made by one thread. Every program
    of the same K range stores the same bits here (the N blocks differ only in columns), so the
    overlapping stores are harmless; a block barrier then makes them visible to the program's threads."""
    rows = tl.arange(0, SPAN // 8)
    p0, p1, p2, p3 = _x_pairs(x_ptr, perm_ptr, k_start + rows * 8, inv, x_half, r_ptr, nw_ptr, rstd, HAS_PERM, X_ACT,
                              USE_ASM)
    pairs = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # (SPAN // 8, 2, 2): [r, b, a] = p_(2b + a)
    pairs = tl.reshape(pairs, (SPAN // 8, 4))  # [r, s] = p_s
    tl.store(xp_ptr + rows[:, None] * 4 + tl.arange(0, 4)[None, :], pairs)
    tl.debug_barrier()


@triton.jit
def _scales_zeros(s_ptr, z_ptr, N, g, offs_n, mask_n, sz_offs, sz_mask, SZ_TILE: tl.constexpr, EVEN_N: tl.constexpr):
    """Group g's scales and zero points as stored, (1, BLOCK_N) or (SZ_TILE) (TILE_KW, BLOCK_N) with
    every row the same: the offsets are seen as runs of 4 (as the words' 128-bit vectors), so the
    compiler gives those loads the words' layout and no values move between threads (a layout change
    is a shared-memory round trip and a block barrier)."""
    if SZ_TILE:
        if EVEN_N:
            s = tl.load(s_ptr + g * N + sz_offs)
            z = tl.load(z_ptr + g * N + sz_offs)
        else:
            s = tl.load(s_ptr + g * N + sz_offs, mask=sz_mask, other=0.0)
            z = tl.load(z_ptr + g * N + sz_offs, mask=sz_mask, other=0)
    else:
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0)[None, :]
        z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0)[None, :]
    return s, z


@triton.jit
def _word_tile(qw_base, N, offs_n, mask_n, rows, EVEN_N: tl.constexpr):
    """(len(rows), BLOCK_N) words: word rows `rows` of the program's range (int32 offsets from qw_base)."""
    if EVEN_N:
        return tl.load(qw_base + rows[:, None] * N + offs_n[None, :], eviction_policy="evict_first")
    else:
        return tl.load(qw_base + rows[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0,
                       eviction_policy="evict_first")


@triton.jit
def _stepwise_packed(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, xp_ptr, N, x_half, r_ptr, nw_ptr, r_out_ptr, eps,
                     offs_n, mask_n, k_start,
                     GROUP_SIZE: tl.constexpr, STEPS: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_KW: tl.constexpr, ROWS: tl.constexpr, X_SCRATCH: tl.constexpr, SZ_TILE: tl.constexpr,
                     EVEN_N: tl.constexpr, EARLY: tl.constexpr, X_ACT: tl.constexpr, HIDDEN_PAD: tl.constexpr,
                     USE_ASM: tl.constexpr):
    """The program's (BLOCK_N,) fp32 partial by packed fp16 math (module docstring): a step is a
    (BLOCK_KW // ROWS, BLOCK_N) tile of elements, each ROWS consecutive words of one column whose
    pair sums are chained in fp16 before they join the fp32 sum."""
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    TILE_KW: tl.constexpr = BLOCK_KW // ROWS
    SHAPE: tl.constexpr = (TILE_KW, BLOCK_N)
    offs_j = tl.arange(0, TILE_KW) * ROWS  # first word row of each element, within the step
    qw_base = qw_ptr + (k_start // 8).to(tl.int64) * N
    offs_c = tl.arange(0, BLOCK_N)
    offs_n4 = tl.program_id(0) * BLOCK_N + (offs_c // 4) * 4 + offs_c % 4  # == offs_n
    sz_offs = offs_n4[None, :] + offs_j[:, None] * 0
    sz_mask = sz_offs < N
    if EARLY:
        # the first step's words before the x prologue (its loads and block barriers): in program
        # order, so their DRAM round trip overlaps it (the compiler does not move loads across barriers)
        w_e0 = _word_tile(qw_base, N, offs_n, mask_n, offs_j, EVEN_N)
        if ROWS > 1:
            w_e1 = _word_tile(qw_base, N, offs_n, mask_n, offs_j + 1, EVEN_N)
        if ROWS > 2:
            w_e2 = _word_tile(qw_base, N, offs_n, mask_n, offs_j + 2, EVEN_N)
            w_e3 = _word_tile(qw_base, N, offs_n, mask_n, offs_j + 3, EVEN_N)
        s_e, z_e = _scales_zeros(s_ptr, z_ptr, N, k_start // GROUP_SIZE, offs_n, mask_n, sz_offs, sz_mask, SZ_TILE,
                                 EVEN_N)
    # x * 2^-E with 2^E <= max |x| of the program's inputs < 2^(E + 1): the scaled x lie in (-2, 2), so
    # no pair sum can overflow fp16 (|q - z| <= 15: a lane sums 4 * ROWS terms below 120 * ROWS), and
    # the small x keep fp16's 11 bits down to 2^-14 of the program's largest. 2^E joins the group scale.
    if X_ACT == 2:
        # the whole row's rstd (every program: the row is 2 x 8 KB at Llama-3.1-8B's width, in L2);
        # the new residual of the program's inputs is stored by the first N block's programs
        rstd = _row_rstd(x_ptr, r_ptr, x_half, eps, HIDDEN_PAD)
        if tl.program_id(0) == 0:
            cols = k_start + tl.arange(0, STEPS * BLOCK_K)
            if HAS_PERM:
                cols = tl.load(perm_ptr + cols)
            tl.store(r_out_ptr + cols, (tl.load(x_ptr + cols).to(tl.float32)
                                        + tl.load(r_ptr + cols).to(tl.float32)).to(r_out_ptr.dtype.element_ty))
    else:
        rstd = 1.0
    xv = _x_in(x_ptr, perm_ptr, k_start + tl.arange(0, STEPS * BLOCK_K), x_half, r_ptr, nw_ptr, rstd, HAS_PERM,
               X_ACT)
    e = tl.max(tl.abs(xv), axis=0).to(tl.int32, bitcast=True) & 0x7F800000
    e = tl.minimum(tl.maximum(e, 0x00800000), 0x7F000000)  # zeros / subnormals: 2^-126; inf / nan: 2^127
    inv = (0x7F000000 - e).to(tl.float32, bitcast=True)
    p2e = e.to(tl.float32, bitcast=True)
    if X_SCRATCH:
        xp_ptr += (k_start // (STEPS * BLOCK_K)) * (STEPS * BLOCK_K // 2)  # this K range's pairs
        _x_pairs_to_scratch(x_ptr, perm_ptr, xp_ptr, k_start, inv, x_half, r_ptr, nw_ptr, rstd, STEPS * BLOCK_K,
                            HAS_PERM, X_ACT, USE_ASM)
    magic = tl.full(SHAPE, MAGIC16, tl.int32)
    c16 = tl.full(SHAPE, INV16, tl.int32)
    acc = tl.zeros(SHAPE, dtype=tl.float32)
    for i in tl.static_range(STEPS):
        k0 = k_start + i * BLOCK_K
        g = k0 // GROUP_SIZE
        if EARLY and i == 0:
            s, z = s_e, z_e
        else:
            s, z = _scales_zeros(s_ptr, z_ptr, N, g, offs_n, mask_n, sz_offs, sz_mask, SZ_TILE, EVEN_N)
        s = s.to(tl.float32) * p2e
        z = z.to(tl.int32)
        if USE_ASM:
            z_lo = tl.broadcast_to((0xE400 | z) * 0x10001, SHAPE)  # -(1024 + z) in both halves
            z_hi = tl.broadcast_to((0xD400 + 16 * z) * 0x10001, SHAPE)  # -(64 + z)
            a = tl.zeros(SHAPE, dtype=tl.int32)  # fp16 (0, 0)
        else:
            zf = tl.broadcast_to(z.to(tl.float32), SHAPE)
            a_lo = tl.zeros(SHAPE, dtype=tl.float32)
            a_hi = tl.zeros(SHAPE, dtype=tl.float32)
        for t in tl.static_range(ROWS):
            rows = i * BLOCK_KW + offs_j + t  # within the program's word rows: int32 offsets from qw_base
            if EARLY and i == 0:
                if t == 0:
                    w = w_e0
                elif t == 1:
                    w = w_e1
                elif t == 2:
                    w = w_e2
                else:
                    w = w_e3
            else:
                w = _word_tile(qw_base, N, offs_n, mask_n, rows, EVEN_N)
            if X_SCRATCH:
                xr = xp_ptr + rows * 4
                x0 = tl.load(xr)
                x1 = tl.load(xr + 1)
                x2 = tl.load(xr + 2)
                x3 = tl.load(xr + 3)
            else:
                x0, x1, x2, x3 = _x_pairs(x_ptr, perm_ptr, k0 + (offs_j + t) * 8, inv, x_half, r_ptr, nw_ptr, rstd,
                                          HAS_PERM, X_ACT, USE_ASM)
            x0 = tl.broadcast_to(x0[:, None], SHAPE)
            x1 = tl.broadcast_to(x1[:, None], SHAPE)
            x2 = tl.broadcast_to(x2[:, None], SHAPE)
            x3 = tl.broadcast_to(x3[:, None], SHAPE)
            if USE_ASM:
                a = tl.inline_asm_elementwise(_ROW_ASM, "=r,r,r,r,r,r,r,r,r,r,r",
                                              [w, magic, z_lo, z_hi, c16, x0, x1, x2, x3, a],
                                              dtype=tl.int32, is_pure=True, pack=1)
            else:
                for s_ in tl.static_range(4):
                    if s_ == 0:
                        xp = x0
                    elif s_ == 1:
                        xp = x1
                    elif s_ == 2:
                        xp = x2
                    else:
                        xp = x3
                    x_lo, x_hi = _pairs_of(xp)
                    a_lo, a_hi = _emulate_row(w, zf, zf, x_lo, x_hi, a_lo, a_hi, s_)
        if USE_ASM:
            part = tl.inline_asm_elementwise(_LANES_ASM, "=f,r", [a], dtype=tl.float32, is_pure=True, pack=1)
        else:
            part = a_lo + a_hi
        acc += s * part
    return tl.sum(acc, axis=0)  # (BLOCK_N,)


@triton.jit
def _wna16_stream_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, perm_ptr, out_ptr, ws_ptr, counter_ptr, xp_ptr,
    N, SPLIT, magic_even, magic_odd, x_half, r_ptr, nw_ptr, r_out_ptr, eps,
    GROUP_SIZE: tl.constexpr, STEPS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PERM: tl.constexpr,
    USE_SPLIT: tl.constexpr, RED_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    STEP_SUMS: tl.constexpr, PREFETCH: tl.constexpr, MATH: tl.constexpr, ROWS: tl.constexpr,
    X_SCRATCH: tl.constexpr, SZ_TILE: tl.constexpr, EVEN_N: tl.constexpr, EARLY: tl.constexpr,
    X_ACT: tl.constexpr, HIDDEN_PAD: tl.constexpr, USE_ASM: tl.constexpr,
):
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_kw = tl.arange(0, BLOCK_KW)
    k_start = pid_k * (STEPS * BLOCK_K)
    if MATH == "fp32":
        res = _stepwise(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, N, magic_even, magic_odd, offs_n, mask_n, offs_kw,
                        k_start, GROUP_SIZE, STEPS, HAS_PERM, BLOCK_N, BLOCK_KW, STEP_SUMS, PREFETCH)
    else:
        res = _stepwise_packed(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, xp_ptr, N, x_half, r_ptr, nw_ptr, r_out_ptr,
                               eps, offs_n, mask_n, k_start, GROUP_SIZE, STEPS, HAS_PERM, BLOCK_N, BLOCK_KW, ROWS,
                               X_SCRATCH, SZ_TILE, EVEN_N, EARLY, X_ACT, HIDDEN_PAD, USE_ASM)
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


_XP_INTS = 1 << 17  # x pair scratch: K / 2 int32 per call (K up to 262144), one per device
_x_pair_scratches: dict[torch.device, torch.Tensor] = {}


def _x_pair_scratch(device: torch.device, k: int) -> torch.Tensor | None:
    """The device's x pair scratch (X_SCRATCH), made once; None if it would first be made in a capture."""
    xp = _x_pair_scratches.get(device)
    if xp is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        xp = _x_pair_scratches[device] = torch.empty(_XP_INTS, dtype=torch.int32, device=device)
    return xp if k // 2 <= xp.numel() else None


def program_steps(cfg: StreamConfig, k: int) -> int:
    """The BLOCK_K steps one program takes: cfg.STEPS, fewer where K has fewer or where they would not
    divide K's steps (whole programs: no masked K tail; a power of two stays one)."""
    steps_total = k // (cfg.BLOCK_KW * 8)
    steps = max(1, min(cfg.STEPS, steps_total))
    while steps_total % steps:
        steps //= 2
    return steps


def wna16_packed_emulation(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                           group_size: int, span: int, rows: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """The packed fp16 path's arithmetic in torch (float64 values rounded to fp16 where the GPU's
    packed ops round): x (1, K) -> (1, N) fp32. span: inputs per program (its power-of-two x scale);
    rows: word rows chained in fp16. The CPU tests hold it to the fp32 reference and the kernel to it."""
    k, n = x.shape[1], qweight.shape[1]
    if perm is not None:
        x = x[:, perm]
    xf = x.double().view(k // span, span)
    amax = xf.abs().amax(dim=1, keepdim=True).float()
    e = (amax.view(torch.int32) & 0x7F800000).clamp(0x00800000, 0x7F000000)
    p2e = e.view(torch.float32).double()  # (programs, 1)
    xs = (xf / p2e).to(torch.float16).double().view(k)  # x * 2^-E rounded to fp16 (the cvt of a pair)
    shifts = torch.arange(8, dtype=torch.int32, device=qweight.device) * 4
    q = ((qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 15).reshape(k, n).double()
    d = q - zeros.double().repeat_interleave(group_size, dim=0)  # q - z, exact in fp16
    # element e = (k // (8 rows)); inside it: row t, half h (nibbles 0-3 / 4-7), position s
    d = d.view(k // (8 * rows), rows, 2, 4, n)
    xe = xs.view(k // (8 * rows), rows, 2, 4, 1)
    a = torch.zeros(k // (8 * rows), 2, n, dtype=torch.float64, device=x.device)
    for t in range(rows):
        for s_ in range(4):
            a = (d[:, t, :, s_] * xe[:, t, :, s_] + a).to(torch.float16).double()  # one fma.rn.f16x2
    part = (a[:, 0].float() + a[:, 1].float()).double()  # the lanes' fp32 sum, (elements, N)
    elem_scale = (scales.double().repeat_interleave(group_size // (8 * rows), dim=0)
                  * p2e.repeat_interleave(span // (8 * rows), dim=0))
    return (part * elem_scale).sum(dim=0, keepdim=True).float()


def stream_supported(x: torch.Tensor, bits: int, group_size: int, k: int) -> bool:
    """One row, int4, groups (and K) a whole number of 128-input steps; 16-bit x (fp32 too off the
    GPU, in the interpreter), as the tensor-core kernel this falls back to."""
    dtype_ok = x.dtype in (torch.bfloat16, torch.float16) or (x.dtype == torch.float32 and not x.is_cuda)
    return x.shape[0] == 1 and bits == 4 and dtype_ok and group_size % 128 == 0 and k % 128 == 0


# One-row launch table keyed by (N, K), from the H200 sweeps of scripts/gpu_wna16_stream.py (h40) and
# scripts/gpu_wna16_packed.py (h44, 2026-12-02 rounds 1-2; BENCHMARKS.md, issue 19; CUDA-graph replays
# over rotating weight copies), microseconds:
#   qkv  6144 x 4096    f16x2, 256 columns, 4 warps, 2 steps, 2 rows, first loads early: with the
#                       residual add + RMSNorm in its prologue 10.5 (rms_norm launch + GEMV 13.7);
#                       alone 10.4-12.0 (the fp32 path 10.9)
#   o    4096 x 4096    fp32, 128 columns, 4 warps, 2 steps              8.2-8.3 (f16x2 best 9.4)
#   gate_up 28672 x 4096  f16x2, 64 columns, 2 warps, 8 steps, 2 rows: with the norm in its prologue
#                       28.4 (launch + GEMV 35.9; the same with the first loads early 35.0); alone 25.2
#                       (the tensor-core kernel 32.9)
#   down 4096 x 14336   f16x2, 64 columns, 2 warps, 4 steps, 2 rows    15.9 (fp32 path 19.3)
# Other shapes: 128 columns, 4 warps, 2 steps (fp32), the best over h40's four shapes together.
_TABLE: dict[tuple[int, int], StreamConfig | TCConfig] = {
    (6144, 4096): StreamConfig(256, 2, 4, MATH="f16x2", ROWS=2, EARLY=True),
    (4096, 4096): StreamConfig(128, 2, 4),
    (28672, 4096): StreamConfig(64, 8, 2, MATH="f16x2", ROWS=2),
    (4096, 14336): StreamConfig(64, 4, 2, MATH="f16x2", ROWS=2),
}
_DEFAULT = StreamConfig(128, 2, 4)


def stream_config(n: int, k: int) -> StreamConfig | TCConfig:
    """The one-row launch for an (N, K) int4 weight: a StreamConfig for this kernel, or a TCConfig
    where the tensor-core kernel (wna16_tc.py) measured faster."""
    return _TABLE.get((n, k), _DEFAULT)


def wna16_stream_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int, bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                        config: StreamConfig | TCConfig | None = None, act: str | None = None) -> torch.Tensor:
    """x (1, K) -> (1, N), int4 weights in the layout above. perm (K,) int32 / int64 (act-order):
    weight row k holds input perm[k]; the kernel reads x through it (no gather launch). The launch
    is `stream_config(N, K)` unless given; a TCConfig sends the row to the tensor-core kernel.
    act "silu_and_mul": x is (1, 2K), gate then up, and the inputs are silu(gate) * up (SwiGLU's
    down projection); the f16x2 path computes them in its x prologue (no activation launch), the
    others run `activation.silu_and_mul` first."""
    if act not in (None, "silu_and_mul"):
        raise ValueError(f"activation {act!r} not built (silu_and_mul)")
    k = qweight.shape[0] * 8
    if x.shape[1] != (2 * k if act else k):
        raise ValueError(f"x has {x.shape[1]} inputs, the packed weight {k}" + (" (x 2: gate and up)" if act else ""))
    return _stream(x, qweight, scales, zeros, group_size, bias, perm, config, 1 if act else 0, None)


def wna16_stream_linear_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                 qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                                 bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                                 config: StreamConfig | TCConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ W, x + residual) for one row, as `rmsnorm.rms_norm(x, norm_weight, eps,
    residual)` followed by `wna16_stream_linear`: the f16x2 path computes the norm in its x prologue
    (each program the row's rstd; the first N block's programs store the new residual), so the norm
    needs no launch of its own; the other paths run `rms_norm` first."""
    k = qweight.shape[0] * 8
    if x.shape != (1, k) or residual.shape != (1, k) or norm_weight.shape != (k,):
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)} and norm weight "
                         f"{tuple(norm_weight.shape)} must be (1, {k}), (1, {k}), ({k},)")
    cfg = config or stream_config(qweight.shape[1], k)
    if not (isinstance(cfg, StreamConfig) and cfg.MATH == "f16x2"):
        normed, r_out = rms_norm(x, norm_weight, eps, residual)
        return _stream(normed, qweight, scales, zeros, group_size, bias, perm, cfg, 0, None), r_out
    r_out = torch.empty_like(residual)
    out = _stream(x.contiguous(), qweight, scales, zeros, group_size, bias, perm, cfg, 2,
                  (residual.contiguous(), norm_weight.contiguous(), eps, r_out))
    return out, r_out


def _stream(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            bias: torch.Tensor | None, perm: torch.Tensor | None, config: StreamConfig | TCConfig | None, x_act: int,
            norm: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None) -> torch.Tensor:
    """The launch of the two above. x_act 0: x is the input; 1: x = [gate | up]; 2: norm = (residual,
    norm weight, eps, residual out), the inputs rms_norm(x + residual) (f16x2 configs only: the
    callers run the transform first for the others)."""
    m = x.shape[0]
    k = qweight.shape[0] * 8
    n = qweight.shape[1]
    if m != 1:
        raise ValueError(f"wna16_stream_linear takes one row, got {m}")
    cfg = config or stream_config(n, k)
    packed = isinstance(cfg, StreamConfig) and cfg.MATH == "f16x2"
    if x_act == 1 and not packed:
        x, x_act = silu_and_mul(x), 0

    def unfused_input() -> torch.Tensor:  # the transform as its own kernel (the fallbacks below)
        if x_act == 1:
            return silu_and_mul(x)
        if x_act == 2:
            normed, r_out = rms_norm(x, norm[1], norm[2], norm[0])
            norm[3].copy_(r_out)
            return normed
        return x

    if isinstance(cfg, TCConfig):
        return wna16_tc_linear(x, qweight, scales, zeros, group_size, bias, perm, config=cfg)
    block_k = cfg.BLOCK_KW * 8
    if group_size % block_k or k % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide the group size {group_size} and K {k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if cfg.MATH not in ("fp32", "f16x2") or cfg.ROWS not in (1, 2, 4) or cfg.BLOCK_KW % cfg.ROWS:
        raise ValueError(f"MATH {cfg.MATH!r} / ROWS {cfg.ROWS} not built (fp32 or f16x2; 1, 2 or 4 rows "
                         f"dividing BLOCK_KW {cfg.BLOCK_KW})")
    steps_total = k // block_k
    steps = program_steps(cfg, k)
    if cfg.MATH == "f16x2" and steps & (steps - 1):
        raise ValueError(f"f16x2 math takes a power-of-two number of steps a program, got {steps} (STEPS "
                         f"{cfg.STEPS}, K {k})")
    split = steps_total // steps
    n_blocks = triton.cdiv(n, cfg.BLOCK_N)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    ws = split_k_workspace(_workspaces, x.device, _WS_FLOATS, _WS_COUNTERS) if split > 1 else None
    if split == 1:
        ws = (out, out)  # never read: the split-K branch is compiled out
    elif ws is None or split * n > _WS_FLOATS or n_blocks > _WS_COUNTERS:
        # no workspace (first made inside a capture) or too little: the tensor-core kernel, which
        # loops over K, instead of unrolling all of K here
        return wna16_tc_linear(unfused_input(), qweight, scales, zeros, group_size, bias, perm)
    x_scratch = cfg.MATH == "f16x2" and cfg.X_SCRATCH
    xp = _x_pair_scratch(x.device, k) if x_scratch else None
    if x_scratch and xp is None:
        cfg = cfg._replace(X_SCRATCH=False)  # first made inside a capture: the same pairs, made per step
    r_in, nw, eps, r_out = norm if norm is not None else (out, out, 0.0, out)
    _wna16_stream_kernel[(n_blocks, split)](
        x, qweight, scales, zeros, bias if bias is not None else out, perm if perm is not None else out,
        out, ws[0], ws[1], xp if xp is not None else out, n, split, MAGIC_EVEN, MAGIC_ODD, k, r_in, nw, r_out, eps,
        GROUP_SIZE=group_size, STEPS=steps, HAS_BIAS=bias is not None, HAS_PERM=perm is not None,
        USE_SPLIT=split > 1, RED_ROWS=min(RED, triton.next_power_of_2(split)),
        BLOCK_N=cfg.BLOCK_N, BLOCK_KW=cfg.BLOCK_KW, STEP_SUMS=cfg.STEP_SUMS, PREFETCH=cfg.PREFETCH,
        MATH=cfg.MATH, ROWS=cfg.ROWS, X_SCRATCH=cfg.X_SCRATCH, SZ_TILE=cfg.SZ_TILE,
        EVEN_N=n % cfg.BLOCK_N == 0, EARLY=cfg.EARLY, X_ACT=x_act, HIDDEN_PAD=triton.next_power_of_2(k),
        USE_ASM=_USE_ASM, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
