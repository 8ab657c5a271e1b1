"""The GGUF block types the GPU method computes on, and each one's geometry.

Kept apart from the Triton kernels (kernels/gguf_dequant.py) so that choosing a method
(quantization/gguf.py) on a machine without Triton, the CPU path, never imports Triton.
"""

from __future__ import annotations

# type -> (values per block, bytes per block), as gguf.GGML_QUANT_SIZES
GGUF_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}
GPU_GGUF_TYPES = frozenset(GGUF_BLOCK)
