"""The one-row int4 stream kernel's fp32 inner loop (kernels/wna16_stream.py, MATH="fp32").

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

Reference: `wna16_gemm.wna16_linear_ref`.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC_EVEN = 0x43800000  # fp32 256.0: a nibble at bits 15..18 reads as 256 + q
MAGIC_ODD = 0x41800000  # fp32 16.0: a nibble at bits 19..22 reads as 16 + q


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
