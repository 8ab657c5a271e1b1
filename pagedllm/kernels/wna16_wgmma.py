"""Int4 weight x 16-bit activation GEMM for sm_90 (H100 / H200), written in Gluon so that the
dequantized weights are born in the tensor cores' register layout: no layout conversion a step.

Same packed layout as kernels/wna16_gemm.py (qweight (K // 8, N) int32, nibble i of word row r holds
input 8r + i; scales (K // G, N) in x's dtype, zeros (K // G, N) uint8), so nothing is repacked.

Why a fourth int4 kernel (BENCHMARKS.md issue 19): kernels/wna16_mma.py computes the same transposed
product, out^T = W^T x^T with W^T as wgmma's register operand, but Triton (3.6-3.9) unpacks a word's
8 nibbles into 8 columns of one thread and then converts that tile into wgmma's layout through shared
memory (a store, a block barrier and a load of the whole bf16 tile every step). In wgmma's A layout a
thread holds, for its rows n and n + 8, the inputs k = 16j + 2c + {0, 1, 8, 9} (c = lane % 4), i.e.
the byte c of every word of its rows. So here each thread reads whole words (shared memory, every
word once per lane of its quad: 4 lanes read the same address, no bank conflict) and takes only
its byte, which becomes one register of the A operand:

    words (BLOCK_N, BLOCK_KW) int32, layout: wgmma A's with its k bits 0-2 dropped (broadcast)
      -> broadcast to (BLOCK_N, BLOCK_KW, 8), reshape -> (BLOCK_N, BLOCK_K): exactly wgmma A's layout
      -> per pair of inputs (k, k + 1), k even, from byte c = (k % 8) / 2 of the word w:
         SHF + PRMT  d = (byte c of w, -, byte c of w >> 1, -)               two instructions
         LOP3  d = (d & 0x0078000F) | MAGIC -> (OFF + q_k, OFF + 8 q_k+1)     exact 16-bit floats
         FMA2  d = d * 1 + (-(OFF + z), -(OFF + 8 z))                       exact: (q - z, 8 (q - z))
         FMA2  d = d * (s, s / 8) + 0                                       the one rounding
    acc (BLOCK_N, BLOCK_M) fp32 += wgmma(A, x tile^T from shared memory), kept one in flight

(The odd input's nibble sits at the high half's mantissa bits 3-6, weight 8: bf16 has 7 mantissa bits.)
Worked example, bf16 (MAGIC 0x43004300, OFF 128): byte c = 0xA5 (q_k = 5, q_k+1 = 10), z = 8, s = 0.5:
d = 0x__52__A5 -> 0x43504305 = (128 + 5, 128 + 8 * 10) -> (5 - 8, 8 * (10 - 8)) = (-3, 16) -> (-1.5, 1.0).
OFF + 8 z and 8 (q - z) are exact and s / 8 only moves the exponent, so each weight is (q - z) * s
rounded once, as kernels/wna16_mma.py's (`wgmma_dequant_emulation` does this arithmetic in torch).

Program (pid, pk): pid -> (M block, N block), M blocks fastest; K range [pk * K_PER_SPLIT, + K_PER_SPLIT);
split-K partials summed in split order by the last program of a tile (as kernels/gemv.py's
`store_split_k_output`, rewritten here in Gluon). Words and x tiles come by cp.async into a ring of
STAGES buffers; the step's scales and zero points one step ahead by plain loads.

Status: the unrolled loop below has not run on a GPU yet (its rolled form raced, BENCHMARKS.md), so
kernels/wna16_wgmma_config.py's table is empty and the dispatch does not take this kernel until a GPU
check and sweep (scripts/gpu_wna16_wgmma.py) fill it.

Limits: sm_90 only (wgmma; Gluon has no interpreter, so there is no CPU path: `wgmma_supported`
says when the wrapper may be called); 16-bit x; BLOCK_K (64 or 128) must divide K and the group size;
BLOCK_N a multiple of 16 x num_warps (4 or 8 warps); BLOCK_M 16..256 (wgmma's N). Reference:
`wna16_gemm.wna16_linear_ref`; tests/kernels/test_wna16_wgmma.py holds the layout arithmetic to it on
the CPU and the kernel to it on a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from pagedllm.kernels.device_info import device_index, is_sm90
from pagedllm.kernels.gemv import split_k_plan
from pagedllm.kernels.gluon_split_k import block_barrier, store_transposed_output
from pagedllm.kernels.wna16_wgmma_config import WGMMAConfig

__all__ = ["WGMMAConfig", "a_operand_bases", "wgmma_dequant_emulation", "wgmma_supported", "wna16_wgmma_linear",
           "word_byte_selectors"]

# cp.async of a pointer tensor into shared memory: `async_load` from Triton 3.7 on (3.9 removed the old name)
_cp_async = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
_WS_FLOATS = 1 << 23  # 32 MB of fp32 split-K partials per device, allocated once
_WS_COUNTERS = 1 << 15
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
# per activation dtype: (magic exponent bits of two 16-bit halves, the offset they add, 1.0 in both halves)
_MAGIC = {torch.bfloat16: (0x43004300, 128.0, 0x3F803F80), torch.float16: (0x64006400, 1024.0, 0x3C003C00)}


def _log2(v: int) -> int:
    if v < 1 or v & (v - 1):
        raise ValueError(f"{v} is not a power of two")
    return v.bit_length() - 1


def a_operand_bases(block_n: int, block_k: int, num_warps: int) -> tuple[list, list, list]:
    """The linear layout (register, lane, warp bases over (n, k)) of wgmma's 16-bit register operand
    A (block_n, block_k) with warps stacked along n, as Triton builds it (DotOperandLayout(0, mma,
    k_width=2)): a thread holds rows n0 + {0, 8} and inputs 2c + {0, 1} + 8j, c = lane % 4.
    Example (64, 64, 4): registers [0,1] [8,0] [0,8] [0,16] [0,32]; lanes [0,2] [0,4] [1,0] [2,0] [4,0];
    warps [16,0] [32,0]."""
    regs = [[0, 1], [8, 0], [0, 8]] + [[0, 16 << i] for i in range(_log2(block_k // 16))]
    regs += [[16 * num_warps << i, 0] for i in range(_log2(block_n // (16 * num_warps)))]
    lanes = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    warps = [[16 << i, 0] for i in range(_log2(num_warps))]
    return regs, lanes, warps


def _words3_layout(block_n: int, block_kw: int, num_warps: int) -> gl.DistributedLinearLayout:
    """A's layout over (n, word row, nibble) = (n, k // 8, k % 8): reshaped to (n, k) it is A's."""
    regs, lanes, warps = a_operand_bases(block_n, block_kw * 8, num_warps)

    def split(b):
        return [b[0], b[1] >> 3, b[1] & 7]

    return gl.DistributedLinearLayout(reg_bases=[split(b) for b in regs], lane_bases=[split(b) for b in lanes],
                                      warp_bases=[split(b) for b in warps], block_bases=[],
                                      shape=[block_n, block_kw, 8])


def word_byte_selectors(k: torch.Tensor) -> torch.Tensor:
    """PRMT selectors per input k: byte c = (k % 8) // 2 of the word into byte 0, byte c of the word
    shifted right by one into byte 2 (bytes 1 and 3: byte 0 of the word, masked off after).
    Example: k = 5 -> c = 2 -> 0x0602."""
    c = (k % 8) // 2
    return c * 0x0101 + 0x0400


def _pair_asm(magic: int, one: int, fma: str) -> str:
    """$0 = the pair (k, k + 1) dequantized from word $1 (= $2) by selector $3 (= $4), with $5 (= $6) =
    (-(OFF + z), -(OFF + 8 z)) and $7 (= $8) = (s, s / 8), all packed 16-bit pairs (see the module doc)."""
    return f"""{{
.reg .b32 d, t, one, zero;
mov.b32 one, {one:#x};
mov.b32 zero, 0;
shr.u32 t, $1, 1;
prmt.b32 d, $1, t, $3;
lop3.b32 d, d, 0x0078000F, {magic:#x}, 0xEA;
{fma} d, d, one, $5;
{fma} $0, d, $7, zero;
}}"""


@gluon.jit
def _pack_pair(lo, hi):
    """Two 16-bit float tensors -> one int32 tensor, lo in bits 0-15 (the first element of a pair)."""
    lo_bits = lo.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    hi_bits = hi.to(gl.int16, bitcast=True).to(gl.int32) << 16
    return lo_bits | hi_bits


@gluon.jit
def _issue_copies(w_smem, x_smem, qw_ptr, x_ptr, step, k_start, n_steps, N, stride_xm,
                  offs_wkw, offs_wn, mask_wn, offs_xm, offs_xk, mask_xm,
                  STAGES: gl.constexpr, BLOCK_KW: gl.constexpr):
    """cp.async of step `step`'s words and x tile into ring slot step % STAGES (nothing past the range)."""
    slot = step % STAGES
    live = step < n_steps
    kw0 = k_start // 8 + step * BLOCK_KW
    w_ptrs = qw_ptr + (kw0 + offs_wkw)[:, None].to(gl.int64) * N + offs_wn[None, :]
    _cp_async(w_smem.index(slot), w_ptrs, mask=mask_wn[None, :] & live)
    x_ptrs = x_ptr + offs_xm.to(gl.int64)[:, None] * stride_xm + (k_start + step * BLOCK_KW * 8 + offs_xk)[None, :]
    _cp_async(x_smem.index(slot), x_ptrs, mask=mask_xm[:, None] & live)
    cp.commit_group()


@gluon.jit
def _step(i, acc, s_next, z_next, w_smem, x_smem, qw_ptr, x_ptr, s_ptr, z_ptr, sel, offs_n, mask_n,
          k_start, n_steps, N, K, stride_xm, offs_wkw, offs_wn, mask_wn, offs_xm, offs_xk, mask_xm,
          GROUP_SIZE: gl.constexpr, OFF: gl.constexpr, PAIR_ASM: gl.constexpr, BLOCK_N: gl.constexpr,
          BLOCK_KW: gl.constexpr, STAGES: gl.constexpr, w_l: gl.constexpr, a_lin: gl.constexpr, a_op: gl.constexpr):
    """K step i: its A tile from the words in ring slot i % STAGES, the wgmma on x's tile there (left in
    flight, the one before it waited for), then the copies of step i + STAGES - 1 into the slot that one
    used. Returns (acc, the next step's scales, zero points)."""
    BLOCK_K: gl.constexpr = BLOCK_KW * 8
    DTYPE = x_ptr.dtype.element_ty
    sc = s_next
    zc = z_next
    g_next = gl.minimum(k_start + (i + 1) * BLOCK_K, K - 1) // GROUP_SIZE  # last step: a valid, unused group
    s_next = gl.load(s_ptr + g_next * N + offs_n, mask=mask_n, other=0.0).to(gl.float32)
    z_next = gl.load(z_ptr + g_next * N + offs_n, mask=mask_n, other=0).to(gl.float32)
    nz = _pack_pair((-(zc + OFF)).to(DTYPE), (-(zc * 8.0 + OFF)).to(DTYPE))
    sp = _pack_pair(sc.to(DTYPE), (sc.to(DTYPE).to(gl.float32) * 0.125).to(DTYPE))
    nz = gl.expand_dims(nz, 1).broadcast_to(BLOCK_N, BLOCK_K)
    sp = gl.expand_dims(sp, 1).broadcast_to(BLOCK_N, BLOCK_K)

    cp.wait_group(STAGES - 2)  # this thread's copies of step i have landed
    # x came by cp.async (the generic proxy) and wgmma reads it through the async proxy: each thread
    # fences its own writes, then the block barrier makes every thread's words and x visible
    fence_async_shared()
    block_barrier()
    slot = i % STAGES
    words = w_smem.index(slot).permute((1, 0)).load(w_l)  # (BLOCK_N, BLOCK_KW)
    words = gl.reshape(gl.expand_dims(words, 2).broadcast_to(BLOCK_N, BLOCK_KW, 8), [BLOCK_N, BLOCK_K])
    words = gl.convert_layout(words, a_lin, assert_trivial=True)
    a = gl.inline_asm_elementwise(PAIR_ASM, "=r,r,r,r,r,r,r,r,r", [words, sel, nz, sp],
                                  dtype=DTYPE, is_pure=True, pack=2)
    a = gl.convert_layout(a, a_op, assert_trivial=True)
    acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    # the slot step i - 1 used is free now (its wgmma is done): refill it with step i + STAGES - 1
    _issue_copies(w_smem, x_smem, qw_ptr, x_ptr, i + STAGES - 1, k_start, n_steps, N, stride_xm,
                  offs_wkw, offs_wn, mask_wn, offs_xm, offs_xk, mask_xm, STAGES, BLOCK_KW)
    return acc, s_next, z_next


@gluon.jit
def _wna16_wgmma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, K, stride_xm, stride_om, K_PER_SPLIT, SPLIT_K,
    GROUP_SIZE: gl.constexpr, OFF: gl.constexpr, PAIR_ASM: gl.constexpr,
    HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, STAGES: gl.constexpr,
    WORDS3: gl.constexpr, X_SMEM: gl.constexpr, W_COPY: gl.constexpr, X_COPY: gl.constexpr, OUT_L: gl.constexpr,
):
    BLOCK_K: gl.constexpr = BLOCK_KW * 8
    num_warps: gl.constexpr = gl.num_warps()
    DTYPE = x_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    a_lin: gl.constexpr = gl.to_linear_layout(a_op, [BLOCK_N, BLOCK_K])
    w_l: gl.constexpr = gl.SliceLayout(2, WORDS3)
    rows_l: gl.constexpr = gl.SliceLayout(1, a_lin)

    m_blocks = gl.cdiv(M, BLOCK_M)
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = pid % m_blocks
    pid_n = pid // m_blocks
    k_start = pid_k * K_PER_SPLIT
    n_steps = (gl.minimum(k_start + K_PER_SPLIT, K) - k_start) // BLOCK_K

    # copy-side offsets (coalesced 16-byte cp.async)
    offs_wkw = gl.arange(0, BLOCK_KW, gl.SliceLayout(1, W_COPY))
    offs_wn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, W_COPY))
    mask_wn = offs_wn < N
    offs_xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, X_COPY))
    offs_xk = gl.arange(0, BLOCK_K, gl.SliceLayout(0, X_COPY))
    mask_xm = offs_xm < M

    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_KW, BLOCK_N],
                                       gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    x_smem = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_M, BLOCK_K], X_SMEM)

    # per-thread constants in A's layout: the byte selector of each input, this program's rows
    sel = (gl.arange(0, BLOCK_K, gl.SliceLayout(0, a_lin)) % 8) // 2 * 0x0101 + 0x0400
    sel = gl.expand_dims(sel, 0).broadcast_to(BLOCK_N, BLOCK_K)
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, rows_l)
    mask_n = offs_n < N

    for first in gl.static_range(STAGES - 1):
        _issue_copies(w_smem, x_smem, qw_ptr, x_ptr, first, k_start, n_steps, N, stride_xm,
                      offs_wkw, offs_wn, mask_wn, offs_xm, offs_xk, mask_xm, STAGES, BLOCK_KW)

    g = k_start // GROUP_SIZE
    s_next = gl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(gl.float32)
    z_next = gl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(gl.float32)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    # Two steps a trip: a wgmma reads its A registers until it completes, and the next step's A is made
    # while it runs; unrolled, consecutive steps' A tiles are different registers. Rolled, step i + 1
    # rewrote the registers wgmma i may still be reading (PTX leaves that undefined): wrong sums on the
    # H100 from some launches, none once no wgmma was left in flight (BENCHMARKS.md, issue 19).
    for i in range(0, n_steps - 1, 2):
        acc, s_next, z_next = _step(i, acc, s_next, z_next, w_smem, x_smem, qw_ptr, x_ptr, s_ptr, z_ptr, sel,
                                    offs_n, mask_n, k_start, n_steps, N, K, stride_xm, offs_wkw, offs_wn, mask_wn,
                                    offs_xm, offs_xk, mask_xm, GROUP_SIZE, OFF, PAIR_ASM, BLOCK_N, BLOCK_KW, STAGES,
                                    w_l, a_lin, a_op)
        acc, s_next, z_next = _step(i + 1, acc, s_next, z_next, w_smem, x_smem, qw_ptr, x_ptr, s_ptr, z_ptr, sel,
                                    offs_n, mask_n, k_start, n_steps, N, K, stride_xm, offs_wkw, offs_wn, mask_wn,
                                    offs_xm, offs_xk, mask_xm, GROUP_SIZE, OFF, PAIR_ASM, BLOCK_N, BLOCK_KW, STAGES,
                                    w_l, a_lin, a_op)
    if n_steps % 2 == 1:
        acc, s_next, z_next = _step(n_steps - 1, acc, s_next, z_next, w_smem, x_smem, qw_ptr, x_ptr, s_ptr, z_ptr,
                                    sel, offs_n, mask_n, k_start, n_steps, N, K, stride_xm, offs_wkw, offs_wn,
                                    mask_wn, offs_xm, offs_xk, mask_xm, GROUP_SIZE, OFF, PAIR_ASM, BLOCK_N, BLOCK_KW,
                                    STAGES, w_l, a_lin, a_op)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    cp.wait_group(0)

    # epilogue: out[m, n] = acc[n, m] (+ bias[n]); stores along n, the output's contiguous axis
    res = gl.convert_layout(acc, OUT_L)
    on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, OUT_L))
    om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(0, OUT_L))
    store_transposed_output(res, out_ptr, ws_ptr, counter_ptr, bias_ptr, pid, pid_k, on, om, M, N, stride_om, SPLIT_K,
                            HAS_BIAS, USE_SPLIT)


