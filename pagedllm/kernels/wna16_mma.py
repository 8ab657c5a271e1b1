"""Int4 weight x 16-bit activation GEMM for decode batches above the tensor-core GEMV's rows and for
prefill chunks: ONE tensor-core dot per 128-input step (wgmma on sm_90), the weight tile dequantized
in registers on its way there.

Layout: kernels/wna16_gemm.py's, untouched (qweight (K // 8, N) int32, nibble i of word row r holds
input 8r + i; scales / zeros (K // G, N)).

Why a third int4 kernel. From ~64 rows on the other two lose to dequantize + cuBLAS, which itself
writes and re-reads the whole weight in bf16 every call (H200, Llama-3.1-8B gate_up at M = 256: 170 us
against bf16 cuBLAS's 93, BENCHMARKS.md issue 19):
  - wna16_tc.py feeds each unpacked nibble plane to its own K = 16 dot (8 dots a step), which suits
    M <= 64 (no reshape, the planes go straight into mma operands) but on sm_90 makes 8 small
    warpgroup MMAs, each with its operand store and fence, per step;
  - wna16_gemm.py's tile kernel unpacks to fp32 (then one convert per value) and rescales every
    step's partial sum in an epilogue, so its accumulator chain breaks each step.
Here a step is:

    words (BLOCK_KW, BLOCK_N) int32 ──LOP3 + 2 HFMA2 a register──> 8 tiles w_i = (q_i - z) * s, bf16
    ──join x3, permute, reshape──> W (BLOCK_K, BLOCK_N), row 8r + i = w_i[r]   (natural input order)
    acc (BLOCK_M, BLOCK_N) fp32 = tl.dot(x[:, k0:k0 + BLOCK_K], W, acc)

The dequantization is wna16_tc's PRESCALE arithmetic: OFF + q by one LOP3 with a magic exponent, then
+ -(OFF + z) (exact) and * s (the one rounding, as a dequantized bf16 weight), two packed FMAs for two
values. The join order is unpack_tile's (wna16_unpack.py): join(join(join(w0, w4), join(w2, w6)),
join(join(w1, w5), join(w3, w7))) holds w_(4a + 2b + c) at [r, n, a, b, c]; moving n last and
flattening makes row r * 8 + 4a + 2b + c. On sm_90 (Triton 3.6-3.9) the reshape is free (a linear
layout) and the tile goes to shared memory once, as the wgmma operand. Worked example, BLOCK_KW = 16: 16 word rows -> the 128 x BLOCK_N tile
of inputs k0 .. k0 + 127, one group's scale and zero point (BLOCK_K divides the group size).

Program (pid, pk): pid -> (M block, N block) with M blocks fastest (the programs that read the same
words run together, so the repeats come from L2), K range [pk * K_PER_SPLIT, +K_PER_SPLIT); split-K
partials summed by the last program of a tile (kernels/gemv.py `store_split_k_output`: one launch,
deterministic, CUDA-graph safe). Scales and zero points are loaded one step ahead (the tc kernel's
reason: a plain load of the step's own scales waits a DRAM round trip every step).

USE_ASM: inline PTX (the interpreter cannot run it); USE_ASM=False computes the same values with
shifts and converts (the interpreter's path). Reference: `wna16_gemm.wna16_linear_ref`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.envs import environment_variables
from pagedllm.kernels.gemv import split_k_workspace, store_split_k_output
from pagedllm.kernels.wna16_tc import _MAGIC, _SCALE_ASM_BF16, _SCALE_ASM_F16, _weights

__all__ = ["TABLE", "MMAConfig", "mma_choice", "mma_config", "mma_supported", "wna16_mma_linear"]

_WS_FLOATS = 1 << 23  # 32 MB of fp32 split-K partials per device, allocated once
_WS_COUNTERS = 1 << 15
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


class MMAConfig(NamedTuple):
    BLOCK_M: int  # rows of x per program (>= 16: the tensor-core tile)
    BLOCK_N: int  # output columns per program
    SPLIT_K: int  # programs sharing a tile's K (asked; fewer when K has fewer steps)
    num_warps: int
    num_stages: int
    BLOCK_KW: int = 16  # word rows a step: BLOCK_K = 8 * BLOCK_KW inputs (must divide the group size)
    SWAP: bool = False  # out^T = W^T x^T: the dequantized weights as the dot's first operand


@triton.jit
def _join_rows(w0, w1, w2, w3, w4, w5, w6, w7, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """8 (BLOCK_KW, BLOCK_N) tiles, tile i = input 8r + i of row r -> one (BLOCK_K, BLOCK_N) tile."""
    t = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
    return tl.reshape(tl.permute(t, (0, 2, 3, 4, 1)), (BLOCK_K, BLOCK_N))


@triton.jit
def _weights_t(words_t, x_ptr, z, s, MAGIC: tl.constexpr, OFF: tl.constexpr, USE_ASM: tl.constexpr):
    """`_weights` of transposed words (BLOCK_N, BLOCK_KW): z, s (BLOCK_N,) broadcast along each row."""
    DTYPE = x_ptr.dtype.element_ty
    if USE_ASM:
        magic = tl.full(words_t.shape, MAGIC, tl.int32)
        nz = tl.broadcast_to((-(z + OFF)).to(DTYPE)[:, None], words_t.shape)
        sb = tl.broadcast_to(s.to(DTYPE)[:, None], words_t.shape)
        if DTYPE == tl.bfloat16:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                _SCALE_ASM_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [words_t, magic, nz, sb],
                dtype=(DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE), is_pure=True, pack=2)
        else:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                _SCALE_ASM_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [words_t, magic, nz, sb],
                dtype=(DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE), is_pure=True, pack=2)
    else:
        sd = s.to(DTYPE).to(tl.float32)[:, None]
        zd = z[:, None]
        w0 = ((((words_t >> 0) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w1 = ((((words_t >> 4) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w2 = ((((words_t >> 8) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w3 = ((((words_t >> 12) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w4 = ((((words_t >> 16) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w5 = ((((words_t >> 20) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w6 = ((((words_t >> 24) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
        w7 = ((((words_t >> 28) & 15).to(tl.float32) - zd) * sd).to(DTYPE)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _wna16_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, K, stride_xm, stride_om, K_PER_SPLIT, SPLIT_K,
    GROUP_SIZE: tl.constexpr, MAGIC: tl.constexpr, OFF: tl.constexpr, USE_ASM: tl.constexpr,
    HAS_BIAS: tl.constexpr, USE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SWAP: tl.constexpr,
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
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
        if SWAP:
            wt = tl.trans(words)  # (BLOCK_N, BLOCK_KW)
            w0, w1, w2, w3, w4, w5, w6, w7 = _weights_t(wt, x_ptr, z, s, MAGIC, OFF, USE_ASM)
            # [n, r, a, b, c] = w_(4a + 2b + c)[n, r]: column r * 8 + i after the reshape
            t = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
            acc = tl.dot(tl.reshape(t, (BLOCK_N, BLOCK_K)), tl.trans(x), acc, input_precision=DOT_PRECISION)
        else:
            w0, w1, w2, w3, w4, w5, w6, w7 = _weights(words, x_ptr, z, s, MAGIC, OFF, USE_ASM)
            w = _join_rows(w0, w1, w2, w3, w4, w5, w6, w7, BLOCK_K, BLOCK_N)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_KW * N
        x_ptrs += BLOCK_K
    if SWAP:
        acc = tl.trans(acc)
    store_split_k_output(acc, out_ptr, bias_ptr, ws_ptr, counter_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
                         M, N, pid_k, pid, SPLIT_K, HAS_BIAS, USE_SPLIT, BLOCK_M, BLOCK_N)


def mma_supported(x: torch.Tensor, bits: int, group_size: int, k: int) -> bool:
    """Int4, 16-bit activations (fp32 too in the interpreter), groups and K whole 128-input steps."""
    dtype_ok = x.dtype in _MAGIC or (x.dtype == torch.float32 and not x.is_cuda)
    return bits == 4 and dtype_ok and group_size % 128 == 0 and k % 128 == 0


def mma_config(m: int, n: int, k: int) -> MMAConfig:
    """Launch configuration by rows, for shapes the table below does not hold: 16 / 32 / 64-row tiles
    up to that many rows, 128 above; 128 columns; K split while the tiles are fewer than the H200's
    132 SMs and each split keeps >= 8 steps. Example: (200, 4096, 4096) -> 2 x 32 tiles, split 2."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = k // 128
    split = 1
    while tiles * split < 132 and steps // (split * 2) >= 8:
        split *= 2
    return MMAConfig(block_m, block_n, split, 8 if block_m == 128 else 4, 3)


