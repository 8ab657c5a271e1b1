"""Kernel tests: Triton's interpreter on CPU-only machines (set before any kernel is decorated),
the real GPU otherwise; the same tests run on both."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedllm.attention.metadata import AttentionMetadata, build_metadata  # noqa: E402


@pytest.fixture(autouse=True)
def _fixed_seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    num_blocks: int = 64,
    dtype: torch.dtype = torch.float32,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata with shuffled, non-contiguous block tables, and a cache of random (finite) values."""
    perm = torch.randperm(num_blocks).tolist()
    tables: list[list[int]] = []
    for s in seq_lens:
        n = -(-s // block_size)
        if n > len(perm):
            raise ValueError("num_blocks too small for these seq_lens")
        tables.append(perm[:n])
        perm = perm[n:]
    md = build_metadata(query_lens, seq_lens, tables, block_size, device=device)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return md, kv_cache


@pytest.fixture
def make_batch():
    """`_make_batch` above as a fixture (conftest modules should not be imported)."""
    return _make_batch