def _copy_layout(rows: int, cols: int, elem_bytes: int, num_warps: int) -> gl.BlockedLayout:
    """16 bytes a thread along the contiguous axis, lanes then warps down the rows."""
    vec = 16 // elem_bytes
    lanes_c = min(32, max(1, cols // vec))
    return gl.BlockedLayout(size_per_thread=[1, vec], threads_per_warp=[32 // lanes_c, lanes_c],
                            warps_per_cta=[num_warps, 1], order=[1, 0])


def _out_layout(block_n: int, block_m: int, num_warps: int) -> gl.BlockedLayout:
    """(BLOCK_N, BLOCK_M) with n fastest: 8 outputs (16 bytes) a thread along n."""
    lanes_n = min(32, max(1, block_n // 8))
    return gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[lanes_n, 32 // lanes_n],
                            warps_per_cta=[1, num_warps], order=[0, 1])


def wgmma_supported(x: torch.Tensor, k: int, group_size: int, bits: int) -> bool:
    """Whether `wna16_wgmma_linear` may take this call: int4, 16-bit x on an sm_90 GPU, 64-input steps
    dividing K and the group size."""
    if not (bits == 4 and x.is_cuda and x.dtype in _MAGIC and k % 64 == 0 and group_size % 64 == 0):
        return False
    return is_sm90(device_index(x))


def wgmma_dequant_emulation(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                            dtype: torch.dtype) -> torch.Tensor:
    """The kernel's dequantized weights (K, N) in `dtype`, by its own arithmetic in torch (CPU or GPU):
    byte c = (k % 8) // 2 of word k // 8 by the PRMT selector, the LOP3 magic pair, + (-(OFF + z), -(OFF
    + 8 z)), * (s, s / 8), each step rounded to `dtype` as the packed instructions do. Tests hold it to
    `dequantize_wna16`: equal, which is the module doc's exactness claim."""
    magic, off, _ = _MAGIC[dtype]
    kw, n = qweight.shape
    k = torch.arange(kw * 8, device=qweight.device)
    sel = word_byte_selectors(k)[:, None]  # (K, 1)
    words = qweight.to(torch.int64)[k // 8] & 0xFFFFFFFF  # (K, N)
    lo = (words >> (8 * (sel & 0xF))) & 0xFF  # byte 0 <- byte c of the word
    hi = ((words >> 1) >> (8 * ((sel >> 8) & 0x3))) & 0xFF  # byte 2 <- byte c of the word >> 1
    d = lo | (hi << 16)
    d = (d & 0x0078000F) | magic  # LOP3
    half = torch.where((k % 2 == 0)[:, None], d & 0xFFFF, d >> 16).to(torch.int16)  # element k's 16 bits
    v = half.view(dtype).float()  # OFF + q (even k) or OFF + 8 q (odd k), exact
    z = zeros.float()[k // group_size]
    s = scales.to(dtype).float()[k // group_size]
    odd = (k % 2 == 1)[:, None]
    nz = torch.where(odd, -(8 * z + off), -(z + off)).to(dtype).float()
    sc = torch.where(odd, (s * 0.125).to(dtype).float(), s)
    return ((v + nz).to(dtype).float() * sc).to(dtype)


@functools.cache
def _launch_constants(cfg: WGMMAConfig, dtype: torch.dtype) -> dict:
    """The kernel's constexprs that follow from the launch and x's dtype alone (layouts, the pair's PTX),
    built once each: the wrapper runs on every eager call."""
    magic, off, one = _MAGIC[dtype]
    block_k = cfg.BLOCK_KW * 8
    return dict(
        OFF=off, PAIR_ASM=_pair_asm(magic, one, "fma.rn.bf16x2" if dtype == torch.bfloat16 else "fma.rn.f16x2"),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_KW=cfg.BLOCK_KW, STAGES=cfg.STAGES,
        WORDS3=_words3_layout(cfg.BLOCK_N, cfg.BLOCK_KW, cfg.num_warps),
        X_SMEM=gl.NVMMASharedLayout.get_default_for(
            [cfg.BLOCK_M, block_k], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16),
        W_COPY=_copy_layout(cfg.BLOCK_KW, cfg.BLOCK_N, 4, cfg.num_warps),
        X_COPY=_copy_layout(cfg.BLOCK_M, block_k, 2, cfg.num_warps),
        OUT_L=_out_layout(cfg.BLOCK_N, cfg.BLOCK_M, cfg.num_warps),
    )


def wna16_wgmma_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group_size: int, config: WGMMAConfig, bias: torch.Tensor | None = None,
                       perm: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N) in x's dtype, int4 weights in the layout above; perm (K,) (act-order): weight
    row k holds input perm[k], so x is gathered once by it."""
    m, k = x.shape
    n = qweight.shape[1]
    cfg = config
    block_k = cfg.BLOCK_KW * 8
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"x has {k} inputs, the packed weight {qweight.shape[0] * 8}")
    if x.dtype not in _MAGIC:
        raise ValueError(f"wna16_wgmma_linear: activations must be bfloat16 or float16, got {x.dtype}")
    if group_size % block_k or k % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide the group size {group_size} and K {k}")
    if cfg.BLOCK_N % (16 * cfg.num_warps) or cfg.num_warps not in (4, 8) or cfg.STAGES < 2:
        raise ValueError(f"{cfg}: BLOCK_N must be a multiple of 16 x num_warps (4 or 8), STAGES >= 2")
    if perm is not None:
        x = x.index_select(1, perm)
    if x.stride(1) != 1:
        x = x.contiguous()
    tiles = triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, k_per_split, ws = split_k_plan(_workspaces, out, k // block_k, block_k, cfg.SPLIT_K, tiles, _WS_FLOATS,
                                          _WS_COUNTERS)
    _wna16_wgmma_kernel[(tiles, split)](
        x, qweight, scales, zeros, bias if bias is not None else out, out, ws[0], ws[1],
        m, n, k, x.stride(0), out.stride(0), k_per_split, split,
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, USE_SPLIT=split > 1,
        **_launch_constants(cfg, x.dtype), num_warps=cfg.num_warps,
    )
    return out