# Rows this kernel takes by the rule above (shapes the table does not hold): fewer go to the tensor-core
# GEMV (wna16_tc.py), more to the dequantized scratch + cuBLAS, whose GEMM then dwarfs the dequantization.
RULE_MIN_M = 17
RULE_MAX_M = 1024
Bucket = tuple[int, "MMAConfig | None"]
# (N, K) -> ((max rows, config or None = the path before this kernel), ...) in increasing max rows; rows
# past the last bucket take the path before. Filled from the H200 sweep (scripts/gpu_wna16_mma.py).
TABLE: dict[tuple[int, int], tuple[Bucket, ...]] = {}


def _read_table(path: str) -> dict[tuple[int, int], tuple[Bucket, ...]]:
    """PAGEDLLM_WNA16_MMA_TABLE's JSON ({"N,K": [[max_rows, [BLOCK_M, BLOCK_N, SPLIT_K, num_warps,
    num_stages(, SWAP 0 / 1)] or null], ...]}) as TABLE's form; a malformed file is an error naming it."""
    import json

    try:
        raw = json.load(open(path))
        table = {}
        for key, buckets in raw.items():
            n, k = (int(v) for v in key.split(","))
            table[(n, k)] = tuple((int(mx), None if c is None else MMAConfig(*(int(v) for v in c[:5]), 16, *(bool(v) for v in c[5:])))
                                  for mx, c in sorted(buckets, key=lambda b: b[0]))
        return table
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"PAGEDLLM_WNA16_MMA_TABLE={path}: not a table of wna16_mma configs ({e})") from None


