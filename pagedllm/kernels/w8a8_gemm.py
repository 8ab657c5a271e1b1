"""The W8A8 tile GEMM for sm_90: int8 x int8 -> int32 (or fp8 x fp8 -> fp32) on tensor cores, scales fused.

    out (M, N) = (xq (M, K) @ wq (N, K)^T) * x_scale (M, 1) * w_scale[None, :] (+ bias)   in out_dtype

Why a Triton kernel: on the H200 cuBLAS's int8 GEMM (`torch._int_mm`) is slower than its bf16 GEMM from
M = 256 up (BENCHMARKS.md, issue 19: gate_up M = 2048 721 us against bf16 619 and FP8 374), although
Hopper's int8 tensor cores run at twice the bf16 rate, and it returns int32 that a second kernel
scales. Triton's int8 `tl.dot` lowers to wgmma on sm_90; here the scales and the bias are applied to
the accumulator in registers and only the bf16 product is written.

Weight layout: none repacked. wq stays (N, K) row-major (nn.Linear's), which is "K-major" for the B
operand: each (BLOCK_N, BLOCK_K) tile is BLOCK_N rows of BLOCK_K contiguous bytes (16-byte vector
loads, coalesced), and 8-bit wgmma takes B only K-major, so `tl.dot(a, tl.trans(b))` feeds it
without a shuffle. xq (M, K) row-major is K-major for A likewise.

TMA variant (W8A8Config.TMA): the same kernel with its A / B tiles fetched by the Hopper TMA unit
through host-built tensor descriptors (zero fill past the edges, no masks, no address math in the
loop); the sweep decides per M bucket whether it pays.

Program order: a 1-d grid walked in GROUP_M-tall column groups (kernels/tile_order.py, Triton's matmul
tutorial), so the programs running at once share weight tiles in L2 instead of each streaming its own column.

Configs per M bucket and grid size (`w8a8_gemm_config`, from the H200 sweep of
scripts/gpu_w8a8_sweep.py): 16-row tiles for M <= 16, 64-row for M <= 64, (128, 256, 128) TMA tiles
above wherever they fill the SMs.

Reference: `scaled_mm.scaled_mm_ref` (checked under TRITON_INTERPRET=1 in tests/kernels/test_w8a8_gemm.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels.tile_order import grouped_tile

try:  # host-side TMA descriptors (Triton >= 3.3); without them only the pointer kernel runs
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

from pagedllm.kernels.gemv import split_k_workspace, store_split_k_output

__all__ = ["W8A8Config", "ensure_workspace", "w8a8_gemm", "w8a8_gemm_config"]


class W8A8Config(NamedTuple):
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int  # rows of programs per column group (L2 reuse of the weight tiles)
    num_warps: int
    num_stages: int
    TMA: bool = False  # operand tiles by the TMA copy engine (`_w8a8_gemm_tma_kernel`)
    SPLIT_K: int = 1  # K cut into this many slices, one program each, summed by `_split_k_sum_kernel`
    # split-K summed in the same launch: the last of a tile's SPLIT_K programs to arrive (a self-resetting
    # counter per tile) adds the slices' partials, in slice order, and writes the output (no second kernel)
    SERIAL: bool = False


@triton.jit
def _w8a8_gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, K, stride_am, stride_bn, stride_om,
    HAS_BIAS: tl.constexpr, IS_INT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr = False, SERIAL: tl.constexpr = False,
):
    # SPLIT: K cut into SPLIT_K = the grid's second axis slices (a runtime count: one compiled kernel for
    # every split); program (pid, s) sums K slice s (whole BLOCK_K steps; the last slice ragged) and
    # writes its scaled fp32 partial to ws_ptr = the (SPLIT_K, M, N) workspace (contiguous). Then either
    # `_split_k_sum_kernel` adds the slices and the bias (SERIAL False), or (SERIAL) the tile's last
    # program to arrive does, here: counter_ptr holds one arrival count per tile (pid), reset to 0 by
    # that program, so the counters stay zero between calls and no memset is launched (as kernels/gemv.py).
    pid = tl.program_id(0)
    # Grouped order: program pid -> (pm, pn) walking GROUP_M row-blocks down one column, then the next.
    pm, pn = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Edge rows / columns read row 0 instead of being masked (their results are never stored), so
    # the loop's loads carry no masks unless K itself is ragged.
    rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_b = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    k_begin, k_end = _k_range(K, BLOCK_K, SPLIT)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + (k_begin + offs_k)[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + (k_begin + offs_k)[None, :]  # (BLOCK_N, BLOCK_K), K contiguous
    if IS_INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_mask = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[None, :], other=0.0)
        if IS_INT:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.float32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    _epilogue(acc, pid, as_ptr, bs_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr, offs_m, offs_n, M, N, stride_om,
              HAS_BIAS, SPLIT, SERIAL, BLOCK_M, BLOCK_N)


@triton.jit
def _k_range(K, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """[k_begin, k_end) of this program's K slice: whole BLOCK_K steps, cdiv(steps, SPLIT_K) a slice (the
    grid's second axis), the last ragged, trailing ones empty; all of K unsplit."""
    if SPLIT:
        steps = tl.cdiv(tl.cdiv(K, BLOCK_K), tl.num_programs(1))
        k_begin = tl.program_id(1) * steps * BLOCK_K
        k_end = tl.minimum(K, k_begin + steps * BLOCK_K)
    else:
        k_begin = K * 0
        k_end = K
    return k_begin, k_end


