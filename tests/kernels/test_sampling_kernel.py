"""Fused Gumbel-max sampling: greedy rows are argmax; sampled rows follow softmax(logits / T); the
ids depend only on (seed, logits, temperature), not on the split of a row over programs."""

import pytest
import torch

from pagedllm.kernels.sampling import BLOCK_V, gumbel_argmax, gumbel_argmax_ref, neg_log2_ref, split_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_greedy_rows_are_argmax():
    logits = torch.randn(6, 3000, device=DEVICE)
    temperature = torch.zeros(6, device=DEVICE)
    assert torch.equal(gumbel_argmax(logits, temperature, seed=1), logits.argmax(dim=-1))


def test_sampled_rows_follow_softmax():
    # Rows sharing one 4-token distribution; T=0.5 sharpens it: p = softmax(logits / 0.5). The
    # frequencies come from the torch reference (fast on any machine), held to the kernel below.
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0], device=DEVICE).repeat(2048, 1)
    temperature = torch.full((2048,), 0.5, device=DEVICE)
    p = torch.softmax(logits[0] / 0.5, dim=-1).cpu()
    freq = torch.bincount(gumbel_argmax_ref(logits, temperature, 3).cpu(), minlength=4).float() / 2048
    assert torch.allclose(freq, p, atol=0.03), (freq, p)
    assert torch.equal(gumbel_argmax(logits[:16], temperature[:16], 3).cpu(),
                       gumbel_argmax_ref(logits[:16], temperature[:16], 3).cpu())


def test_same_seed_same_draws_and_mixed_rows():
    logits = torch.randn(5, 700, device=DEVICE)
    temperature = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3], device=DEVICE)
    a = gumbel_argmax(logits, temperature, seed=42)
    assert torch.equal(a, gumbel_argmax(logits, temperature, seed=42))
    assert a[0] == logits[0].argmax() and a[3] == logits[3].argmax()


def test_matches_the_torch_reference_draw_for_draw():
    # Flat logits so the noise decides: a wrong Philox word order or counter would change the ids.
    logits = torch.randn(4, 2500, device=DEVICE) * 0.1
    temperature = torch.tensor([1.0, 0.6, 0.0, 2.0], device=DEVICE)
    for seed in (0, 7, 2**31 - 2):
        assert torch.equal(gumbel_argmax(logits, temperature, seed).cpu(),
                           gumbel_argmax_ref(logits, temperature, seed).cpu())


def test_ids_do_not_depend_on_num_splits():
    vocab = 14 * BLOCK_V - 100  # 14 tiles, the last one partial
    logits = torch.randn(3, vocab, device=DEVICE) * 0.1
    temperature = torch.tensor([0.8, 0.0, 1.5], device=DEVICE)
    ids = {s: gumbel_argmax(logits, temperature, seed=5, num_splits=s).tolist() for s in (1, 2, 7, None)}
    assert split_plan(3, vocab, 7, torch.device(DEVICE)) == (7, 2)
    assert ids[1] == ids[2] == ids[7] == ids[None], ids
    assert ids[1] == gumbel_argmax_ref(logits, temperature, 5).tolist()


def test_split_plan():
    cpu = torch.device("cpu")
    # H200: 132 SMs x 8 programs = 1056 -> 5 slices of the 149 tiles at 256 rows.
    assert split_plan(256, 151936, 1056 // 256 + 1, cpu) == (5, 30)
    assert split_plan(1, 151936, 1056, cpu) == (149, 1)  # never more slices than tiles
    assert split_plan(2048, 151936, 1, cpu) == (1, 149)
    assert split_plan(4, 100, 3, cpu) == (1, 1)


@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_bf16_input_equals_its_float32_copy(temperature):
    # Inside a padded (R, V + 24) buffer, as the LM head leaves it: rows strided, columns not.
    full = torch.randn(3, 2024, device=DEVICE, dtype=torch.bfloat16) * 0.2
    logits = full[:, :2000]
    t = torch.full((3,), temperature, device=DEVICE)
    for s in (1, 2):
        assert torch.equal(gumbel_argmax(logits, t, 9, num_splits=s), gumbel_argmax(logits.float(), t, 9))


def test_greedy_ties_go_to_the_lowest_column():
    logits = torch.randn(2, 3 * BLOCK_V, device=DEVICE)
    logits[0, [2500, 1500, 700]] = 10.0  # maxima in three tiles: lowest column is in slice 0
    logits[1, [2900, 2100]] = 10.0  # both in later slices
    t = torch.zeros(2, device=DEVICE)
    for s in (1, 2, 3):
        assert gumbel_argmax(logits, t, 0, num_splits=s).tolist() == [700, 2100]


def test_rows_of_minus_inf_and_nan():
    vocab = 2 * BLOCK_V + 5
    logits = torch.full((5, vocab), float("-inf"), device=DEVICE)
    logits[0, 1900] = -3.0  # one finite token: sampled rows must pick it
    logits[1, 7] = 50.0
    logits[2, :] = float("nan")
    logits[2, 1100] = 0.0  # NaN never wins
    # row 3 stays all -inf: no finite score, column 0
    logits[4, 2050] = float("inf")
    t = torch.tensor([0.7, 0.0, 1.0, 0.9, 0.5], device=DEVICE)
    for s in (1, 3):
        for seed in (1, 2):
            assert gumbel_argmax(logits, t, seed, num_splits=s).tolist() == [1900, 7, 1100, 0, 2050]
    assert gumbel_argmax_ref(logits, t, 1).tolist() == [1900, 7, 1100, 0, 2050]


def test_bad_input():
    with pytest.raises(ValueError, match="seed"):
        gumbel_argmax(torch.zeros(1, 8, device=DEVICE), torch.ones(1, device=DEVICE), 2**31)
    with pytest.raises(ValueError, match="temperature"):
        gumbel_argmax(torch.zeros(2, 8, device=DEVICE), torch.ones(3, device=DEVICE), 0)
    assert gumbel_argmax(torch.zeros(0, 8, device=DEVICE), torch.ones(0, device=DEVICE), 0).shape == (0,)


def test_neg_log2_is_accurate_as_u_nears_1():
    # The race's winners have u near 1; -log2(u) there must keep its relative accuracy.
    u = torch.cat([1 - torch.arange(1, 4000, dtype=torch.float64) * 2**-24, torch.linspace(1e-9, 0.9999, 5000,
                                                                                          dtype=torch.float64)])
    u32 = u.float()
    exact = -torch.log2(u32.double())
    rel = (neg_log2_ref(u32).double() - exact).abs() / exact
    assert rel.max() < 1e-6, rel.max()
