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

The inner loop of a program, by StreamConfig.MATH: fp32 magic numbers (kernels/wna16_stream_fp32.py)
or packed fp16 math (kernels/wna16_stream_packed.py, with its torch emulation), whose x prologue may
compute the kernel before (kernels/wna16_stream_prologue.py: SwiGLU's activation, residual add +
RMSNorm); the launch per weight shape: kernels/wna16_stream_config.py.

Split-K epilogue (SPLIT = cdiv(K, STEPS * BLOCK_K) programs per N block): each program stores its
(BLOCK_N,) fp32 partial to a workspace (SPLIT, N); the last of an N block's programs to arrive
(a self-resetting counter, as gemv.py) loads the partials RED rows at a time as one 2-D tile and
sums them in a fixed order (deterministic: the same bits whoever arrives last), adds the bias and
writes y. One launch, no memset; CUDA graphs: no host sync, the workspace is made outside any
capture (a call that would first make it inside a capture runs wna16_tc.py instead).

Reference: `wna16_gemm.wna16_linear_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm import envs
from pagedllm.kernels.activation import silu_and_mul
from pagedllm.kernels.gemv import split_k_workspace
from pagedllm.kernels.rmsnorm import rms_norm
from pagedllm.kernels.wna16_mma8 import MMA8Config, mma8_supported, wna16_mma8_linear
from pagedllm.kernels.wna16_stream_config import (
    StreamConfig,
    program_steps,
    stream_config,
    stream_supported,
)
from pagedllm.kernels.wna16_stream_fp32 import MAGIC_EVEN, MAGIC_ODD, _stepwise
from pagedllm.kernels.wna16_stream_packed import _stepwise_packed, wna16_packed_emulation
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
    if isinstance(cfg, MMA8Config):
        if mma8_supported(x, k, group_size, 4):
            return wna16_mma8_linear(unfused_input(), qweight, scales, zeros, group_size, cfg, bias, perm)
        cfg = StreamConfig(128, 2, 4)  # the table's default launch (the interpreter, or a group size it cannot take)
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
