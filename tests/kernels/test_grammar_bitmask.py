"""The one-launch grammar bitmask held to the torch path it replaces on CUDA: the same -inf
columns on the named rows (in any order, across blocks, a vocabulary not a multiple of 32), and
every other row untouched."""

import pytest
import torch

from pagedllm.kernels.grammar_bitmask import BLOCK_V, apply_bitmask_inplace
from pagedllm.structured_output.bitmask import apply_grammar_bitmask_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [70, BLOCK_V + 101])
def test_matches_the_torch_reference(device, dtype, vocab_size):
    logits = torch.randn(6, vocab_size, device=device).to(dtype)
    words = (vocab_size + 31) // 32 + 1  # one word past the end, which must be ignored
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32)
    bitmask[1] = -1  # a row allowing everything
    rows = [4, 0, 2]
    want = apply_grammar_bitmask_ref(logits.clone(), bitmask, rows)
    got = apply_bitmask_inplace(logits.clone(), bitmask.to(device), torch.tensor(rows, dtype=torch.int32,
                                                                                   device=device))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got, want)
    assert torch.isinf(want[4]).any() and not torch.isinf(want[0]).any()  # the case is not trivial
    assert torch.equal(got[[1, 3, 5]], logits[[1, 3, 5]])


def test_first_rows_need_no_index(device):
    logits = torch.randn(4, 100, device=device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 4), dtype=torch.int32)
    want = apply_grammar_bitmask_ref(logits.clone(), bitmask, [0, 1])
    assert torch.equal(apply_bitmask_inplace(logits.clone(), bitmask.to(device), None), want)
