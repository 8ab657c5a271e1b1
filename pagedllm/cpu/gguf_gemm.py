"""GGUF block weights repacked for the CPU kernel, and `gguf_matmul(x, packed)`.

A GGUF row of K weights is K / 32 blocks; the block types handled here (bytes per block):

    Q4_0 (18): fp16 d, 16 bytes of nibbles          w = d * (q - 8)
    Q4_1 (20): fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
    Q8_0 (34): fp16 d, 32 int8                      w = d * q

Byte j of a nibble block holds k = j (low nibble) and k = j + 16 (high nibble). `pack_gguf_rows`
regroups 16 rows at a time so that the kernel loads one k of 16 outputs as one vector (layout in
kernels.c). Q4_0 is stored as Q4_1 with m = -8 d, which gives the same float32 values: d * q is
exact, and so is d * q - 8 d.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.cpu.build import load_cpu_kernels

TILE = 16
QK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
SUPPORTED_TYPES = frozenset(BLOCK_BYTES)


class _HugePageArena:
    """Packed weights live in 64 MB anonymous mappings advised for transparent huge pages.

    A decode step streams every packed weight once; with 4 KB pages that is ~25k TLB entries per
    step and the hardware prefetcher stops at every page edge. A mapping is unmapped when the last
    tensor cut from it dies (torch.frombuffer keeps the mmap object alive), so models can be freed.
    """

    CHUNK = 64 << 20
    ALIGN = 64

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._used = 0

    @staticmethod
    def _map(size: int) -> torch.Tensor:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # THP disabled: plain pages
        return torch.frombuffer(m, dtype=torch.uint8)

    def empty(self, nbytes: int) -> torch.Tensor:
        if not hasattr(mmap, "MAP_ANONYMOUS"):
            return torch.empty(nbytes, dtype=torch.uint8)
        if nbytes > self.CHUNK // 4:
            return self._map(nbytes)
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if self._buf is None or start + nbytes > self._buf.numel():
            self._buf, start = self._map(self.CHUNK), 0
        self._used = start + nbytes
        return self._buf[start:start + nbytes]


_ARENA = _HugePageArena()


@dataclass(frozen=True)
class PackedGGUFWeight:
    kind: int  # 4: Q4 tiles, 8: Q8 tiles (kernels.c)
    data: torch.Tensor  # uint8, the tiles back to back
    out_features: int  # N
    in_features: int  # K

    def __post_init__(self) -> None:
        # Read once here rather than per matmul call (frozen: `data` cannot be swapped under it).
        object.__setattr__(self, "data_ptr", self.data.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def pack_gguf_rows(raw: np.ndarray | torch.Tensor, qtype: str, in_features: int) -> PackedGGUFWeight:
    """raw: uint8 (N, K / 32 * block_bytes), the GGUF blocks of N rows in output order."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {qtype} has no CPU kernel; supported: {sorted(SUPPORTED_TYPES)}")
    if in_features % QK:
        raise ValueError(f"in_features {in_features} is not a multiple of the GGUF block size {QK}")
    raw = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    n, nb, bb = raw.shape[0], in_features // QK, BLOCK_BYTES[qtype]
    if raw.dtype != np.uint8 or raw.shape[1] != nb * bb:
        raise ValueError(f"{qtype} rows of {in_features} weights are {nb * bb} bytes, got {raw.dtype} {raw.shape}")
    blocks = raw.reshape(n, nb, bb)
    n_pad = -(-n // TILE) * TILE
    if n_pad != n:  # padding rows are all-zero blocks: d = m = 0, so their weights are 0
        blocks = np.concatenate([blocks, np.zeros((n_pad - n, nb, bb), np.uint8)])
    t = n_pad // TILE

    def per_tile(a: np.ndarray) -> np.ndarray:
        # (n_pad, nb, ...) -> (t, nb, TILE, ...): the 16 rows of a tile side by side per block
        return a.reshape(t, TILE, nb, *a.shape[2:]).swapaxes(1, 2)

    d = blocks[:, :, 0:2].copy().view(np.float16)  # (n_pad, nb, 1), kept as fp16 (as in the file)
    if qtype == "Q8_0":
        q = per_tile(blocks[:, :, 2:34])  # (t, nb, TILE, 32)
        parts = [per_tile(d)[..., 0], q.swapaxes(2, 3)]  # q -> (t, nb, 32 k, TILE)
        kind = 8
    else:
        if qtype == "Q4_1":
            m = blocks[:, :, 2:4].copy().view(np.float16)
            qs = blocks[:, :, 4:20]
        else:
            m = d * np.float16(-8.0)  # exact: a power-of-two multiple
            qs = blocks[:, :, 2:18]
        parts = [per_tile(d)[..., 0], per_tile(m)[..., 0], per_tile(qs).swapaxes(2, 3)]
        kind = 4
    flat = [np.ascontiguousarray(p).reshape(t, nb, -1).view(np.uint8) for p in parts]
    data = _ARENA.empty(t * nb * sum(f.shape[2] for f in flat))
    np.concatenate(flat, axis=2, out=data.numpy().reshape(t, nb, -1))
    return PackedGGUFWeight(kind, data, n, in_features)


def gguf_matmul(
    x: torch.Tensor, w: PackedGGUFWeight, out: torch.Tensor | None = None, dense_min_rows: int = 48
) -> torch.Tensor:
    """x (M, K) float32 -> (M, N) float32 = x @ W^T, W the dequantized GGUF weight.

    More than `dense_min_rows` rows: panels of the weight are dequantized and multiplied with BLAS
    (faster for prefills; the same float32 weights, so only the order of the sums differs).
    """
    lib = load_cpu_kernels()
    assert lib is not None, "gguf_matmul needs the compiled CPU kernels"
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be float32 (M, {w.in_features}), got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, w.out_features), dtype=torch.float32)
    args = (w.kind, x.data_ptr(), x.stride(0), w.data_ptr, out.data_ptr(), out.stride(0), m, w.out_features,
            w.in_features)
    # Prefills: dequantize panels of the weight and multiply with BLAS (when torch's is available).
    if (m <= dense_min_rows or not lib.gguf_gemm_dense(*args)) and not lib.gguf_gemm(*args):
        raise MemoryError(f"gguf_gemm: no memory for a ({m}, {w.in_features}) float32 buffer")
    return out


def gguf_dequantize(w: PackedGGUFWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense float32 (N, K) weight, equal to gguf-py's dequantize of the original blocks."""
    lib = load_cpu_kernels()
    assert lib is not None, "gguf_dequantize needs the compiled CPU kernels"
    if out is None:
        out = torch.empty((w.out_features, w.in_features), dtype=torch.float32)
    if out.shape != (w.out_features, w.in_features) or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError(f"out must be a contiguous float32 ({w.out_features}, {w.in_features}) tensor")
    lib.gguf_dequantize(w.kind, w.data_ptr, out.data_ptr(), w.out_features, w.in_features)
    return out
