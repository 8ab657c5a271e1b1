"""The one-row int4 stream kernel's packed fp16 inner loop (kernels/wna16_stream.py, MATH="f16x2"),
and its torch emulation `wna16_packed_emulation` (the reference the kernel is held to).

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.wna16_stream_prologue import _row_rstd, _x_in

__all__ = ["wna16_packed_emulation"]


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
