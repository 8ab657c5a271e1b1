"""Shared helpers for the sampler tests: build metadata from SamplingParams in one line."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample import RowInputs, SamplingMetadata, new_generator
from pagedllm.sampling_params import SamplingParams


def _make_md(
    params: list[SamplingParams],
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    n = len(params)
    prompts = prompts or [[0]] * n
    outputs = outputs or [[] for _ in range(n)]
    if generators is None:
        generators = [None if p.seed is None else new_generator(p.seed, "cpu") for p in params]
    columns = zip(params, prompts, outputs, generators, strict=True)
    rows = [RowInputs(p, prompt, out, g) for p, prompt, out, g in columns]
    return SamplingMetadata.build(rows, vocab_size, "cpu")


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(0)


@pytest.fixture
def make_md():
    """The metadata builder above, as a fixture (conftest modules should not be imported)."""
    return _make_md
