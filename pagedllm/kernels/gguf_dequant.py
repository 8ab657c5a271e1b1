"""GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K blocks repacked for the GPU, their dequantization, and references.

A GGUF row of K weights is a run of blocks (llama.cpp's ggml-common.h; gguf.quants decodes them):

    Q4_0  32 values, 18 bytes: fp16 d, 16 bytes of nibbles          w = d * (q - 8)
    Q4_1  32 values, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
    Q8_0  32 values, 34 bytes: fp16 d, 32 int8                      w = d * q
    Q4_K 256 values, 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit (sc, mn) pairs, 128 bytes
          of nibbles                                                 w = (d * sc_j) * q - dmin * mn_j
    Q6_K 256 values, 210 bytes: 128 bytes low nibbles (ql), 64 bytes 2-bit highs (qh), 16 int8
          scales, fp16 d                                             w = (d * sc_j) * (q - 32)

Inside a block the values are not in order (Q4_0 byte j holds k = j and j + 16; Q4_K byte b of 64-value
chunk c holds k = 64c + b and 64c + 32 + b; Q6_K ...). `repack_gguf_rows` decodes them once at load into
natural order and packs them K-major, N contiguous (the W4A16 kernels' layout, kernels/wna16_gemm.py),
so a tile row is one coalesced load across output columns:

    qs      (K // 8, N) int32   4-bit q, value of k at bits [(k % 8) * 4, +4) of row k // 8
                                (Q8_0: (K // 4, N), 8-bit q + 128; Q6_K: its low 4 bits)
    qh      (K // 16, N) int32  Q6_K only: the high 2 bits of q, 16 per word
    scales  (K // G, N)         per sub-block: Q4_0 / Q4_1 / Q8_0 fp16 d (G 32), Q4_K uint8 sc (G 32),
                                Q6_K int8 sc (G 16)
    mins    (K // 32, N)        Q4_1 fp16 m, Q4_K uint8 mn; None otherwise
    d, dmin (K // 256, N) fp16  Q4_K / Q6_K super-block scales (dmin: Q4_K only); None otherwise

Bits per weight (file / here): Q4_0 4.5 / 4.5, Q4_1 5 / 5, Q8_0 8.5 / 8.5, Q4_K 4.5 / 4.625, Q6_K
6.5625 / 6.5625. Every value is computed in fp32 in gguf.quants' order, so the dequantized weights equal
`gguf.quants.dequantize` bit for bit (the products d * sc and d * q are exact in fp32).

Kernels: `load_step` + `value_j` (a step's words and scales, then value j of every word, all in the
word tile's register layout; shared by the GEMV in kernels/gguf_gemv.py and `_dequant_kernel` here,
which writes the whole (K, N) weight in the activation dtype for cuBLAS). Nibbles come out of the words
with kernels/wna16_unpack.py's LOP3 trick (no int -> float conversions).
References: `dequantize_gguf_rows` (raw blocks -> (N, K) fp32, the decoder the repack rests on) and
`dequantize_packed_ref` (the packed arrays -> (K, N) fp32).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels.wna16_unpack import unpack_scaled
from pagedllm.quantization.gguf_blocks import GGUF_BLOCK, GPU_GGUF_TYPES

__all__ = ["GGUF_BLOCK", "GPU_GGUF_TYPES", "GGUFPacked", "dequantize_gguf_rows", "dequantize_packed",
           "dequantize_packed_ref", "repack_gguf_rows"]

QTYPE_ID = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q6_K": 4}  # the kernels' QTYPE constexpr


class GGUFPacked(NamedTuple):
    """One linear weight in the layout above (N outputs, K inputs)."""

    qtype: str
    qs: torch.Tensor
    qh: torch.Tensor | None
    scales: torch.Tensor
    mins: torch.Tensor | None
    d: torch.Tensor | None
    dmin: torch.Tensor | None
    n: int
    k: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.qh, self.scales, self.mins, self.d,
                                                            self.dmin) if t is not None)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 little-endian bytes -> (...) fp16."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _decode(raw: torch.Tensor, qtype: str, k: int) -> dict[str, torch.Tensor]:
    """raw (N, K // QK * bytes) uint8 -> q (N, K) uint8 in natural order and the scale fields, row-major."""
    if qtype not in GGUF_BLOCK:
        raise ValueError(f"GGUF type {qtype} has no GPU kernel (have {sorted(GGUF_BLOCK)})")
    qk, nbytes = GGUF_BLOCK[qtype]
    n = raw.shape[0]
    if k % qk or raw.shape[1] != k // qk * nbytes:
        raise ValueError(f"GGUF {qtype} rows of {k} inputs need a multiple of {qk} inputs and "
                         f"{k // qk * nbytes} bytes, got {tuple(raw.shape)}")
    b = raw.reshape(n, k // qk, nbytes)
    if qtype in ("Q4_0", "Q4_1"):
        off = 2 if qtype == "Q4_0" else 4
        qs = b[..., off:off + 16]
        q = torch.cat([qs & 15, qs >> 4], dim=-1)  # byte j: k = j (low), j + 16 (high)
        out = {"d": _f16(b[..., 0:2])}
        if qtype == "Q4_1":
            out["m"] = _f16(b[..., 2:4])
    elif qtype == "Q8_0":
        q = b[..., 2:34].contiguous().view(torch.int8)
        out = {"d": _f16(b[..., 0:2])}
    elif qtype == "Q4_K":
        s = b[..., 4:16].reshape(n, -1, 3, 4)  # rows: low 6 bits of sc 0-3, of mn 0-3, then 4-7's nibbles
        sd, sm, smd = s[..., 0, :], s[..., 1, :], s[..., 2, :]
        sc = torch.cat([sd & 63, (smd & 15) | ((sd >> 2) & 0x30)], dim=-1)
        mn = torch.cat([sm & 63, (smd >> 4) | ((sm >> 2) & 0x30)], dim=-1)
        qs = b[..., 16:144].reshape(n, -1, 4, 1, 32)  # chunk c, byte l: k = 64c + l, 64c + 32 + l
        q = torch.cat([qs & 15, qs >> 4], dim=-2)
        out = {"d": _f16(b[..., 0:2]), "dmin": _f16(b[..., 2:4]), "sc": sc, "mn": mn}
    else:  # Q6_K
        ql = b[..., 0:128].reshape(n, -1, 2, 1, 64)  # half h, byte l: k = 128h + l, 128h + 64 + l
        qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)  # bits 2s..2s+1 of byte l: k = 128h + 32s + l
        lo = torch.cat([ql & 15, ql >> 4], dim=-2).reshape(n, -1, 256)
        hi = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).reshape(n, -1, 256)
        q = lo | (hi << 4)
        out = {"sc": b[..., 192:208].contiguous().view(torch.int8), "d": _f16(b[..., 208:210])}
    out["q"] = q.reshape(n, k)
    return out


