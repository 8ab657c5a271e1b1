"""The mma.sync int4 linear for 1-8 rows (kernels/wna16_mma8.py): its input permutation and its A
arithmetic on the CPU (Gluon has no interpreter), the kernel itself against the reference on a GPU."""

import pytest
import torch

from pagedllm.kernels import wna16_mma8 as mk
from pagedllm.kernels.wna16_gemm import pack_along_k, wna16_linear_ref

_CUDA = torch.cuda.is_available()


def test_kk_map_is_a_permutation_that_keeps_a_threads_words_whole():
    wr, j = torch.meshgrid(torch.arange(16), torch.arange(8), indexing="ij")
    kk = mk.kk_of(wr, j)
    assert sorted(kk.flatten().tolist()) == list(range(128))
    # mma.sync gives lane c = lane % 4 the k bits 1-2: every nibble of word row wr lands on lane wr % 4
    assert torch.equal((kk >> 1) & 3, wr & 3)
    # a register holds k pairs (2t, 2t + 1): nibbles (i, i + 4) of one word, the magic-number pair
    pair_of = {int(k): (int(w), int(n)) for k, w, n in zip(kk.flatten(), wr.flatten(), j.flatten(), strict=True)}
    for t in range(64):
        (w0, j0), (w1, j1) = pair_of[2 * t], pair_of[2 * t + 1]
        assert w0 == w1 and j1 == j0 + 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_arithmetic_is_q_minus_z_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    k, n, group = 512, 48, 128
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    z = torch.randint(0, 16, (k // group, n), generator=g, dtype=torch.int32).to(torch.uint8)
    got = mk.mma8_dequant_emulation(pack_along_k(q, 4), z, group, dtype)
    want = (q - z.to(torch.int32).repeat_interleave(group, dim=0)).float()
    assert torch.equal(got, want)


def test_zero_pair_bits_match_the_float_values():
    # the kernel adds z (or c z) to these bits instead of converting -(OFF + z) per step
    for dtype in (torch.bfloat16, torch.float16):
        _, off, _, _, _, c = mk.pair_constants(dtype)
        even, odd = mk._NZ[dtype]
        for z in range(16):
            assert torch.tensor(even + z, dtype=torch.int32).to(torch.int16).view(dtype).item() == -(off + z)
            assert torch.tensor(odd + int(c) * z, dtype=torch.int32).to(torch.int16).view(dtype).item() == -(off / c + z)


def test_program_steps_divide_k():
    cfg = mk.MMA8Config(128, 8, 4)
    assert mk.program_steps(cfg, 4096) == 8 and mk.program_steps(cfg, 896) == 7 and mk.program_steps(cfg, 256) == 2


def test_wrapper_refuses_what_it_cannot_take():
    qw = torch.zeros(64, 128, dtype=torch.int32)
    s, z = torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(4, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="1-8 rows"):
        mk.wna16_mma8_linear(torch.zeros(9, 512, dtype=torch.bfloat16), qw, s, z, 128, mk.MMA8Config(64, 2, 4))
    with pytest.raises(ValueError, match="multiple of 16 x num_warps"):
        mk.wna16_mma8_linear(torch.zeros(1, 512, dtype=torch.bfloat16), qw, s, z, 128, mk.MMA8Config(32, 2, 4))
    assert not mk.mma8_supported(torch.zeros(1, 512, dtype=torch.bfloat16), 512, 128, 4)  # CPU


@pytest.mark.skipif(not _CUDA, reason="Gluon kernels need a GPU")
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [mk.MMA8Config(64, 2, 4), mk.MMA8Config(128, 8, 2), mk.MMA8Config(64, 4, 1),
                                 mk.MMA8Config(128, 4, 4, True), mk.MMA8Config(256, 2, 4, True)])
def test_kernel_matches_reference(m, dtype, cfg):
    g = torch.Generator(device="cuda").manual_seed(m)
    k, n, group = 1024, 320, 128  # 320 columns: a ragged last column block for BLOCK_N 128
    q = torch.randint(0, 16, (k, n), generator=g, device="cuda", dtype=torch.int32)
    s = (torch.rand(k // group, n, generator=g, device="cuda") * 0.02 + 0.001).to(dtype)
    z = torch.randint(0, 16, (k // group, n), generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    bias = torch.randn(n, generator=g, device="cuda").to(dtype)
    qw = pack_along_k(q, 4)
    perm = torch.randperm(k, generator=g, device="cuda")
    for b, p in ((None, None), (bias, None), (None, perm)):
        out = mk.wna16_mma8_linear(x, qw, s, z, group, cfg, b, p)
        ref = wna16_linear_ref(x.float(), qw, s.float(), z, 4, group, p, None if b is None else b.float())
        assert (out.float() - ref).abs().max() <= 8e-3 * ref.abs().max()
