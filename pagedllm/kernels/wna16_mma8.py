"""Int4 weight x 16-bit activation linear for 1-8 rows (the batch-1 decode step) on the tensor cores'
mma.sync, written in Gluon so that each thread's A operand is made in registers from the words it
loads itself: no shared memory, no block barrier, fp32 sums.

Same packed layout as kernels/wna16_gemm.py (qweight (K // 8, N) int32, nibble j of word row r holds
input 8r + j; scales (K // G, N) in x's dtype, zeros (K // G, N) uint8): nothing is repacked.

Why (BENCHMARKS.md, issue 19): the one-row stream kernel (wna16_stream.py) multiplies on packed fp16
FMAs, ~21-23 sm_90 instructions a packed word with its x handling and fp16 -> fp32 conversions, and
the int4 GEMVs are ~1.9 ms of a 2.66 ms batch-1 step. Here the tensor cores do the multiply-adds
(m16n8k16: weights as A, 16 output columns x 16 inputs; x as B, 16 inputs x 8 rows, rows past M
zero), so a word costs its dequantization alone: one shift (none for fp16's even pairs), one LOP3
and one packed FMA per pair of weights, ~12 instructions a word with its load and HMMA.

The trick is a permutation of each 128-input step's inputs, kk (the MMA's k) <-> (word row wr,
nibble j), the same for A and B so the dot product is unchanged:

    kk = (j >> 2) | (wr & 3) << 1 | (j & 3) << 3 | (wr >> 2) << 5

mma.sync's A layout gives lane c = lane % 4 the k bits 1-2 and keeps k bits 0, 3-6 in registers, so
under this map a thread holds all 8 nibbles of the words (column, wr = c + 4u) it loads, and the
register pair (kk, kk + 1) of one A register is the nibble pair (i, i + 4), i = j & 3, which
Marlin's magic-number dequantization makes with one LOP3 (nibbles i, i + 4 sit at bits 4i, 16 + 4i):

    bf16: t = (w >> SHIFT_i) & MASK_i | 0x43004300   -> (128 + q, 128 + q') for even i,
          SHIFT (0, 1, 8, 9), MASK (0x000F000F, 0x00780078, ...) -> (128 + 8q, 128 + 8q') for odd i
    fp16: the same with 0x64006400 (1024 + q) and MASK 0x00F000F0 for odd i (1024 + 16 q), SHIFT (0, 0, 8, 8)
    a = fma(t, (1, 1), -(128 + z)) or fma(t, (1/8, 1/8), -(16 + z))  -> (q - z, q' - z), exact

so A holds q - z exactly (small integers), B holds x as given, the MMA sums (q - z) x in fp32 over a
128-input step, and the step's group scale multiplies that sum in fp32. B's thread holds, for its x
row, the 8 inputs of each word row it needs, one 16-byte load each.

Worked example (bf16, i = 1, word w = 0x00A000B0: nibble 1 = 0xB, nibble 5 = 0xA; z = 3):
w >> 1 = 0x00500058; & 0x00780078 = 0x00500058; | 0x43004300 = 0x43504358 = (128 + 88, 128 + 80);
* 1/8 - (16 + 3) = (27 - 19, 26 - 19) = (8, 7) = (0xB - 3, 0xA - 3).

Program (pn, pk): output columns [pn * BLOCK_N, + BLOCK_N), inputs [pk * STEPS * 128, + STEPS * 128);
STEPS is a constexpr (the loop is unrolled, every load independent of the arithmetic, as the stream
kernel's). Split-K partials summed in split order by the last program of a column block (as
kernels/gemv.py's `store_split_k_output`), one launch, no memset, CUDA-graph safe.

Limits: CUDA, Gluon (Triton >= 3.6; no interpreter, so no CPU path: `mma8_supported` says when);
M <= 8; 16-bit x; 4-bit weights; the group size a multiple of 128; BLOCK_N a multiple of 16 x
num_warps. Reference: `wna16_gemm.wna16_linear_ref`; `mma8_dequant_emulation` does the A arithmetic
in torch and tests/kernels/test_wna16_mma8.py holds it and the index map to the reference on the CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from pagedllm.kernels.gemv import split_k_workspace
from pagedllm.kernels.gluon_split_k import store_transposed_output

__all__ = ["MMA8Config", "kk_of", "mma8_dequant_emulation", "mma8_supported", "pair_constants", "wna16_mma8_linear"]

MAX_M = 8  # mma.sync's n: rows of x a launch takes
STEP_K = 128  # inputs a step: 16 word rows, the permutation's span
_WS_FLOATS = 1 << 22  # 16 MB of fp32 split-K partials per device, allocated once
_WS_COUNTERS = 1 << 15
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


class MMA8Config(NamedTuple):
    BLOCK_N: int  # output columns a program: a multiple of 16 x num_warps
    STEPS: int  # 128-input steps a program (unrolled); fewer where K has fewer or they would not divide it
    num_warps: int
    # MMA rows -> columns so that a thread's 2 x (BLOCK_N / (16 x num_warps)) columns are adjacent: its words,
    # scales and zero points come as vectors (16 bytes of words at 2 row blocks a warp), not one per column
    VEC: bool = False


# Per 16-bit dtype: magic exponent bits of both halves, the offset they add, and for pair i = 0..3 the
# shift, the LOP3 mask and the multiplier c_i (the odd pairs' values come c_i times their nibble).
_DTYPES = {
    torch.bfloat16: (0x43004300, 128.0, (0, 1, 8, 9), (0x000F000F, 0x00780078, 0x000F000F, 0x00780078), 8.0),
    torch.float16: (0x64006400, 1024.0, (0, 0, 8, 8), (0x000F000F, 0x00F000F0, 0x000F000F, 0x00F000F0), 16.0),
}
# bits of -(OFF + z) and -(OFF / c + z) at z = 0 (add z, or c z, for a zero point z in 0..15)
_NZ = {torch.bfloat16: (0xC300, 0xC180), torch.float16: (0xE400, 0xD400)}
_ONE_BITS = {torch.bfloat16: (0x3F80, 0x3E00), torch.float16: (0x3C00, 0x2C00)}  # 1 and 1 / c_odd


def kk_of(wr: torch.Tensor | int, j: torch.Tensor | int) -> torch.Tensor | int:
    """The MMA k index (0..127) of word row wr (0..15) and nibble j (0..7) of a step (module doc)."""
    return (j >> 2) | (wr & 3) << 1 | (j & 3) << 3 | (wr >> 2) << 5


def pair_constants(dtype: torch.dtype) -> tuple[int, float, list[int], list[int], list[int], float]:
    """(magic, offset, shifts, masks, the odd pairs' 1 / c bits, c) of `dtype` (module doc)."""
    magic, off, shifts, masks, c = _DTYPES[dtype]
    return magic, off, list(shifts), list(masks), list(_ONE_BITS[dtype]), c


def mma8_dequant_emulation(qweight: torch.Tensor, zeros: torch.Tensor, group_size: int,
                           dtype: torch.dtype) -> torch.Tensor:
    """q - z (K, N) as the kernel's A registers hold it, by its own bit arithmetic in torch: the shift,
    the LOP3 magic pair and the packed FMA (each rounded to `dtype`). Tests hold it equal to q - z."""
    magic, off, shifts, masks, _, c = pair_constants(dtype)
    kw, n = qweight.shape
    words = qweight.to(torch.int64) & 0xFFFFFFFF  # (K // 8, N)
    out = torch.empty(kw, 8, n, dtype=torch.float32, device=qweight.device)
    z = zeros.float().repeat_interleave(group_size // 8, dim=0)  # (K // 8, N): each word row's zero points
    for i in range(4):
        t = ((words >> shifts[i]) & masks[i]) | magic  # LOP3: (t & mask) | magic
        for half, j in ((0, i), (1, i + 4)):
            bits = ((t >> (16 * half)) & 0xFFFF).to(torch.int16)
            v = bits.view(dtype).float()  # off + q or off + c q, exact
            mul, add = (1.0, -(off + z)) if i % 2 == 0 else (1.0 / c, -(off / c + z))
            out[:, j] = (v * mul + add).to(dtype).float()  # one fma.rn: exact (small integers)
    return out.reshape(kw * 8, n)


@gluon.jit
def _to_kk_order(t, ROWS: gl.constexpr):
    """(ROWS, 16, 8) (row, wr, j) -> (ROWS, 128) (row, kk): the step's permutation (module doc), as
    reshapes and a permute, which only relabel a linear layout's bases."""
    t = gl.reshape(t, [ROWS, 4, 2, 2, 2, 2, 2])  # (row, wr >> 2, wr1, wr0, j2, j1, j0)
    t = gl.permute(t, [0, 1, 5, 6, 2, 3, 4])  # kk's bits from the top: wr >> 2, j1, j0, wr1, wr0, j2
    return gl.reshape(t, [ROWS, 128])


@gluon.jit
def _to_mma_rows(t, BLOCK_N: gl.constexpr, W: gl.constexpr, NREP: gl.constexpr):
    """(BLOCK_N, 128) indexed by column -> indexed by MMA row (VEC): column ((w * 8 + g) * NREP + r) * 2 + h is
    row r * 16 W + w * 16 + h * 8 + g (lane group g, warp w, row block r, half h), a thread's columns adjacent."""
    t = gl.reshape(t, [W, 8, NREP, 2, 128])
    t = gl.permute(t, [2, 0, 3, 1, 4])
    return gl.reshape(t, [BLOCK_N, 128])


@gluon.jit
def _column_of_row(rows, W: gl.constexpr, NREP: gl.constexpr):
    """The column `_to_mma_rows` gives MMA row `rows` (int tensor)."""
    g = rows & 7
    h = (rows >> 3) & 1
    w = (rows >> 4) & (W - 1)
    r = rows // (16 * W)
    return ((w * 8 + g) * NREP + r) * 2 + h


@gluon.jit
def _wna16_mma8_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
    M, stride_xm, stride_om, SPLIT_K,
    N: gl.constexpr, GROUP_SIZE: gl.constexpr, STEPS: gl.constexpr, BLOCK_N: gl.constexpr,
    ASM: gl.constexpr, NZ_EVEN: gl.constexpr, NZ_ODD: gl.constexpr, C_ODD_INT: gl.constexpr,
    ONE_EVEN: gl.constexpr, ONE_ODD: gl.constexpr,
    SHIFTS: gl.constexpr, MASKS: gl.constexpr, HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr,
    EVEN_N: gl.constexpr, WORDS3: gl.constexpr, W_LOAD: gl.constexpr, X3: gl.constexpr, X3_LOAD: gl.constexpr,
    VEC: gl.constexpr,
    NREP: gl.constexpr,
):
    num_warps: gl.constexpr = gl.num_warps()
    DTYPE = x_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    a_lin: gl.constexpr = gl.to_linear_layout(a_op, [BLOCK_N, 128])
    b_lin: gl.constexpr = gl.to_linear_layout(b_op, [128, 8])
    w_l: gl.constexpr = gl.SliceLayout(2, WORDS3)  # (BLOCK_N, 16) words: each loaded by one thread
    col_l: gl.constexpr = gl.SliceLayout(1, w_l)
    j_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, WORDS3))

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    k_start = pid_k.to(gl.int64) * (STEPS * 128)

    # int64 offsets: each element's address is then the thread's base plus a constant (N is a constexpr),
    # one LDG with an immediate offset; int32 sums are sign-extended after adding, which the compiler
    # cannot split, so every load would pay its own address arithmetic
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, col_l).to(gl.int64)
    mask_n = offs_n < N
    # the words are loaded in W_LOAD (the same threads, a thread's adjacent columns its first registers: vector
    # loads) and renamed into w_l
    offs_wr = gl.arange(0, 16, gl.SliceLayout(0, W_LOAD)).to(gl.int64)
    offs_wn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, W_LOAD)).to(gl.int64)
    w_offs = offs_wr[None, :] * N + offs_wn[:, None]  # (BLOCK_N, 16), from the step's first word row
    w_mask = (offs_wn < N)[:, None]

    # per-register constants of the pair arithmetic: pair i = j & 3 of nibble j (registers only)
    j = gl.arange(0, 8, j_l)
    i = j & 3
    odd = (i & 1) == 1
    shift = gl.where(i == 0, SHIFTS[0], gl.where(i == 1, SHIFTS[1], gl.where(i == 2, SHIFTS[2], SHIFTS[3])))
    mask = gl.where(i == 0, MASKS[0], gl.where(i == 1, MASKS[1], gl.where(i == 2, MASKS[2], MASKS[3])))
    mul = gl.where(odd, ONE_ODD * 0x10001, ONE_EVEN * 0x10001)
    shift3 = gl.expand_dims(gl.expand_dims(shift, 0), 1).broadcast_to(BLOCK_N, 16, 8)
    mask3 = gl.expand_dims(gl.expand_dims(mask, 0), 1).broadcast_to(BLOCK_N, 16, 8)
    mul3 = gl.expand_dims(gl.expand_dims(mul, 0), 1).broadcast_to(BLOCK_N, 16, 8)
    odd3 = gl.expand_dims(gl.expand_dims(odd, 0), 1).broadcast_to(BLOCK_N, 16, 8)

    # x: rows m < M, each thread the 8 inputs of each word row it needs (16 bytes, contiguous)
    xm = gl.arange(0, 8, gl.SliceLayout(1, gl.SliceLayout(2, X3_LOAD)))
    xwr = gl.arange(0, 16, gl.SliceLayout(0, gl.SliceLayout(2, X3_LOAD)))
    xj = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, X3_LOAD)))
    x_offs = (gl.expand_dims(gl.expand_dims(xm.to(gl.int64) * stride_xm, 1), 2)
              + gl.expand_dims(gl.expand_dims(xwr.to(gl.int64) * 8, 0), 2)
              + gl.expand_dims(gl.expand_dims(xj.to(gl.int64), 0), 1))
    x_mask = gl.expand_dims(gl.expand_dims(xm < M, 1), 2).broadcast_to(8, 16, 8)

    mma_rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, mma))
    if VEC:
        mma_rows = _column_of_row(mma_rows, num_warps, NREP)
    s_rows = pid_n * BLOCK_N + mma_rows.to(gl.int64)  # the output column of each MMA row
    s_mask = s_rows < N
    acc = gl.zeros([BLOCK_N, 8], gl.float32, mma)
    # each step's loads are issued before the step before it computes (one step of prefetch in
    # program order: the unrolled program keeps two steps of words in flight)
    words, z, s, xv = _load_step(qw_ptr, z_ptr, s_ptr, x_ptr, k_start, N, w_offs, w_mask, offs_n, mask_n, s_rows, s_mask,
                                 x_offs, x_mask, GROUP_SIZE, EVEN_N, w_l)
    for step in gl.static_range(STEPS):
        if step + 1 < STEPS:
            words_n, z_n, s_n, xv_n = _load_step(qw_ptr, z_ptr, s_ptr, x_ptr, k_start + (step + 1) * 128, N, w_offs, w_mask,
                                                 offs_n, mask_n, s_rows, s_mask, x_offs, x_mask, GROUP_SIZE, EVEN_N, w_l)
        # the zero pairs' bits straight from the integer z (0..15): -(OFF + z) for even pairs, -(OFF / c + z)
        # for odd ones, in both 16-bit halves (bf16: 0xC300 + z, 0xC180 + 8 z; fp16: 0xE400 + z, 0xD400 + 16 z)
        zi = z.to(gl.int32)
        nz_even = (NZ_EVEN + zi) * 0x10001
        nz_odd = (NZ_ODD + zi * C_ODD_INT) * 0x10001
        nz3 = gl.where(odd3, gl.expand_dims(gl.expand_dims(nz_odd, 1), 2).broadcast_to(BLOCK_N, 16, 8),
                       gl.expand_dims(gl.expand_dims(nz_even, 1), 2).broadcast_to(BLOCK_N, 16, 8))
        w3 = gl.expand_dims(words, 2).broadcast_to(BLOCK_N, 16, 8)
        a = gl.inline_asm_elementwise(ASM, "=r,r,r,r,r,r,r,r,r,r,r", [w3, shift3, mask3, mul3, nz3], dtype=DTYPE,
                                      is_pure=True, pack=2)  # (BLOCK_N, 16, 8): q - z
        a = _to_kk_order(a, BLOCK_N)
        if VEC:
            a = _to_mma_rows(a, BLOCK_N, num_warps, NREP)
        a = gl.convert_layout(a, a_lin, assert_trivial=True)
        a = gl.convert_layout(a, a_op, assert_trivial=True)
        b = gl.convert_layout(xv, X3)  # the same registers, renamed
        b = gl.permute(_to_kk_order(b, 8), [1, 0])  # (128, 8)
        b = gl.convert_layout(b, b_lin, assert_trivial=True)
        b = gl.convert_layout(b, b_op, assert_trivial=True)
        part = mma_v2(a, b, gl.zeros([BLOCK_N, 8], gl.float32, mma))
        acc += part * s.to(gl.float32)[:, None]
        if step + 1 < STEPS:
            words, z, s, xv = words_n, z_n, s_n, xv_n

    # out[m, n] = acc[n, m] (+ bias[n]) for m < M, stored from the MMA layout itself
    om = gl.arange(0, 8, gl.SliceLayout(0, mma))
    store_transposed_output(acc, out_ptr, ws_ptr, counter_ptr, bias_ptr, pid_n, pid_k, s_rows, om, M, N, stride_om,
                            SPLIT_K, HAS_BIAS, USE_SPLIT)