@triton.jit
def _epilogue(acc, pid, as_ptr, bs_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr, offs_m, offs_n, M, N, stride_om,
              HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scale the (BLOCK_M, BLOCK_N) accumulator of tile `pid` by x_scale (rows) and w_scale (columns);
    unsplit: + bias, store. SPLIT: the fp32 partial of slice program_id(1) goes to the (SPLIT_K, M, N)
    workspace, for `_split_k_sum_kernel`, or (SERIAL) for the tile's last program to arrive, which sums
    the slices in slice order (gemv.store_split_k_output: the same bits whoever arrives last)."""
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_s = tl.load(as_ptr + offs_m, mask=m_mask, other=0.0)
    b_s = tl.load(bs_ptr + offs_n, mask=n_mask, other=0.0)
    out = acc.to(tl.float32) * a_s[:, None] * b_s[None, :]
    if SPLIT and not SERIAL:
        ws_ptrs = ws_ptr + (tl.program_id(1) * M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptrs, out, mask=m_mask[:, None] & n_mask[None, :])
    else:
        store_split_k_output(out, out_ptr, bias_ptr, ws_ptr, counter_ptr, offs_m, offs_n, m_mask, n_mask, stride_om,
                             M, N, tl.program_id(1), pid, tl.num_programs(1), HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N)


@triton.jit
def _split_k_sum_kernel(ws_ptr, bias_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    # out[m, n] = sum_s ws[s, m, n] (+ bias[n]): one program per (row, BLOCK_N columns); ws is (SPLIT_K, M, N)
    # fp32, contiguous.
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + (s * M + m) * N + offs_n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w8a8_gemm_tma_kernel(
    a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr, M, N, K, stride_om,
    HAS_BIAS: tl.constexpr, IS_INT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr = False, SERIAL: tl.constexpr = False,
):
    """`_w8a8_gemm_kernel` with the operand tiles fetched by the Hopper TMA unit (host-built tensor
    descriptors; out-of-range rows, columns and K are zero-filled by the copy engine, so no masks and
    no address arithmetic in the loop); SPLIT / SERIAL as there."""
    pid = tl.program_id(0)
    pm, pn = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    k_begin, k_end = _k_range(K, BLOCK_K, SPLIT)
    if IS_INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        a = a_desc.load([pm * BLOCK_M, k0])
        b = b_desc.load([pn * BLOCK_N, k0])  # (BLOCK_N, BLOCK_K): K-major, as 8-bit wgmma takes B
        if IS_INT:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.float32)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    _epilogue(acc, pid, as_ptr, bs_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr, offs_m, offs_n, M, N, stride_om,
              HAS_BIAS, SPLIT, SERIAL, BLOCK_M, BLOCK_N)


# The one-launch split-K's scratch, per device (made once, outside any capture: `ensure_workspace`):
# fp32 partials (SPLIT_K, M, N), 32 MB (M = 256, N = 6144 in 4 slices: 25 MB), and one arrival counter a tile.
_WS_FLOATS = 1 << 23
_WS_COUNTERS = 1 << 14
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def ensure_workspace(device: torch.device) -> None:
    """Make the device's one-launch split-K scratch now (a W8A8 layer calls it after loading), so that a
    first split-K GEMM inside a CUDA-graph capture finds it."""
    split_k_workspace(_workspaces, device, _WS_FLOATS, _WS_COUNTERS)


_SMS = 132  # an H200's SMs: a tile that gives fewer programs than this leaves SMs idle


def w8a8_gemm_config(m: int, n: int, k: int, split_k: bool = False) -> W8A8Config:
    """The launch configuration (int8 and fp8 alike: both are 1-byte operands), from the H200 sweep
    of scripts/gpu_w8a8_sweep.py (2026-12-01, Llama-3.1-8B linears, CUDA graphs; BENCHMARKS.md):

        M <= 16        (16, 128, 128), 4 warps, 4 stages      gate_up M = 16: 34.5 us int8 / 35.6 fp8
        16 < M <= 64   (64, 128, 128), 4 warps, 4 stages      gate_up M = 64: 36.3 / 36.1
        M > 64         (128, 256, 128), 8 warps, 4 stages, TMA gate_up M = 256 / 2048 / 8192 int8:
                                                              62.6 / 407.9 / 1614 (bf16 92 / 621 / 2767)
    each the largest tile whose grid still fills the SMs; otherwise the next smaller one:
    (64, 128, 128) TMA, then (64, 64, 256) (e.g. M = 256 on o / down: 256 programs, not 32), or at
    M <= 16 (16, 64, 256).

    split_k (M > 16): where even that tile leaves SMs idle (N = 4096 / 6144 linears at M <= 256), the
    (64, 128, 128) TMA tile with K cut into 2-8 slices (each >= 4 BLOCK_K steps) so programs x slices fill
    the SMs, summed in the same launch (SERIAL). The dispatch uses `decode_config`'s measured table for
    the shapes it has; this rule is the sweep's generic candidate (scripts/gpu_fp8_w1_probe.py).
    """
    def programs(bm: int, bn: int) -> int:
        return triton.cdiv(m, bm) * triton.cdiv(n, bn)

    if m <= 16:
        cfg = W8A8Config(16, 128, 128, 8, 4, 4) if programs(16, 128) >= _SMS else W8A8Config(16, 64, 256, 8, 4, 4)
    elif m <= 64 or programs(64, 128) < _SMS:
        cfg = W8A8Config(64, 128, 128, 8, 4, 4) if programs(64, 128) >= _SMS else W8A8Config(64, 64, 256, 8, 4, 4)
    elif programs(128, 256) >= _SMS:
        cfg = W8A8Config(128, 256, 128, 8, 8, 4, True)
    else:
        cfg = W8A8Config(64, 128, 128, 8, 4, 4, True)
    if split_k and m > 16 and programs(cfg.BLOCK_M, cfg.BLOCK_N) < _SMS:
        tiles = programs(64, 128)
        split = 1
        while split < 8 and tiles * split < _SMS and k // (2 * split) >= 4 * 128:
            split *= 2
        if split > 1:
            cfg = W8A8Config(64, 128, 128, 8, 4, 4, True, split, True)
    return _fit_k(cfg, k)


# FP8 decode GEMMs of the Llama-3.1-8B linears, 17-256 rows: per (N, K), (largest M of the bucket, the config
# or None = cuBLAS's row-wise _scaled_mm), each the fastest of cuBLAS and 26 Triton tile / split variants at
# the bucket's measured row count (M = 32, 64, 128, 192, 256; H200, CUDA-graph replays rotating over >= 160
# MB of weight copies, activations already quantized; BENCHMARKS.md, issue 19, h51 round 1). Microseconds,
# the pick against cuBLAS:
#   qkv  6144 x 4096    13.0 / 14.1, 10.5 / 14.0, 12.9 / 14.0, cuBLAS 14.6, cuBLAS 14.6
#   o    4096 x 4096    11.0 / 13.6,  9.1 / 13.7,  9.2 / 13.8, 12.2 / 14.2, 12.6 / 13.9
#   down 4096 x 14336   22.0 / 36.5, 23.3 / 36.6, 24.5 / 37.1, 32.1 / 37.8, 33.3 / 37.6
#   gate_up 28672 x 4096  32.7 / 36.3, 33.2 / 37.8, then cuBLAS (34.8, 48.7, 50.6)
# A layer's four: 78.7 / 100.5 us at M = 32 (the dispatch before: 113.7), 76.1 / 102.2 (77.2), 81.4 / 99.8,
# 107.6 / 115.4, 111.1 / 116.7.
_S = W8A8Config
DECODE_TABLE: dict[tuple[int, int], tuple[tuple[int, W8A8Config | None], ...]] = {
    (6144, 4096): ((48, _S(64, 128, 128, 8, 4, 4, True, 2, True)), (96, _S(64, 64, 256, 8, 4, 4)),
                   (160, _S(64, 64, 256, 8, 4, 3)), (256, None)),
    (4096, 4096): ((48, _S(64, 128, 128, 8, 4, 4, True, 4, True)), (160, _S(64, 64, 256, 8, 4, 4)),
                   (256, _S(64, 64, 256, 8, 4, 3))),
    (4096, 14336): ((48, _S(64, 128, 128, 8, 4, 4, True, 4, True)), (96, _S(64, 64, 256, 8, 4, 3, False, 4, True)),
                    (160, _S(64, 64, 256, 8, 4, 4)), (256, _S(64, 128, 128, 8, 4, 4, True, 2, True))),
    (28672, 4096): ((96, _S(64, 128, 128, 8, 4, 4, True)), (256, None)),
}
DECODE_MIN_M = 17  # below: the W8A16 GEMV / 16-row tiles (scaled_mm.choose_path)


def decode_config(m: int, n: int, k: int) -> tuple[bool, W8A8Config | None]:
    """(whether DECODE_TABLE has this (m, n, k), its config: None = cuBLAS). Example: (100, 4096, 14336)
    -> (True, the 64 x 64 x 256 unsplit tile of the M <= 160 bucket); (300, 4096, 14336) -> (False, None)."""
    if m < DECODE_MIN_M:
        return False, None
    for max_m, cfg in DECODE_TABLE.get((n, k), ()):
        if m <= max_m:
            return True, cfg
    return False, None


def _fit_k(cfg: W8A8Config, k: int) -> W8A8Config:
    """BLOCK_K no wider than K rounded up to a power of two (>= 32: int8 / fp8 dots take K >= 32)."""
    return cfg._replace(BLOCK_K=max(32, min(cfg.BLOCK_K, triton.next_power_of_2(k))))


def w8a8_gemm(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype, config: W8A8Config | None = None,
              m: int | None = None) -> torch.Tensor:
    """(xq @ wq^T) * x_scale * w_scale + bias -> (m, N) out_dtype; the contract of `scaled_mm_ref`.

    xq (>= m, K) int8 or float8_e4m3fn, K contiguous; wq (N, K) the same dtype; x_scale (>= m, 1) and
    w_scale (N,) fp32; bias (N,) any float dtype or None. `m` (default: all rows of xq) lets the
    caller pass a quantized activation with padding rows. No host syncs (graph-capturable).
    """
    if xq.dtype != wq.dtype or xq.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"w8a8_gemm takes int8 or float8_e4m3fn operands of one dtype, got {xq.dtype} and {wq.dtype}")
    if xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(f"expected xq (M, K) and wq (N, K), got {tuple(xq.shape)} and {tuple(wq.shape)}")
    if xq.stride(1) != 1 or wq.stride(1) != 1:
        raise ValueError("w8a8_gemm needs K-contiguous operands")
    m = xq.shape[0] if m is None else m
    k = xq.shape[1]
    n = wq.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    cfg = _fit_k(config, k) if config is not None else w8a8_gemm_config(m, n, k)
    grid = (triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N),)
    split = max(1, min(cfg.SPLIT_K, triton.cdiv(k, cfg.BLOCK_K)))
    serial = cfg.SERIAL and split > 1
    ws = counters = None
    if serial:
        made = split_k_workspace(_workspaces, xq.device, _WS_FLOATS, _WS_COUNTERS)
        if made is not None and split * m * n <= _WS_FLOATS and grid[0] <= _WS_COUNTERS:
            ws, counters = made
        else:  # none yet (first asked inside a capture) or too small: the two-launch sum
            serial = False
    # TMA only unsplit or with the one-launch sum (the two-launch sum: the pointer kernel)
    if cfg.TMA and (TensorDescriptor is None or (split > 1 and not serial)):
        cfg = cfg._replace(TMA=False)
    if cfg.TMA:
        if k % 16 or xq.stride(0) % 16 or wq.stride(0) % 16:
            raise ValueError("the TMA path needs 16-byte aligned rows (K and the row strides multiples of 16)")
        a_desc = TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [cfg.BLOCK_M, cfg.BLOCK_K])
        b_desc = TensorDescriptor(wq, [n, k], [wq.stride(0), 1], [cfg.BLOCK_N, cfg.BLOCK_K])
        _w8a8_gemm_tma_kernel[(grid[0], split)](
            a_desc, b_desc, x_scale.reshape(-1), w_scale.reshape(-1), bias if bias is not None else w_scale, out,
            ws if ws is not None else out, counters if counters is not None else out, m, n, k, out.stride(0),
            HAS_BIAS=bias is not None, IS_INT=xq.dtype == torch.int8,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, SPLIT=split > 1,
            SERIAL=serial, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return out
    if split > 1 and ws is None:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=xq.device)
    _w8a8_gemm_kernel[(grid[0], split)](
        xq, wq, x_scale.reshape(-1), w_scale.reshape(-1), bias if bias is not None else w_scale, out,
        ws if ws is not None else out, counters if counters is not None else out,
        m, n, k, xq.stride(0), wq.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, IS_INT=xq.dtype == torch.int8, EVEN_K=k % cfg.BLOCK_K == 0,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, SPLIT=split > 1,
        SERIAL=serial, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1 and not serial:
        block_n = min(1024, triton.next_power_of_2(n))
        _split_k_sum_kernel[(m, triton.cdiv(n, block_n))](
            ws, bias if bias is not None else w_scale, out, m, n, out.stride(0), HAS_BIAS=bias is not None,
            SPLIT_K=split, BLOCK_N=block_n, num_warps=4,
        )
    return out
