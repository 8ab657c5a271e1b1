"""Fused temperature sampling: one pass over the logits, no softmax, no (R, V) temporaries.

Sampling from softmax(logits / T) is the Gumbel-max trick: token = argmax(logits / T + g) with
g = -log(-log(u)), u ~ U(0, 1) i.i.d. (the same law as the sampler's exponential race,
argmax(p / q) with q = -log(u), taken in log space, where softmax's normaliser cancels).
Greedy rows (T < 1e-5) take argmax(logits). A step costs one read of the (R, V) logits, in
their own dtype (bf16 -> fp32 happens in registers and is exact), instead of the ~6 passes of
divide / softmax / uniform / log / divide / argmax.

The draws. Column c of row r uses word c % 4 of Philox4x32-10(key = seed, counter = (c // 4, r,
0, 0)): one Philox call feeds four columns (Philox is most of the kernel's arithmetic), and the
draw of a column depends only on (seed, r, c), never on which program reads it. Scores are kept
in log2 units, x / (T ln 2) - log2(-log2(u)) (the same argmax), so that on NVIDIA the outer log is
one MUFU.LG2; the inner -log2(u) stays accurate as u -> 1 (see `_neg_log2`). Per column the
kernel then spends ~38 SASS instructions (sm_90), about 15 of them Philox.

The grid. One program per row leaves most of a big GPU idle at small batch sizes and streams
too few bytes at a time at large ones (256 rows x 151936 cols: 256 programs, ~0.6 TB/s). Each
row is split into `num_splits` slices of whole BLOCK_V tiles, (R, num_splits) programs write
their slice's (best score, lowest column holding it) to a partials buffer, and a second small
kernel reduces the partials of each row. Max and "lowest index among the maxima" are exact and
associative, so the sampled ids do not depend on num_splits:

    row of 5 tiles, num_splits 2 -> tiles_per_split 3 -> slices [tiles 0-2], [tiles 3-4]

Ties go to the lowest column; NaN scores never win; a row with no finite score gets column 0.
Used on CUDA for rows with neither top-k, top-p nor min-p nor a per-request seed; everything
else takes the sampler's torch path.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

import pagedllm.envs as envs

_GREEDY_EPS = 1e-5
BLOCK_V = 1024  # columns per tile; a multiple of 4 (one Philox call per 4 columns)
_BLOCK_S = 64  # partials per row read at a time by the reduce kernel
_PROGRAMS_PER_SM = 8  # 8 programs of 4 warps: half of an H100/H200 SM's 64 resident warps
_INTERPRETER_PROGRAMS = 16  # no SMs under TRITON_INTERPRET: a few programs, tests force their own


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:
        return libdevice.fast_log2f(x)  # one MUFU.LG2; absolute error ~2**-22 near 1, else 2 ulp
    else:
        return tl.log2(x)


@triton.jit
def _neg_log2(u, FAST: tl.constexpr):
    """-log2(u) for u in (0, 1), accurate relative to itself even as u -> 1 (where it -> 0). The
    winners of the race are the columns with small -log2(u), so an absolute error (a fast lg2's
    2**-22 near 1) would wreck them: with u = 1 - 2**-24 the true value is 8.6e-8. Near 1 a series
    in w = 1 - u (exact there) takes over: -log2(1 - w) = log2(e) * (w + w^2/2 + w^3/3 + w^4/4 + ...),
    cut after w^4: relative error < w^4 / 5 < 2e-7 for w < 1/32."""
    w = 1.0 - u
    near_1 = w * (1.4426950408889634 + w * (0.7213475204444817 + w * (0.48089834696298783
                                                                      + w * 0.36067376022224085)))
    return tl.where(w < 0.03125, near_1, -_log2(u, FAST))


@triton.jit(do_not_specialize=["seed", "tiles_per_split", "num_splits"])
def _gumbel_argmax_split_kernel(
    logits_ptr,  # (R, V) any float dtype, unit column stride
    temperature_ptr,  # (R,) float32
    part_score_ptr,  # (R, num_splits) float32: best score of each slice
    part_idx_ptr,  # (R, num_splits) int32: lowest column holding it
    seed,
    vocab_size,
    stride_row,
    tiles_per_split,
    num_splits,
    bitmask_ptr,  # int32 (R, ceil(V / 32)): bit j of word w allows column 32w + j; unread without HAS_MASK
    stride_mask,
    BLOCK_V: tl.constexpr,
    FAST_LOG2: tl.constexpr,  # MUFU lg2.approx (NVIDIA only); libdevice's log2f is ~20 instructions
    HAS_MASK: tl.constexpr,  # a grammar bitmask (structured outputs): forbidden columns score -inf
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.load(temperature_ptr + row)
    greedy = t < 1e-5
    # Scores in log2 units: x / (T ln 2) - log2(-log2(u)) is (x / T + g) / ln 2 minus a constant
    # (-ln(-ln u) = -ln 2 * log2(-log2 u) - ln(ln 2)), so it has the same argmax.
    inv_t2 = 1.4426950408889634 / tl.maximum(t, 1e-5)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK_V,), tl.int32)
    first_col = split * tiles_per_split * BLOCK_V
    for tile in range(tiles_per_split):
        start = first_col + tile * BLOCK_V
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab_size
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_MASK:
            words = tl.load(bitmask_ptr + row.to(tl.int64) * stride_mask + cols // 32, mask=mask, other=0)
            x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
        if greedy:
            score = x
        else:
            # Counters (c // 4, row) for the BLOCK_V // 4 column quads of this tile (start % 4 == 0).
            quad = start // 4 + tl.arange(0, BLOCK_V // 4)
            zero = quad * 0
            r0, r1, r2, r3 = tl.philox(seed, quad, zero + row, zero, zero)
            # [r0[q], r1[q], r2[q], r3[q]] -> columns 4q, 4q + 1, 4q + 2, 4q + 3.
            bits = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_V,))
            # u in [0, 1): clamp away from 0 so -log(u) is finite; u < 1 always, so g stays finite.
            u = tl.maximum(tl.uint_to_uniform_float(bits), 1e-20)
            score = x * inv_t2 - _log2(_neg_log2(u, FAST_LOG2), FAST_LOG2)
        score = tl.where(mask, score, float("-inf"))
        # Strict >: a lane keeps its first (lowest) column on ties; NaN never compares greater.
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
    m = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == m, best_idx, vocab_size), axis=0)
    tl.store(part_score_ptr + row * num_splits + split, m)
    tl.store(part_idx_ptr + row * num_splits + split, idx)


@triton.jit(do_not_specialize=["num_splits"])
def _argmax_partials_kernel(
    part_score_ptr,  # (R, num_splits) float32
    part_idx_ptr,  # (R, num_splits) int32
    out_ptr,  # (R,) int64
    num_splits,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    big = 2147483647
    best = tl.full((BLOCK_S,), float("-inf"), tl.float32)
    best_idx = tl.full((BLOCK_S,), big, tl.int32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask = s < num_splits
        score = tl.load(part_score_ptr + row * num_splits + s, mask=mask, other=float("-inf"))
        idx = tl.load(part_idx_ptr + row * num_splits + s, mask=mask, other=big)
        # Equal scores (a row with no finite score: every slice says (-inf, its column)) keep the lowest column.
        better = (score > best) | ((score == best) & (idx < best_idx))
        best = tl.where(better, score, best)
        best_idx = tl.where(better, idx, best_idx)
    m = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == m, best_idx, big), axis=0).to(tl.int64))


@functools.cache
def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_PROGRAMS


# Triton reads TRITON_INTERPRET when this module's kernels are decorated, i.e. at import: so do we.
_INTERPRETED = envs.TRITON_INTERPRET


def _fast_log2(device: torch.device) -> bool:
    # libdevice calls exist on NVIDIA only, and not in Triton's interpreter.
    return device.type == "cuda" and torch.version.hip is None and not _INTERPRETED


def split_plan(num_rows: int, vocab_size: int, num_splits: int | None, device: torch.device) -> tuple[int, int]:
    """-> (num_splits, tiles_per_split): about `target programs / num_rows` slices per row, each a
    whole number of tiles, none empty. 256 rows, 151936 cols (149 tiles), 1056 target programs
    -> 5 slices of 30 tiles; 1 row -> 149 slices of 1 tile; 2048 rows -> 1 slice of 149 tiles."""
    num_tiles = triton.cdiv(vocab_size, BLOCK_V)
    if num_splits is None:
        num_splits = triton.cdiv(_target_programs(device), num_rows)
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(num_splits, num_tiles)))
    return triton.cdiv(num_tiles, tiles_per_split), tiles_per_split


def gumbel_argmax(
    logits: torch.Tensor, temperature: torch.Tensor, seed: int, num_splits: int | None = None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits (R, V) float32/bf16/fp16, temperature (R,) float32 -> sampled ids (R,) int64 on
    logits' device. `num_splits` (programs per row) defaults to filling the GPU; the ids do not
    depend on it. `bitmask` int32 (R, ceil(V / 32)) on the device: row r samples only the columns
    its row allows (a grammar's bitmask, structured_output/bitmask.py; the same ids as masking the
    logits first, one launch fewer)."""
    if logits.dim() != 2 or temperature.shape != (logits.shape[0],):
        raise ValueError(f"expected logits (R, V) and temperature (R,), got {tuple(logits.shape)} and "
                         f"{tuple(temperature.shape)}")
    if not 0 <= seed < 2**31:
        # int32 range: a larger seed would make Triton compile an int64 variant of the kernel.
        raise ValueError(f"seed must be in [0, 2**31), got {seed}.")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    if vocab == 0:
        raise ValueError("logits have no columns.")
    splits, tiles_per_split = split_plan(num_rows, vocab, num_splits, logits.device)
    part_score = torch.empty((num_rows, splits), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((num_rows, splits), dtype=torch.int32, device=logits.device)
    if bitmask is not None:
        assert bitmask.dtype == torch.int32 and bitmask.shape[0] == num_rows and bitmask.stride(1) == 1
        assert bitmask.shape[1] * 32 >= vocab and bitmask.device == logits.device, (bitmask.shape, vocab)
    _gumbel_argmax_split_kernel[(num_rows, splits)](
        logits, temperature.to(torch.float32), part_score, part_idx, seed, vocab, logits.stride(0),
        tiles_per_split, splits, part_idx if bitmask is None else bitmask,
        0 if bitmask is None else bitmask.stride(0), BLOCK_V=BLOCK_V, FAST_LOG2=_fast_log2(logits.device),
        HAS_MASK=bitmask is not None, num_warps=4,
    )
    _argmax_partials_kernel[(num_rows,)](part_score, part_idx, out, splits, BLOCK_S=_BLOCK_S, num_warps=1)
    return out


# ---- plain torch reference: the same draws, so the same ids (up to float rounding of log) ----

_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * b) >> 32 and (a * b) & 0xFFFFFFFF for uint32 values held in int64 tensors; b is split
    in 16-bit halves so no product passes 2**63."""
    lo = (a * b) & _MASK32  # int64 wraps mod 2**64: the low 32 bits are right
    hi = (a * (b >> 16) + ((a * (b & 0xFFFF)) >> 16)) >> 16
    return hi, lo


def philox4x32_ref(seed: int, c0: torch.Tensor, c1: torch.Tensor) -> list[torch.Tensor]:
    """Triton's tl.philox(seed, c0, c1, 0, 0) with 10 rounds, in int64 torch ops -> 4 uint32 words."""
    c = [c0.to(torch.int64) & _MASK32, c1.to(torch.int64) & _MASK32, torch.zeros_like(c0, dtype=torch.int64),
         torch.zeros_like(c0, dtype=torch.int64)]
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        hi_b, lo_b = _mulhilo32(_PHILOX_ROUND_B, c[2])
        hi_a, lo_a = _mulhilo32(_PHILOX_ROUND_A, c[0])
        c = [hi_b ^ c[1] ^ k0, lo_b, hi_a ^ c[3] ^ k1, lo_a]
        k0, k1 = (k0 + _PHILOX_KEY_A) & _MASK32, (k1 + _PHILOX_KEY_B) & _MASK32
    return c