_TABLE_FILE = environment_variables["PAGEDLLM_WNA16_MMA_TABLE"]()
if _TABLE_FILE:
    TABLE = _read_table(_TABLE_FILE)


def mma_choice(m: int, n: int, k: int) -> MMAConfig | None:
    """This kernel's configuration for an (m, N, K) call, or None where the path before it is faster.
    Example (rule): (8, 4096, 4096) -> None (the tensor-core GEMV); (256, 4096, 14336) -> mma_config."""
    buckets = TABLE.get((n, k))
    if buckets is None:
        return mma_config(m, n, k) if RULE_MIN_M <= m <= RULE_MAX_M else None
    for max_m, cfg in buckets:
        if m <= max_m:
            return cfg
    return None


def wna16_mma_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                     config: MMAConfig | None = None, use_asm: bool | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N) in x's dtype, int4 weights in the layout above; perm (K,) (act-order):
    weight row k holds input perm[k], so x is gathered once by it."""
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"x has {k} inputs, the packed weight {qweight.shape[0] * 8}")
    cfg = config or mma_config(m, n, k)
    block_k = cfg.BLOCK_KW * 8
    if group_size % block_k or k % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide the group size {group_size} and K {k}")
    if perm is not None:
        x = x.index_select(1, perm)
    if x.stride(1) != 1:
        x = x.contiguous()
    if use_asm is None:
        use_asm = x.is_cuda
    if x.dtype in _MAGIC:
        magic, off = _MAGIC[x.dtype]
    elif x.dtype == torch.float32 and not use_asm:
        magic, off = 0, 128.0  # the interpreter's fp32 path: OFF + q is exact in fp32 too
    else:
        raise ValueError(f"wna16_mma_linear: activations must be bfloat16 or float16, got {x.dtype}")
    steps = k // block_k
    k_per_split = triton.cdiv(steps, max(1, cfg.SPLIT_K)) * block_k
    split = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = split_k_workspace(_workspaces, x.device, _WS_FLOATS, _WS_COUNTERS) if split > 1 else None
    if ws is None or split * m * n > _WS_FLOATS or tiles > _WS_COUNTERS:
        split, k_per_split = 1, k
        ws = (out, out)  # never read: the split-K branch is compiled out
    _wna16_mma_kernel[(tiles, split)](
        x, qweight, scales, zeros, bias if bias is not None else out, out, ws[0], ws[1],
        m, n, k, x.stride(0), out.stride(0), k_per_split, split,
        GROUP_SIZE=group_size, MAGIC=magic, OFF=off, USE_ASM=use_asm, HAS_BIAS=bias is not None,
        USE_SPLIT=split > 1, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_KW=cfg.BLOCK_KW, SWAP=cfg.SWAP,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
