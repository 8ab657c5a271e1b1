"""Fused Gumbel-max sampling: greedy rows are argmax; sampled rows follow softmax(logits / T)."""

import torch

from pagedllm.kernels.sampling import gumbel_argmax, gumbel_argmax_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_greedy_rows_are_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 3000, device=DEVICE)
    temperature = torch.zeros(6, device=DEVICE)
    assert torch.equal(gumbel_argmax(logits, temperature, seed=1), logits.argmax(dim=-1))


def test_sampled_rows_follow_softmax():
    # 64 rows sharing one 4-token distribution; T=0.5 sharpens it: p = softmax(logits / 0.5).
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0], device=DEVICE).repeat(64, 1)
    temperature = torch.full((64,), 0.5, device=DEVICE)
    p = torch.softmax(logits[0] / 0.5, dim=-1).cpu()
    counts = torch.zeros(4)
    for seed in range(8):
        ids = gumbel_argmax(logits, temperature, seed=seed).cpu()
        counts += torch.bincount(ids, minlength=4).float()
    freq = counts / counts.sum()
    assert torch.allclose(freq, p, atol=0.07), (freq, p)
    ref = gumbel_argmax_ref(logits.cpu(), temperature.cpu(), torch.Generator().manual_seed(0))
    ref_freq = torch.bincount(ref, minlength=4).float() / 64
    assert torch.allclose(ref_freq, p, atol=0.15)


def test_same_seed_same_draws_and_mixed_rows():
    torch.manual_seed(1)
    logits = torch.randn(5, 700, device=DEVICE)
    temperature = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3], device=DEVICE)
    a = gumbel_argmax(logits, temperature, seed=42)
    assert torch.equal(a, gumbel_argmax(logits, temperature, seed=42))
    assert a[0] == logits[0].argmax() and a[3] == logits[3].argmax()
