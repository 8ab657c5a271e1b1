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


def test_the_sampling_kernel_applies_the_mask_itself(device):
    # Structured outputs with temperature sampling: the fused Gumbel-max kernel reads the bitmask
    # (one launch fewer) and draws the same ids as masking the logits first; greedy rows too.
    from pagedllm.kernels.sampling import gumbel_argmax, gumbel_argmax_ref

    vocab = 1024 + 77
    logits = torch.randn(4, vocab, device=device).to(torch.bfloat16)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[2] = 0
    bitmask[2, 20] = 1 << 7  # row 2 allows token 32 * 20 + 7 alone
    temperature = torch.tensor([0.8, 1.0, 0.8, 0.0], device=device)
    masked = apply_grammar_bitmask_ref(logits.clone(), bitmask, [0, 1, 2, 3])
    got = gumbel_argmax(logits, temperature, 3, bitmask=bitmask.to(device)).cpu()
    assert torch.equal(got, gumbel_argmax(masked, temperature, 3).cpu())
    assert torch.equal(got, gumbel_argmax_ref(logits, temperature, 3, bitmask=bitmask).cpu())
    assert got[2] == 32 * 20 + 7 and got[3] == masked[3].float().argmax().cpu()
    assert ((bitmask[torch.arange(4), got // 32] >> (got % 32)) & 1).all()


def test_the_sampler_masks_before_anything_reads_the_logits(device):
    # Rows asking for logprobs (or penalties, or top-k ...) are masked before step 1, so the
    # logprobs are those of the masked distribution, as vLLM reports them.
    from pagedllm.sample import RowInputs, Sampler, SamplingMetadata
    from pagedllm.sampling_params import SamplingParams

    logits = torch.randn(2, 100, device=device)
    bitmask = torch.zeros(2, 4, dtype=torch.int32)
    bitmask[0, 1], bitmask[1, 3] = 0b1010, 1  # row 0: tokens 33 and 35; row 1: token 96
    rows = [RowInputs(SamplingParams(temperature=t, logprobs=1), [0], [], None) for t in (0.0, 0.9)]
    out = Sampler()(logits.clone(), SamplingMetadata.build(rows, 100, device), bitmask.to(device))
    assert out.sampled_token_ids.tolist()[1] == 96 and out.sampled_token_ids.tolist()[0] in (33, 35)
    assert torch.isinf(out.logprobs.logprobs[:, 1]).sum() == 0 and out.logprobs.logprob_token_ids[1, 1] == 96
