"""Suite-wide settings: Triton's interpreter on CPU-only machines; block-pool invariants checked every step."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PAGEDLLM_DEBUG_BLOCKS", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
