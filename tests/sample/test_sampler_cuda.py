"""The sampler on CUDA: same answers as on CPU where they are deterministic, and no host sync.

Skipped where there is no GPU (CI); run on a GPU machine with `pytest tests/sample`.
"""

import pytest
import torch

from pagedllm.sample import RowInputs, Sampler, SamplingMetadata, new_generator
from pagedllm.sampling_params import SamplingParams as SP

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

V = 1000


def _params() -> list[SP]:
    # Every feature in one batch, greedy and sampled rows mixed.
    return [
        SP(temperature=0.0, logprobs=3, repetition_penalty=1.3),
        SP(temperature=0.8, top_p=0.9, seed=11),
        SP(temperature=1.0, top_k=20, seed=12, logprobs=0),
        SP(temperature=0.0, logit_bias={5: 30.0}, min_tokens=4, stop_token_ids=[7]),
        SP(temperature=1.2, top_k=50, top_p=0.8, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3),
        SP(temperature=0.0, min_tokens=3, stop_token_ids=[1, 2, 3], frequency_penalty=1.0),
    ]


def _rows(device: str, params: list[SP]) -> list[RowInputs]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, p in enumerate(params):
        prompt = torch.randint(0, V, (10 + i,), generator=g).tolist()
        output = torch.randint(0, V, (i,), generator=g).tolist()
        gen = new_generator(p.seed, device) if p.seed is not None else None
        rows.append(RowInputs(p, prompt, output, gen))
    return rows


@pytest.fixture
def sync_is_error():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_build_and_forward_without_host_sync(sync_is_error):
    logits = torch.randn(6, V, device="cuda")
    for _ in range(2):  # the second step also reuses the cached pinned buffers
        md = SamplingMetadata.build(_rows("cuda", _params()), V, "cuda")
        out = Sampler()(logits.clone(), md)
    assert out.sampled_token_ids.device.type == "cuda"
    # The all-greedy and all-seeded shortcuts too.
    for params in ([SP(temperature=0.0)] * 3, [SP(seed=s, top_k=5) for s in range(3)]):
        md = SamplingMetadata.build(_rows("cuda", params), V, "cuda")
        Sampler()(logits[:3].clone(), md)


def test_cuda_matches_cpu_where_deterministic():
    logits = torch.randn(6, V)
    params = _params()
    cpu = Sampler()(logits.clone(), SamplingMetadata.build(_rows("cpu", params), V, "cpu"))
    gpu = Sampler()(logits.cuda(), SamplingMetadata.build(_rows("cuda", params), V, "cuda"))
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    assert gpu.sampled_token_ids.cpu()[greedy].tolist() == cpu.sampled_token_ids[greedy].tolist()
    ids = gpu.sampled_token_ids.cpu()
    ref = torch.log_softmax(logits, dim=-1)
    lp = gpu.logprobs
    assert torch.allclose(lp.logprobs.cpu(), ref.gather(1, lp.logprob_token_ids.cpu()), atol=1e-5)
    assert torch.equal(lp.logprob_token_ids.cpu()[:, 0], ids)
    ranks = [1 + int((ref[r] > ref[r, ids[r]]).sum()) for r in range(6)]
    assert lp.selected_token_ranks.cpu().tolist() == ranks


def test_seeded_row_is_batch_independent_on_cuda():
    row = torch.randn(V, device="cuda")
    p = SP(temperature=1.0, top_p=0.95, seed=42)
    picks = []
    for others, pos in (([SP()], 0), ([SP(top_k=3), SP(temperature=0.0), SP(seed=9), SP()], 3)):
        params = list(others)
        params.insert(pos, p)
        logits = torch.randn(len(params), V, device="cuda") * 3
        logits[pos] = row
        gen_tokens = []
        rows = _rows("cuda", params)
        for _ in range(4):
            out = Sampler()(logits.clone(), SamplingMetadata.build(rows, V, "cuda"))
            gen_tokens.append(int(out.sampled_token_ids[pos]))
        picks.append(gen_tokens)
    assert picks[0] == picks[1]


def test_bf16_fast_path_equals_float32_copy():
    # Temperature-only rows take the fused Gumbel-max kernel straight from bf16; its seed comes
    # from torch's CPU generator, so reseeding gives the float32 copy the same draws. With logprobs
    # the batch is cast once up front, and the kernel reads that float32 copy.
    logits = (torch.randn(8, V, device="cuda") * 2).to(torch.bfloat16)
    plain = [SP(temperature=0.6), SP(temperature=0.0), SP(temperature=1.0), SP()] * 2
    with_logprobs = plain[:-1] + [SP(temperature=0.9, logprobs=2)]
    for params in (plain, with_logprobs):
        outs = []
        for x in (logits, logits.float()):
            torch.manual_seed(0)
            outs.append(Sampler()(x, SamplingMetadata.build(_rows("cuda", params), V, "cuda")))
        assert torch.equal(outs[0].sampled_token_ids, outs[1].sampled_token_ids)
        if outs[0].logprobs is not None:
            for a, b in zip(outs[0].logprobs, outs[1].logprobs, strict=True):
                assert torch.equal(a, b)


def test_grammar_bitmask_in_the_kernel_equals_masking_first():
    # Structured outputs, every row constrained: the fused kernel applies the bitmask itself; the ids
    # are those of masking the logits first (same seed), every one allowed; with logprobs the
    # sampler masks before step 1.
    from pagedllm.kernels.grammar_bitmask import apply_bitmask_inplace

    logits = (torch.randn(8, V, device="cuda") * 2).to(torch.bfloat16)
    bitmask = torch.randint(-2**31, 2**31 - 1, (8, (V + 31) // 32), dtype=torch.int32, device="cuda")
    for params in ([SP(temperature=0.8), SP(temperature=0.0)] * 4, [SP(temperature=0.8, logprobs=1)] * 8):
        outs = []
        for fused in (True, False):
            md = SamplingMetadata.build(_rows("cuda", params), V, "cuda")
            torch.manual_seed(0)
            x = logits.clone()
            outs.append(Sampler()(x, md, bitmask) if fused else Sampler()(apply_bitmask_inplace(x, bitmask, None), md))
        ids = outs[0].sampled_token_ids
        assert torch.equal(ids, outs[1].sampled_token_ids)
        assert bool(((bitmask[torch.arange(8, device="cuda"), ids // 32] >> (ids % 32)) & 1).all())