@gluon.jit
def _load_step(qw_ptr, z_ptr, s_ptr, x_ptr, k0, N: gl.constexpr, w_offs, w_mask, offs_n, mask_n, s_rows, s_mask,
               x_offs, x_mask, GROUP_SIZE: gl.constexpr, EVEN_N: gl.constexpr, w_l: gl.constexpr):
    """The 128-input step at k0: its words (BLOCK_N, 16), zero points and scales of its group, and x."""
    g = k0 // GROUP_SIZE
    if EVEN_N:
        words = gl.load(qw_ptr + (k0 // 8) * N + w_offs)
        z = gl.load(z_ptr + g * N + offs_n)
        s = gl.load(s_ptr + g * N + s_rows)
    else:
        words = gl.load(qw_ptr + (k0 // 8) * N + w_offs, mask=w_mask, other=0)
        z = gl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0)
        s = gl.load(s_ptr + g * N + s_rows, mask=s_mask, other=0.0)
    words = gl.convert_layout(words, w_l)  # the same registers, renamed
    # rows m >= M are left unloaded: B's column m only feeds output column m, which is never stored
    xv = gl.load(x_ptr + k0 + x_offs, mask=x_mask)
    return words, z, s, xv


def _column_bit(row: int, num_warps: int, nrep: int) -> int:
    """`_column_of_row` of a one-bit MMA row (a basis vector), in Python."""
    g, h, w, r = row & 7, (row >> 3) & 1, (row >> 4) & (num_warps - 1), row // (16 * num_warps)
    return ((w * 8 + g) * nrep + r) * 2 + h


def _image(bases: list[list[int]], rows_first: bool, vec: tuple[int, int] | None = None) -> list[list[int]]:
    """Bases over (row, kk) (or (kk, row) when not rows_first) -> over (row, wr, j): each kk bit goes to
    its (wr, j) bit by `kk_of`'s inverse (every kk basis vector is one bit); vec = (num_warps, nrep): the
    rows to columns as `_to_mma_rows` maps them."""
    out = []
    for b in bases:
        row, kk = (b[0], b[1]) if rows_first else (b[1], b[0])
        if vec is not None:
            row = _column_bit(row, *vec)
        wr = j = 0
        for bit, (to_wr, val) in enumerate([(False, 4), (True, 1), (True, 2), (False, 1), (False, 2),
                                            (True, 4), (True, 8)]):  # kk bits 0..6 (kk_of)
            if kk >> bit & 1:
                if to_wr:
                    wr |= val
                else:
                    j |= val
        out.append([row, wr, j])
    return out


def _mma_bases(block_n: int, num_warps: int) -> tuple[list, list, list, list, list]:
    """mma.sync's (m16n8k16, warps along the rows) A operand over (block_n, 128) and B over (128, 8), as
    Triton builds them (DotOperandLayout(k_width=2) of NVMMADistributedLayout v2; printed with
    gl.to_linear_layout and checked at compile time by the kernel's assert_trivial conversions):
    (A registers, A lanes, A warps, B registers, B lanes)."""
    a_regs = [[0, 1], [8, 0], [0, 8], [0, 16], [0, 32], [0, 64]]
    a_regs += [[16 * num_warps << r, 0] for r in range((block_n // (16 * num_warps)).bit_length() - 1)]
    a_lanes = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    a_warps = [[16 << w, 0] for w in range(num_warps.bit_length() - 1)]
    b_regs = [[1, 0], [8, 0], [16, 0], [32, 0], [64, 0]]
    b_lanes = [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]]
    return a_regs, a_lanes, a_warps, b_regs, b_lanes


@functools.cache
def _launch_constants(cfg: MMA8Config, dtype: torch.dtype) -> dict:
    """The kernel's constexprs that follow from the launch and x's dtype (layouts, the pair's PTX), built
    once each: the wrapper runs on every eager call."""
    magic, _, shifts, masks, ones, c = pair_constants(dtype)
    fma = "fma.rn.bf16x2" if dtype == torch.bfloat16 else "fma.rn.f16x2"
    asm = f"""{{
.reg .b32 t;
shr.u32 t, $1, $3;
lop3.b32 t, t, $5, {magic:#x}, 0xEA;
{fma} $0, t, $7, $9;
}}"""
    w = cfg.num_warps
    a_regs, a_lanes, a_warps, b_regs, b_lanes = _mma_bases(cfg.BLOCK_N, w)
    nrep = cfg.BLOCK_N // (16 * w)
    vec = (w, nrep) if cfg.VEC else None
    words3 = gl.DistributedLinearLayout(reg_bases=_image(a_regs, True, vec), lane_bases=_image(a_lanes, True, vec),
                                        warp_bases=_image(a_warps, True, vec), block_bases=[],
                                        shape=[cfg.BLOCK_N, 16, 8])
    # the words' load layout: WORDS3's threads over (column, word row), the column registers first
    w2 = [[b[0], b[1]] for b in _image(a_regs, True, vec) if b[0] or b[1]]
    w_load = gl.DistributedLinearLayout(reg_bases=sorted(w2, key=lambda b: (b[0] == 0, b[0], b[1])),
                                        lane_bases=[[b[0], b[1]] for b in _image(a_lanes, True, vec)],
                                        warp_bases=[[b[0], b[1]] for b in _image(a_warps, True, vec)], block_bases=[],
                                        shape=[cfg.BLOCK_N, 16])
    x_regs = _image(b_regs, False)
    zero_warps = [[0, 0, 0]] * (w.bit_length() - 1)
    x3 = gl.DistributedLinearLayout(reg_bases=x_regs, lane_bases=_image(b_lanes, False), warp_bases=zero_warps,
                                    block_bases=[], shape=[8, 16, 8])
    # the same threads' elements with the nibbles' registers in memory order (j0, j1, j2 first): one
    # 16-byte load of a word row's 8 inputs
    x3_load = gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4]] + [b for b in x_regs if b[2] == 0],
                                         lane_bases=_image(b_lanes, False), warp_bases=zero_warps, block_bases=[],
                                         shape=[8, 16, 8])
    return dict(ASM=asm, NZ_EVEN=_NZ[dtype][0], NZ_ODD=_NZ[dtype][1], C_ODD_INT=int(c), ONE_EVEN=ones[0],
                ONE_ODD=ones[1], SHIFTS=tuple(shifts),
                MASKS=tuple(masks), BLOCK_N=cfg.BLOCK_N, WORDS3=words3, W_LOAD=w_load, X3=x3, X3_LOAD=x3_load, VEC=cfg.VEC,
                NREP=nrep)


def mma8_supported(x: torch.Tensor, k: int, group_size: int, bits: int) -> bool:
    """Whether `wna16_mma8_linear` may take this call: CUDA, 1-8 rows of 16-bit x, int4, 128-input steps
    dividing K and the group size."""
    return (x.is_cuda and 1 <= x.shape[0] <= MAX_M and x.dtype in _DTYPES and bits == 4
            and k % STEP_K == 0 and group_size % STEP_K == 0)


def program_steps(cfg: MMA8Config, k: int) -> int:
    """The 128-input steps a program takes: cfg.STEPS, fewer where K has fewer or they would not divide K's."""
    total = k // STEP_K
    steps = max(1, min(cfg.STEPS, total))
    while total % steps:
        steps -= 1
    return steps


def wna16_mma8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, config: MMA8Config, bias: torch.Tensor | None = None,
                      perm: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K), M <= 8 -> (M, N) in x's dtype; perm (K,) (act-order): weight row k holds input perm[k],
    so x is gathered once by it."""
    m, k = x.shape
    n = qweight.shape[1]
    cfg = config
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"x has {k} inputs, the packed weight {qweight.shape[0] * 8}")
    if not (1 <= m <= MAX_M and x.dtype in _DTYPES and k % STEP_K == 0 and group_size % STEP_K == 0):
        raise ValueError(f"wna16_mma8_linear takes 1-{MAX_M} rows of 16-bit x with K ({k}) and the group size "
                         f"({group_size}) multiples of {STEP_K}; got {tuple(x.shape)} {x.dtype}")
    if cfg.BLOCK_N % (16 * cfg.num_warps) or cfg.BLOCK_N & (cfg.BLOCK_N - 1):
        raise ValueError(f"{cfg}: BLOCK_N must be a power of two and a multiple of 16 x num_warps")
    if perm is not None:
        x = x.index_select(1, perm)
    if x.stride(1) != 1:
        x = x.contiguous()
    steps = program_steps(cfg, k)
    split = k // STEP_K // steps
    n_blocks = -(-n // cfg.BLOCK_N)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = split_k_workspace(_workspaces, x.device, _WS_FLOATS, _WS_COUNTERS) if split > 1 else (out, out)
    if ws is None or split * m * n > _WS_FLOATS or n_blocks > _WS_COUNTERS:
        # no workspace (first made inside a capture) or too little: one program a column block over all of K
        steps, split, ws = k // STEP_K, 1, (out, out)
    _wna16_mma8_kernel[(n_blocks, split)](
        x, qweight, scales, zeros, bias if bias is not None else out, out, ws[0], ws[1],
        m, x.stride(0), out.stride(0), split,
        N=n, GROUP_SIZE=group_size, STEPS=steps, HAS_BIAS=bias is not None, USE_SPLIT=split > 1,
        EVEN_N=n % cfg.BLOCK_N == 0, **_launch_constants(cfg, x.dtype), num_warps=cfg.num_warps,
    )
    return out