def dequantize_gguf_rows(raw: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """raw (N, bytes) uint8 GGUF blocks -> (N, K) fp32, in gguf.quants' order of fp32 operations."""
    f = _decode(raw, qtype, k)
    n = raw.shape[0]
    q = f["q"].float().reshape(n, -1, 16 if qtype == "Q6_K" else 32)  # (N, sub-blocks, G)
    if qtype == "Q4_0":
        w = f["d"].float()[..., None] * (q - 8)
    elif qtype == "Q4_1":
        w = f["d"].float()[..., None] * q + f["m"].float()[..., None]
    elif qtype == "Q8_0":
        w = f["d"].float()[..., None] * q
    elif qtype == "Q4_K":
        s = f["d"].float().repeat_interleave(8, dim=1) * f["sc"].reshape(n, -1).float()
        m = f["dmin"].float().repeat_interleave(8, dim=1) * f["mn"].reshape(n, -1).float()
        w = s[..., None] * q - m[..., None]
    else:
        s = f["d"].float().repeat_interleave(16, dim=1) * f["sc"].reshape(n, -1).float()
        w = s[..., None] * (q - 32)
    return w.reshape(n, k)


def _pack_k(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, K) unsigned values -> (K // pf, N) int32, pf = 32 // bits values of consecutive k per word."""
    pf = 32 // bits
    n, k = q.shape
    v = q.T.reshape(k // pf, pf, n)
    words = torch.zeros(k // pf, n, dtype=torch.int32, device=q.device)
    for j in range(pf):  # int32 throughout (a shift into bit 31 wraps to the sign): no int64 copy of q
        words |= v[:, j].to(torch.int32) << (j * bits)
    return words


def repack_gguf_rows(raw: torch.Tensor, qtype: str, k: int) -> GGUFPacked:
    """raw (N, K // QK * bytes) uint8 rows of GGUF blocks (on any device) -> the layout above."""
    f = _decode(raw, qtype, k)
    n = raw.shape[0]

    def t(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.reshape(n, -1).T.contiguous()

    q = f["q"]
    qh = None
    if qtype == "Q8_0":
        qs = _pack_k((q.to(torch.int16) + 128).to(torch.uint8), 8)
    elif qtype == "Q6_K":
        qs, qh = _pack_k(q & 15, 4), _pack_k(q >> 4, 2)
    else:
        qs = _pack_k(q, 4)
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        return GGUFPacked(qtype, qs, None, t(f["d"]), t(f.get("m")), None, None, n, k)
    return GGUFPacked(qtype, qs, qh, t(f["sc"]), t(f.get("mn")), t(f["d"]), t(f.get("dmin")), n, k)


def _unpack_k(words: torch.Tensor, bits: int) -> torch.Tensor:
    pf = 32 // bits
    shifts = (torch.arange(pf, device=words.device, dtype=torch.int32) * bits).view(1, pf, 1)
    vals = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(words.shape[0] * pf, words.shape[1])


def dequantize_packed_ref(p: GGUFPacked) -> torch.Tensor:
    """The packed arrays -> (K, N) fp32 weight (x @ w is the linear), same fp32 operations as the kernel."""
    if p.qtype == "Q8_0":
        q = _unpack_k(p.qs, 8).float() - 128
    elif p.qtype == "Q6_K":
        q = (_unpack_k(p.qs, 4) | (_unpack_k(p.qh, 2) << 4)).float()
    else:
        q = _unpack_k(p.qs, 4).float()
    g = 16 if p.qtype == "Q6_K" else 32
    sub = torch.arange(p.k, device=q.device) // g
    s = p.scales.float()
    if p.d is not None:  # K-quants: d of the super-block times the sub-block's integer scale
        s = p.d.float().repeat_interleave(256 // g, dim=0) * s
    if p.qtype == "Q4_0":
        return s[sub] * (q - 8)
    if p.qtype == "Q4_1":
        return s[sub] * q + p.mins.float()[sub]
    if p.qtype == "Q8_0":
        return s[sub] * q
    if p.qtype == "Q4_K":
        m = p.dmin.float().repeat_interleave(8, dim=0) * p.mins.float()
        return s[sub] * q - m[sub]
    return s[sub] * (q - 32)


@triton.jit
def load_step(qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, k0, offs_n, mask_n, N, K,
              QTYPE: tl.constexpr, BLOCK_KP: tl.constexpr):
    """One step's words and scales, all (BLOCK_KP, BLOCK_N) in the layout of the word tile (no layout
    conversions later): word row kp holds k = k0 + kp * PF + j, j < PF, in sub-block (k0 + kp * PF) // G;
    s / o: that sub-block's scale and offset (w = q * s + o, or (q - Z) * s), gathered per row (rows
    repeat G / PF times: L1 hits). k0 is a multiple of BLOCK_KP * PF, which divides 256, so a step lies in
    one K-quant super-block. Rows past K are masked (K need not be a multiple of the step), and a step
    at or past K loads nothing (a prefetch of the step after a split's last passes K = the split's end)."""
    BITS: tl.constexpr = 8 if QTYPE == 2 else 4
    PF: tl.constexpr = 32 // BITS
    G: tl.constexpr = 16 if QTYPE == 4 else 32
    kp = tl.arange(0, BLOCK_KP)
    krow = k0 + kp * PF
    mask = (krow < K)[:, None] & mask_n[None, :]
    col = offs_n[None, :]
    words = tl.load(qs_ptr + (krow // PF)[:, None].to(tl.int64) * N + col, mask=mask, other=0,
                    eviction_policy="evict_first")
    g_off = (krow // G)[:, None].to(tl.int64) * N + col
    s = tl.load(s_ptr + g_off, mask=mask, other=0).to(tl.float32)
    o = s
    hq = words
    if QTYPE == 1:
        o = tl.load(m_ptr + g_off, mask=mask, other=0).to(tl.float32)
    if QTYPE >= 3:  # K-quants: the super-block's fp16 d (and dmin) times the sub-block's integer scale
        sup = (k0 // 256) * N + offs_n  # < K / 256 * N: no int32 overflow
        mask_sup = mask_n & (offs_n * 0 + k0 < K)
        d = tl.load(d_ptr + sup, mask=mask_sup, other=0).to(tl.float32)
        s = d[None, :] * s  # exact in fp32, as gguf.quants computes it
        if QTYPE == 3:
            dm = tl.load(dm_ptr + sup, mask=mask_sup, other=0).to(tl.float32)
            o = -(dm[None, :] * tl.load(m_ptr + g_off, mask=mask, other=0).to(tl.float32))
        else:  # Q6_K high bits: word (k0 + kp * 8) // 16, value j at bits (kp % 2) * 16 + 2 j
            hw = tl.load(qh_ptr + (krow // 16)[:, None].to(tl.int64) * N + col, mask=mask, other=0,
                         eviction_policy="evict_first")
            hq = hw >> ((kp % 2) * 16)[:, None]
    return words, words >> 16, hq, s, o


@triton.jit
def q_j(words, hi, hq, J: tl.constexpr, QTYPE: tl.constexpr, Z: tl.constexpr):
    """q - Z of value J of every word of the step as exact fp32 (q unsigned; Q6_K: low 4 + high 2 bits),
    without int -> float conversions: the value's bits are or-ed, in place (q * 2^(b*s), s = J % (16 /
    b)), into the float 2^23 (kernels/wna16_unpack.py), so one FFMA, u * 2^-(b*s) - (2^23 * 2^-(b*s) + Z),
    undoes scale and offset and subtracts Z exactly (every term is exact in fp32). Q6_K moves its two
    high bits next to the nibble first (one shift), so q = lo | hi << 4 costs one or more, not a second
    conversion."""
    BITS: tl.constexpr = 8 if QTYPE == 2 else 4
    HALF: tl.constexpr = 16 // BITS
    S: tl.constexpr = J % HALF
    INV: tl.constexpr = 1.0 / (1 << (BITS * S))
    if QTYPE == 4:
        # high bits of value J sit at bits 2J of hq; the nibble at 4S of its half-word
        SH: tl.constexpr = 4 * S + 4 - 2 * J
        if SH >= 0:
            hb = hq << SH
        else:
            hb = hq >> (-SH)
        if J < HALF:
            half = words
        else:
            half = hi
        bits = (half & (0xF << (4 * S))) | (hb & (0x30 << (4 * S))) | 0x4B000000
        u = bits.to(tl.float32, bitcast=True)
    else:
        u = unpack_scaled(words, hi, J, BITS)
    return u * INV - (8388608.0 * INV + Z)


@triton.jit
def value_j(words, hi, hq, s, o, J: tl.constexpr, QTYPE: tl.constexpr):
    """fp32 weights of value J of every word of the step (rows k = k0 + kp * PF + J), gguf.quants' fp32
    operations (the fused multiply-adds round once, as its separate ones do: the products are exact)."""
    if QTYPE == 0:
        w = q_j(words, hi, hq, J, QTYPE, 8.0) * s
    elif QTYPE == 2:
        w = q_j(words, hi, hq, J, QTYPE, 128.0) * s
    elif QTYPE == 4:
        w = q_j(words, hi, hq, J, QTYPE, 32.0) * s
    else:  # Q4_1: d q + m; Q4_K: (d sc) q - dmin mn
        w = q_j(words, hi, hq, J, QTYPE, 0.0) * s + o
    return w


def kernel_args(p: GGUFPacked) -> tuple[torch.Tensor, ...]:
    """(qs, qh, scales, mins, d, dmin) with unused slots filled by `qs` (never read: compiled out)."""
    return tuple(t if t is not None else p.qs for t in (p.qs, p.qh, p.scales, p.mins, p.d, p.dmin))


def pack_factor(qtype: str) -> int:
    """Values per int32 word of `qs`."""
    return 4 if qtype == "Q8_0" else 8


@triton.jit
def _dequant_kernel(qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, out_ptr, N, K, N_START, N_OUT,
                    QTYPE: tl.constexpr, BLOCK_KP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns [N_START, N_START + N_OUT) of the weight -> out (K, N_OUT)."""
    PF: tl.constexpr = 4 if QTYPE == 2 else 8
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = N_START + cols
    mask_n = cols < N_OUT
    k0 = tl.program_id(1) * BLOCK_KP * PF
    words, hi, hq, s, o = load_step(qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, k0, offs_n, mask_n, N, K, QTYPE,
                                    BLOCK_KP)
    for j in tl.static_range(PF):
        w = value_j(words, hi, hq, s, o, j, QTYPE)
        k = k0 + tl.arange(0, BLOCK_KP) * PF + j
        tl.store(out_ptr + k[:, None].to(tl.int64) * N_OUT + cols[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=(k < K)[:, None] & mask_n[None, :])


def dequantize_packed(p: GGUFPacked, dtype: torch.dtype, cols: tuple[int, int] | None = None, block_n: int = 128,
                      block_kp: int = 16) -> torch.Tensor:
    """CUDA (or the interpreter): the (K, N) weight in `dtype`, or its columns [start, end) as (K, end -
    start) (a scratch for cuBLAS at large M)."""
    start, end = cols or (0, p.n)
    if not 0 <= start < end <= p.n:
        raise ValueError(f"columns {cols} outside the weight's {p.n}")
    out = torch.empty((p.k, end - start), dtype=dtype, device=p.qs.device)
    grid = (triton.cdiv(end - start, block_n), triton.cdiv(p.k, block_kp * pack_factor(p.qtype)))
    _dequant_kernel[grid](*kernel_args(p), out, p.n, p.k, start, end - start, QTYPE=QTYPE_ID[p.qtype],
                          BLOCK_KP=block_kp, BLOCK_N=block_n, num_warps=4)
    return out
