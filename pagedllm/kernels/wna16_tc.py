"""Int4 weight x 16-bit activation GEMM on tensor cores for decode batches (the dispatch's M range is
wna16_gemm.TC_MAX_M; a launch takes up to 8192 rows), the packed words unpacked by LOP3 only.

Layout: kernels/wna16_gemm.py, untouched (qweight (K // 8, N) int32, nibble i of word r holds input
8r + i; scales / zeros (K // G, N)), so no second copy and no load-time repack beyond act-order's.

Why: the FMA GEMV (wna16_gemv.py) spends ~54 sm_90 instructions per packed word (sm_90 SASS of its
loop, compiled on the CPU with Triton's ptxas: mask, convert and FMA for each of the 8 values plus x
loads), so at M = 1 it is issue-bound (BENCHMARKS.md). Here the multiply-accumulate goes to the tensor
cores and a value costs about one integer instruction:

    bits(((pair >> 4s) & 0x000F000F) | MAGIC2) = (OFF + q_a, OFF + q_b)   as two 16-bit floats

with MAGIC = 0x4300 (bf16 128.0, ULP 1 below 256) or 0x6400 (fp16 1024.0, ULP 1 below 2048) and
`pair` one PRMT of two words a, b (rows k, k + 1 of one column, the two values one tensor-core
operand register holds): one LOP3 (plus a shift) gives a finished register of two exact OFF + q.
Triton loads the word tile from shared memory straight into the mma operand layout (cp.async
pipelined) and runs the PTX there, so the values never pass through shared memory. The offset is not subtracted per value; it joins
the zero point, since per group g and output n

    sum_k x[k] (q[k] - z) = sum_k x[k] (OFF + q[k]) - (OFF + z) sum_k x[k]

The left sum is a tensor-core dot accumulated in fp32 (products exact, |OFF + q| <= 16 |q - z|
max for bf16, so the cancellation costs ~4 of fp32's 24 bits); the scale multiplies the group's sum
once. The 8 nibbles of a (BLOCK_KW, BLOCK_N) word tile are 8 separate (BLOCK_KW, BLOCK_N) B tiles:
nibble i pairs with the x columns k0 + 8r + i (a strided x load, L1 resident), so no join / reshape
of values and each dot is K = BLOCK_KW (16 for a 128-input step). M is padded to 16 rows (at M = 1
the tensor cores do 16x the useful work, which they have to spare). X_TILE loads x as one (BLOCK_M,
BLOCK_K) tile and splits it in registers instead (fewer, vectorised loads; better from M = 32).
Worked example: the loop of BLOCK_M 16, BLOCK_N 256, 8 warps compiles (sm_90 SASS) to ~23
instructions per packed word: ~8 unpacking, 2 HMMA, 3 for the group epilogue, the rest x and
addresses. PRESCALE (for larger M, where that epilogue grows with the rows) instead finishes each
register as a dequantized weight, ((OFF + q) - (OFF + z)) * s by two packed FMAs (the first exact,
the second the one rounding the dequantize + cuBLAS path also has), and the dots accumulate
straight into acc: at BLOCK_M 128, ~44 instructions per word instead of ~105.

Program (pm, pn, pk): rows [pm * BLOCK_M, +BLOCK_M), output columns [pn * BLOCK_N, +BLOCK_N), K range [pk * K_PER_SPLIT,
+K_PER_SPLIT) in steps of one group-aligned BLOCK_K = 8 * BLOCK_KW inputs (BLOCK_K divides G, so G
must be a multiple of 128 for BLOCK_KW = 16: the dispatch sends other groups to wna16_gemv). Split-K
epilogue: kernels/gemv.py `store_split_k_output` (one launch, deterministic, CUDA-graph safe).

USE_ASM: the LOP3 unpack is inline PTX (the interpreter cannot run it); USE_ASM=False computes the
same OFF + q with shifts and int -> float converts (the interpreter's path, and a GPU baseline).
Reference: `wna16_gemm.wna16_linear_ref`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels.gemv import split_k_plan, store_split_k_output

__all__ = ["TCConfig", "tc_config", "tc_supported", "wna16_tc_linear"]

KERNEL_MAX_M = 8192  # rows one launch takes (each M block re-reads the words, mostly from L2)
_WS_FLOATS = 1 << 23  # 32 MB of fp32 split-K partials per device, allocated once
_WS_COUNTERS = 1 << 15
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
# Magic exponent bits (two copies, one per 16-bit half) and the offset they add, per activation dtype.
_MAGIC = {torch.bfloat16: (0x43004300, 128.0), torch.float16: (0x64006400, 1024.0)}

# Two words a = $8, b = $9 (k rows r, r + 1 of one column: the pair one tensor-core register holds),
# magic = $10; output $i = nibble i of (a, b) as two 16-bit floats (OFF + q): PRMT gathers a's and b's
# low (then high) halves into one register, so each LOP3 makes a finished pair.
_UNPACK_ASM = tl.constexpr("""
{
.reg .b32 p<2>, s<6>;
prmt.b32 p0, $8, $9, 0x5410;
prmt.b32 p1, $8, $9, 0x7632;
shr.u32 s0, p0, 4;
shr.u32 s1, p0, 8;
shr.u32 s2, p0, 12;
shr.u32 s3, p1, 4;
shr.u32 s4, p1, 8;
shr.u32 s5, p1, 12;
lop3.b32 $0, p0, 0x000F000F, $10, 0xEA;
lop3.b32 $1, s0, 0x000F000F, $10, 0xEA;
lop3.b32 $2, s1, 0x000F000F, $10, 0xEA;
lop3.b32 $3, s2, 0x000F000F, $10, 0xEA;
lop3.b32 $4, p1, 0x000F000F, $10, 0xEA;
lop3.b32 $5, s3, 0x000F000F, $10, 0xEA;
lop3.b32 $6, s4, 0x000F000F, $10, 0xEA;
lop3.b32 $7, s5, 0x000F000F, $10, 0xEA;
}
""")





def _scale_asm(dt: str, one: int) -> str:
    """_UNPACK_ASM, then each register (OFF + q_a, OFF + q_b) -> ((q_a - z) * s, (q_b - z) * s) by two
    packed FMAs: + $12 (-(OFF + z), exact) then * $13 (s), one rounding, as a dequantized weight."""
    body = _UNPACK_ASM.value.strip()[1:-1].replace(".reg .b32 p<2>, s<6>;", ".reg .b32 p<2>, s<6>, one, zero;")
    body = body.replace("prmt.b32 p0,", f"mov.b32 one, {one:#x};\nmov.b32 zero, 0;\nprmt.b32 p0,", 1)
    fmas = "".join(f"fma.rn.{dt} ${i}, ${i}, one, $12;\nfma.rn.{dt} ${i}, ${i}, $13, zero;\n" for i in range(8))
    return "{" + body + fmas + "}"


_SCALE_ASM_BF16 = tl.constexpr(_scale_asm("bf16x2", 0x3F803F80))
_SCALE_ASM_F16 = tl.constexpr(_scale_asm("f16x2", 0x3C003C00))


class TCConfig(NamedTuple):
    BLOCK_N: int  # output columns per program
    SPLIT_K: int  # programs per N-block (asked; fewer when K has fewer steps)
    num_warps: int
    num_stages: int
    BLOCK_KW: int = 16  # word rows per step (BLOCK_K = 8 * BLOCK_KW inputs)
    BLOCK_M: int = 0  # rows per program; 0: M padded to a power of two >= 16, at most 64 (128 is allowed)
    X_TILE: bool = False  # x as one (BLOCK_M, BLOCK_K) load split in registers, not 8 strided loads
    PRESCALE: bool = False  # B = (q - z) * s in x's dtype (2 packed FMAs a register), no per-group epilogue


@triton.jit
def _nibbles(words, x_ptr, MAGIC: tl.constexpr, OFF: tl.constexpr, USE_ASM: tl.constexpr):
    """8 tiles OFF + q_i (words' shape, x's dtype), i = nibble index 0..7."""
    DTYPE = x_ptr.dtype.element_ty
    if USE_ASM:
        magic = tl.full(words.shape, MAGIC, tl.int32)
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _UNPACK_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [words, magic],
            dtype=(DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE), is_pure=True, pack=2)
    else:
        v0 = (((words >> 0) & 15).to(tl.float32) + OFF).to(DTYPE)
        v1 = (((words >> 4) & 15).to(tl.float32) + OFF).to(DTYPE)
        v2 = (((words >> 8) & 15).to(tl.float32) + OFF).to(DTYPE)
        v3 = (((words >> 12) & 15).to(tl.float32) + OFF).to(DTYPE)
        v4 = (((words >> 16) & 15).to(tl.float32) + OFF).to(DTYPE)
        v5 = (((words >> 20) & 15).to(tl.float32) + OFF).to(DTYPE)
        v6 = (((words >> 24) & 15).to(tl.float32) + OFF).to(DTYPE)
        v7 = (((words >> 28) & 15).to(tl.float32) + OFF).to(DTYPE)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _weights(words, x_ptr, z, s, MAGIC: tl.constexpr, OFF: tl.constexpr, USE_ASM: tl.constexpr):
    """8 tiles (q_i - z) * s in x's dtype, rounded once as a dequantized weight; z, s fp32, shaped to
    broadcast along the words' output axis ((1, BLOCK_N) here, (BLOCK_N, 1) for wna16_mma's transposed words)."""
    DTYPE = x_ptr.dtype.element_ty
    if USE_ASM:
        magic = tl.full(words.shape, MAGIC, tl.int32)
        nz = tl.broadcast_to((-(z + OFF)).to(DTYPE), words.shape)
        sb = tl.broadcast_to(s.to(DTYPE), words.shape)
        if DTYPE == tl.bfloat16:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                _SCALE_ASM_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [words, magic, nz, sb],
                dtype=(DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE), is_pure=True, pack=2)
        else:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                _SCALE_ASM_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [words, magic, nz, sb],
                dtype=(DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE), is_pure=True, pack=2)
    else:  # s rounded to x's dtype first, as the PTX path sees it
        sd = s.to(DTYPE).to(tl.float32)
        zd = z
        w0 = ((((words >> 0) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w1 = ((((words >> 4) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w2 = ((((words >> 8) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w3 = ((((words >> 12) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w4 = ((((words >> 16) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w5 = ((((words >> 20) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w6 = ((((words >> 24) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w7 = ((((words >> 28) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _cols(perm_ptr, cols, HAS_PERM: tl.constexpr):
    """The x columns of weight rows `cols` (act-order: row k holds input perm[k])."""
    if HAS_PERM:
        return tl.load(perm_ptr + cols)
    return cols


@triton.jit
def _x_tiles(x_rows, perm_ptr, cols, mask_m, HAS_PERM: tl.constexpr):
    """The 8 strided (BLOCK_M, BLOCK_KW) x tiles of a step: tile i holds x columns cols + i."""
    m = mask_m[:, None]
    x0 = tl.load(x_rows + _cols(perm_ptr, cols + 0, HAS_PERM)[None, :], mask=m, other=0.0)
    x1 = tl.load(x_rows + _cols(perm_ptr, cols + 1, HAS_PERM)[None, :], mask=m, other=0.0)
    x2 = tl.load(x_rows + _cols(perm_ptr, cols + 2, HAS_PERM)[None, :], mask=m, other=0.0)
    x3 = tl.load(x_rows + _cols(perm_ptr, cols + 3, HAS_PERM)[None, :], mask=m, other=0.0)
    x4 = tl.load(x_rows + _cols(perm_ptr, cols + 4, HAS_PERM)[None, :], mask=m, other=0.0)
    x5 = tl.load(x_rows + _cols(perm_ptr, cols + 5, HAS_PERM)[None, :], mask=m, other=0.0)
    x6 = tl.load(x_rows + _cols(perm_ptr, cols + 6, HAS_PERM)[None, :], mask=m, other=0.0)
    x7 = tl.load(x_rows + _cols(perm_ptr, cols + 7, HAS_PERM)[None, :], mask=m, other=0.0)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _wna16_tc_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, perm_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, K, stride_xm, stride_om, K_PER_SPLIT, SPLIT_K,
    GROUP_SIZE: tl.constexpr, MAGIC: tl.constexpr, OFF: tl.constexpr, USE_ASM: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_PERM: tl.constexpr, X_TILE: tl.constexpr, PRESCALE: tl.constexpr,
    USE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
):
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    # M blocks vary fastest: the programs sharing an N block's words run together (L2 serves the repeats)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_kw = tl.arange(0, BLOCK_KW)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_ptrs = qw_ptr + ((k_start // 8) + offs_kw)[:, None].to(tl.int64) * N + offs_n[None, :]
    # x column k0 + 8r + i of nibble i, row r of the step's words
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    x_cols = k_start + offs_kw * 8
    # Scales / zero points are loaded one step ahead, by hand: Triton's pipeliner streams only the
    # words (cp.async) here, and a plain load of the step's own scales waits a DRAM round trip every
    # step (in the H200 round the kernel barely sped up when L2 held the words: BENCHMARKS.md). The last step's
    # prefetch reads a clamped, valid group, unused. (Prefetching the 8 strided x tiles as well
    # costs 30 more registers, 3 instead of 4 programs an SM at M = 1.)
    g0 = k_start // GROUP_SIZE
    s_next = tl.load(s_ptr + g0 * N + offs_n, mask=mask_n, other=0.0)
    z_next = tl.load(z_ptr + g0 * N + offs_n, mask=mask_n, other=0)
    for k0 in range(k_start, k_end, BLOCK_K):
        words = tl.load(w_ptrs, mask=mask_n[None, :], other=0, eviction_policy="evict_first")
        s = s_next.to(tl.float32)
        z = z_next.to(tl.float32)
        g_next = tl.minimum(k0 + BLOCK_K, K - 1) // GROUP_SIZE
        s_next = tl.load(s_ptr + g_next * N + offs_n, mask=mask_n, other=0.0)
        z_next = tl.load(z_ptr + g_next * N + offs_n, mask=mask_n, other=0)
        if PRESCALE:
            v0, v1, v2, v3, v4, v5, v6, v7 = _weights(words, x_ptr, z[None, :], s[None, :], MAGIC, OFF, USE_ASM)
        else:
            z = z + OFF
            v0, v1, v2, v3, v4, v5, v6, v7 = _nibbles(words, x_ptr, MAGIC, OFF, USE_ASM)
        if X_TILE:
            # one (BLOCK_M, BLOCK_K) load, then x_i[m, r] = x[m, 8r + i] by three in-register splits:
            # column 8r + 4a + 2b + c is element (r, a, b, c) of the reshape, i = 4a + 2b + c
            xt = tl.load(x_rows + _cols(perm_ptr, k0 + offs_k, HAS_PERM)[None, :], mask=mask_m[:, None], other=0.0)
            xsum = tl.sum(xt.to(tl.float32), axis=1)
            xa0, xa1 = tl.split(tl.reshape(xt, (BLOCK_M, BLOCK_KW, 2, 2, 2)))
            xb0, xb1 = tl.split(xa0)
            xb2, xb3 = tl.split(xa1)
            x0, x4 = tl.split(xb0)
            x2, x6 = tl.split(xb1)
            x1, x5 = tl.split(xb2)
            x3, x7 = tl.split(xb3)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_tiles(x_rows, perm_ptr, x_cols, mask_m, HAS_PERM)
            xsum = tl.sum((x0.to(tl.float32) + x1.to(tl.float32) + x2.to(tl.float32) + x3.to(tl.float32))
                          + (x4.to(tl.float32) + x5.to(tl.float32) + x6.to(tl.float32) + x7.to(tl.float32)), axis=1)
        if PRESCALE:  # the weights are final: accumulate straight into acc
            acc = tl.dot(x0, v0, acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x1, v1, acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x2, v2, acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x3, v3, acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x4, v4, acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x5, v5, acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x6, v6, acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x7, v7, acc, input_precision=DOT_PRECISION)
        else:
            part = tl.dot(x0, v0, input_precision=DOT_PRECISION)
            part = tl.dot(x1, v1, part, input_precision=DOT_PRECISION)
            part = tl.dot(x2, v2, part, input_precision=DOT_PRECISION)
            part = tl.dot(x3, v3, part, input_precision=DOT_PRECISION)
            part = tl.dot(x4, v4, part, input_precision=DOT_PRECISION)
            part = tl.dot(x5, v5, part, input_precision=DOT_PRECISION)
            part = tl.dot(x6, v6, part, input_precision=DOT_PRECISION)
            part = tl.dot(x7, v7, part, input_precision=DOT_PRECISION)
            acc += (part - xsum[:, None] * z[None, :]) * s[None, :]
        w_ptrs += BLOCK_KW * N
        x_cols += BLOCK_K
    # one split-K counter per (M block, N block) tile
    store_split_k_output(acc, out_ptr, bias_ptr, ws_ptr, counter_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
                         M, N, pid_k, pid_n * tl.num_programs(0) + pid_m, SPLIT_K, HAS_BIAS, USE_SPLIT, BLOCK_M, BLOCK_N)


def int4_steps_supported(x: torch.Tensor, bits: int, group_size: int, k: int) -> bool:
    """What the LOP3-unpacking tensor-core kernels (this one, wna16_mma) take: int4, 16-bit activations
    (fp32 too in the interpreter), groups (and K) a whole number of 128-input steps."""
    dtype_ok = x.dtype in _MAGIC or (x.dtype == torch.float32 and not x.is_cuda)
    return bits == 4 and dtype_ok and group_size % 128 == 0 and k % 128 == 0


def tc_supported(x: torch.Tensor, bits: int, group_size: int, k: int) -> bool:
    """`int4_steps_supported`, and at most KERNEL_MAX_M rows."""
    return int4_steps_supported(x, bits, group_size, k) and x.shape[0] <= KERNEL_MAX_M


def magic_offset(dtype: torch.dtype, use_asm: bool, who: str) -> tuple[int, float]:
    """(MAGIC, OFF) of the LOP3 unpack for activations of `dtype`; fp32 only without the PTX (the
    interpreter's path: OFF + q is exact in fp32 too). Other dtypes: a ValueError naming `who`."""
    if dtype in _MAGIC:
        return _MAGIC[dtype]
    if dtype == torch.float32 and not use_asm:
        return 0, 128.0
    raise ValueError(f"{who}: activations must be bfloat16 or float16, got {dtype}")


def tc_config(m: int, n: int, k: int) -> TCConfig:
    """Launch configuration, rules fitted to the H200 sweep (scripts/gpu_wna16_sweep.py, BENCHMARKS.md):

    M <= 16   128 columns a program; split K while the programs stay <= 512, each split keeps >= 4
              steps and the split-K partials (written and read, 8 bytes an output a split) stay under
              1/8 of the weight bytes (at M = 16 they are what extra splits cost); 8 warps for short
              splits (<= 4 steps) and for M > 1, x as one tile for M > 1 (the 8 strided x loads of 16
              real rows are uncoalesced). Down 14336 -> 4096 at M = 1: 32 blocks x 16 splits, 4 warps.
    M <= 64   64 x 64 tiles, prescaled weights, split 4 (2 from 200 column blocks).
    larger    128 x 128 tiles on 8 warps (wgmma), prescaled, K split to >= 132 programs.
    """
    steps = k // 128
    if m <= 16:
        n_blocks = triton.cdiv(n, 128)
        split = 1
        while (n_blocks * split * 2 <= 512 and steps // (split * 2) >= 4
               and split * 2 * m * n * 8 <= n * k // 16):
            split *= 2
        warps = 8 if (m > 1 or steps // split <= 4) else 4
        return TCConfig(128, split, warps, 3, X_TILE=m > 1)
    if m <= 64:
        split = min(4 if triton.cdiv(n, 64) < 200 else 2, max(1, steps // 4))
        return TCConfig(64, split, 4, 3, X_TILE=True, PRESCALE=True)
    tiles = triton.cdiv(n, 128) * triton.cdiv(m, 128)
    split = 1
    while tiles * split < 132 and split * 4 <= steps:
        split *= 2
    return TCConfig(128, split, 8, 3, BLOCK_M=128, X_TILE=True, PRESCALE=True)


def wna16_tc_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                    config: TCConfig | None = None, use_asm: bool | None = None) -> torch.Tensor:
    """x (M <= KERNEL_MAX_M, K) -> (M, N), int4 weights in the layout above. perm (K,) int32 / int64
    (act-order): weight row k holds input perm[k]; the kernel reads x through it (no gather launch)."""
    m, k = x.shape
    n = qweight.shape[1]
    if not 1 <= m <= KERNEL_MAX_M:
        raise ValueError(f"wna16_tc_linear takes 1..{KERNEL_MAX_M} rows, got {m}")
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"x has {k} inputs, the packed weight {qweight.shape[0] * 8}")
    cfg = config or tc_config(m, n, k)
    block_k = cfg.BLOCK_KW * 8
    if group_size % block_k or k % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide the group size {group_size} and K {k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    interp = not x.is_cuda
    if use_asm is None:
        use_asm = not interp
    magic, off = magic_offset(x.dtype, use_asm, "wna16_tc_linear")
    n_blocks = triton.cdiv(n, cfg.BLOCK_N)
    block_m = cfg.BLOCK_M or min(64, max(16, triton.next_power_of_2(m)))
    m_blocks = triton.cdiv(m, block_m)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, k_per_split, ws = split_k_plan(_workspaces, out, k // block_k, block_k, cfg.SPLIT_K, n_blocks * m_blocks,
                                          _WS_FLOATS, _WS_COUNTERS)
    _wna16_tc_kernel[(m_blocks, n_blocks, split)](
        x, qweight, scales, zeros, bias if bias is not None else out, perm if perm is not None else out,
        out, ws[0], ws[1],
        m, n, k, x.stride(0), out.stride(0), k_per_split, split,
        GROUP_SIZE=group_size, MAGIC=magic, OFF=off, USE_ASM=use_asm, HAS_BIAS=bias is not None,
        HAS_PERM=perm is not None, X_TILE=cfg.X_TILE, PRESCALE=cfg.PRESCALE,
        USE_SPLIT=split > 1, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=cfg.BLOCK_N, BLOCK_KW=cfg.BLOCK_KW,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
