"""Triton kernels of the GPU fast path, each beside the plain PyTorch reference it must match.

Modules: `kv_cache_write` (write K/V through slot_mapping), `paged_attention` (unified prefill +
decode attention over the paged cache, with a split-K variant), `rmsnorm`, `rotary`, `activation`,
`qkv_prep` (q/k RMSNorm + rotary + K/V write fused, straight from the qkv GEMM output),
`decode_attention` (that prep and the attention of a decode-only step in one kernel).

Without CUDA, Triton can run a kernel only in its interpreter (`TRITON_INTERPRET=1`, CPU tensors),
and it reads that flag when `@triton.jit` decorates a function, i.e. when a kernel module is first
imported. Setting it here, before any submodule is imported, makes the kernels runnable on a
CPU-only machine however the process got here (a whole test suite, a REPL). A machine with CUDA is
left alone, and an explicit `TRITON_INTERPRET` set by the user always wins.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
