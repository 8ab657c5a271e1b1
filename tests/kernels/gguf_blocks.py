"""Random valid GGUF blocks for tests: gguf.quants.quantize of random floats where gguf-py can quantize
the type (Q4_0 / Q4_1 / Q8_0), else random bytes with finite fp16 scales set to `scale` (Q4_K, Q5_K,
Q6_K: gguf-py only dequantizes those). Values come out about N(0, std)."""

from __future__ import annotations

import gguf
import numpy as np

# fp16 d giving weights of standard deviation ~1 for random K-quant bytes (see `random_gguf_blocks`)
_UNIT_D = {"Q4_K": 1 / 200, "Q5_K": 1 / 400, "Q6_K": 1 / 1300}


def random_gguf_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator, std: float = 1.0) -> np.ndarray:
    """(rows, bytes) uint8 blocks of `qtype` holding a rows x cols weight."""
    t = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        return gguf.quants.quantize((rng.standard_normal((rows, cols)) * std).astype(np.float32), t)
    qk, nbytes = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (rows, cols // qk, nbytes), dtype=np.uint8)
    d = (_UNIT_D[qtype] * std * (0.5 + rng.random((rows, cols // qk)))).astype(np.float16)
    d = d.view(np.uint8).reshape(rows, cols // qk, 2)
    if qtype == "Q6_K":  # ql, qh, 16 int8 scales, then d
        raw[..., 208:210] = d
    else:  # Q4_K / Q5_K: d, dmin first; dmin = 7.5 d (Q5_K 15.5 d) centres w = d sc q - dmin mn near 0
        raw[..., 0:2] = d
        raw[..., 2:4] = (d.view(np.float16) * (7.5 if qtype == "Q4_K" else 15.5)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)
