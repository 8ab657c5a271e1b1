"""Triton helpers that turn packed int32 words of W4A16 / W8A16 weights into values, without int -> float
conversions (the slow unit on sm_90): a word's low and high 16 bits each hold pf / 2 values (pf = 32 //
bits); value j sits at bits [b * s, +b) of its half (s = j % (pf / 2)), and

    float_bits(half & (mask << b*s) | 0x4B000000) = 2^23 + q * 2^(b*s)      (exact: < 2^24)

so one LOP3 gives q scaled by a power of two, offset by 2^23 (`unpack_scaled`); one FFMA more undoes both
exactly (`unpack_q`). `unpack_tile` stacks the pf values of a (BLOCK_KP, BLOCK_N) tile of words into the
(BLOCK_KP * pf, BLOCK_N) tile of q in natural row order (row kp * pf + j), ready for one tl.dot against a
contiguous x tile. Layout: kernels/wna16_gemm.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["unpack_q", "unpack_scaled", "unpack_tile"]


@triton.jit
def unpack_scaled(lo, hi, J: tl.constexpr, BITS: tl.constexpr):
    """2^23 + q_j * 2^(BITS * s) as fp32 for value J of each word (lo = word, hi = word >> 16)."""
    HALF: tl.constexpr = 16 // BITS
    S: tl.constexpr = J % HALF
    MASK: tl.constexpr = ((1 << BITS) - 1) << (BITS * S)
    if J < HALF:
        bits = (lo & MASK) | 0x4B000000
    else:
        bits = (hi & MASK) | 0x4B000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def unpack_q(lo, hi, J: tl.constexpr, BITS: tl.constexpr):
    """q_j as fp32, exactly: (2^23 + q * f) / f - 2^23 / f in one FFMA (f a power of two)."""
    inv = 1.0 / (1 << (BITS * (J % (16 // BITS))))
    return unpack_scaled(lo, hi, J, BITS) * inv - 8388608.0 * inv


@triton.jit
def unpack_tile(words, BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_KP, BLOCK_N) int32 words -> (BLOCK_K, BLOCK_N) fp32 q, row kp * pf + j = value j of row kp.

    tl.join adds a last axis: for 4 bits join(join(join(q0, q4), join(q2, q6)), join(join(q1, q5),
    join(q3, q7))) has t[kp, n, a, b, c] = q_(4a + 2b + c); moving n last and flattening gives row
    kp * 8 + 4a + 2b + c = kp * 8 + j.
    """
    hi = words >> 16
    if BITS == 4:
        t = tl.join(tl.join(tl.join(unpack_q(words, hi, 0, 4), unpack_q(words, hi, 4, 4)),
                            tl.join(unpack_q(words, hi, 2, 4), unpack_q(words, hi, 6, 4))),
                    tl.join(tl.join(unpack_q(words, hi, 1, 4), unpack_q(words, hi, 5, 4)),
                            tl.join(unpack_q(words, hi, 3, 4), unpack_q(words, hi, 7, 4))))
        t = tl.permute(t, (0, 2, 3, 4, 1))
    else:
        t = tl.join(tl.join(unpack_q(words, hi, 0, 8), unpack_q(words, hi, 2, 8)),
                    tl.join(unpack_q(words, hi, 1, 8), unpack_q(words, hi, 3, 8)))
        t = tl.permute(t, (0, 2, 3, 1))
    return tl.reshape(t, (BLOCK_K, BLOCK_N))