def gumbel_uniforms_ref(seed: int, num_rows: int, vocab_size: int) -> torch.Tensor:
    """The kernel's u for every (row, col), float32 (R, V) on the CPU."""
    cols = torch.arange(vocab_size)
    rows = torch.arange(num_rows).unsqueeze(1)
    words = philox4x32_ref(seed, (cols // 4).expand(num_rows, -1), rows.expand(-1, vocab_size))
    bits = torch.stack(words).gather(0, (cols % 4).expand(1, num_rows, -1)).squeeze(0)
    # Triton's uint_to_uniform_float: bits as int32, negatives folded with ~x, times ~2**-31.
    as_int32 = torch.where(bits >= 2**31, bits - 2**32, bits)
    folded = torch.where(as_int32 < 0, ~as_int32, as_int32)
    return folded.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)


def neg_log2_ref(u: torch.Tensor) -> torch.Tensor:
    """The kernel's -log2(u), float32: the w = 1 - u series near 1, log2 elsewhere."""
    w = 1.0 - u
    near_1 = w * (1.4426950408889634 + w * (0.7213475204444817 + w * (0.48089834696298783
                                                                      + w * 0.36067376022224085)))
    return torch.where(w < 0.03125, near_1, -torch.log2(u))


def gumbel_argmax_ref(logits: torch.Tensor, temperature: torch.Tensor, seed: int,
                      bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """gumbel_argmax in plain torch, with the kernel's draws (on the CPU, float32 math)."""
    x = logits.detach().cpu().float()
    if bitmask is not None:
        from pagedllm.structured_output.bitmask import unpack_bitmask

        x = x.masked_fill(~unpack_bitmask(bitmask.cpu(), x.shape[1]), float("-inf"))
    t = temperature.detach().cpu().float()
    greedy = (t < _GREEDY_EPS).unsqueeze(1)
    u = gumbel_uniforms_ref(seed, *x.shape).clamp_min(1e-20)
    inv_t2 = (1.4426950408889634 / t.clamp_min(_GREEDY_EPS)).unsqueeze(1)
    score = torch.where(greedy, x, x * inv_t2 - torch.log2(neg_log2_ref(u)))
    # NaN never wins (the kernel's strict >); no finite score at all -> column 0.
    score = torch.nan_to_num(score, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    return score.argmax(dim=-1).to(logits.device)
