"""The fused MoE Triton kernel (interpreter on CPU) equals the plain torch experts."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.fused_moe import fused_experts
from pagedllm.kernels.moe_align import moe_align_block_size, moe_align_block_size_ref
from pagedllm.layers.fused_moe.router import select_experts
from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_align_groups_pairs_by_expert_and_pads_runs():
    ids = torch.tensor([[2, 0], [2, 1]], dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids, ntpp = moe_align_block_size_ref(ids, 4, num_experts=3)
    pad = 4
    assert sorted_ids.tolist()[:12] == [1, pad, pad, pad, 3, pad, pad, pad, 0, 2, pad, pad]
    assert expert_ids.tolist()[:3] == [0, 1, 2]
    assert ntpp.tolist() == [12]


@pytest.mark.parametrize("t, top_k, e, block_m", [(2, 2, 3, 4), (1, 8, 128, 16), (300, 8, 128, 64), (700, 6, 64, 16)])
def test_align_kernel_matches_reference(t, top_k, e, block_m):
    # The kernel takes rows within an expert's run with atomics: the same pairs per run, any order.
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).int().to(DEVICE)
    got = moe_align_block_size(ids, block_m, e)
    ref = moe_align_block_size_ref(ids, block_m, e)
    assert got[1].tolist() == ref[1].tolist() and got[2].tolist() == ref[2].tolist()

    def pairs_by_expert(sorted_ids, expert_ids, ntpp):
        out: dict[int, list[int]] = {}
        for b in range(int(ntpp[0]) // block_m):
            out.setdefault(int(expert_ids[b]), []).extend(sorted_ids[b * block_m:(b + 1) * block_m].tolist())
        return {ex: sorted(p) for ex, p in out.items()}

    assert pairs_by_expert(*got) == pairs_by_expert(*ref)
    assert set(got[0].tolist()) == set(range(t * top_k + 1))  # every pair once (plus the padding id)


@pytest.mark.parametrize("t, top_k, e, block_m", [(2, 2, 3, 4), (300, 8, 128, 64), (700, 6, 64, 16), (50, 8, 66, 128)])
def test_align_from_row_lists_equals_reference(t, top_k, e, block_m):
    # The two-launch align (per-expert lists, then padded runs) keeps pair order inside a run, as the
    # reference's stable sort: the same list row for row up to the padded count, the same expert ids.
    from pagedllm.kernels.moe_align import moe_align_block_size_rows

    g = torch.Generator().manual_seed(t + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).int().to(DEVICE)
    got = moe_align_block_size_rows(ids, block_m, e)
    ref = moe_align_block_size_ref(ids, block_m, e)
    n = int(ref[2][0])
    assert got[2].tolist() == [n]
    assert got[0][:n].tolist() == ref[0][:n].tolist()
    assert got[1][: n // block_m].tolist() == ref[1][: n // block_m].tolist()


@pytest.mark.parametrize("t, e, top_k, hidden, inter, dtype", [
    (5, 4, 2, 64, 32, torch.float32),   # decode-sized, some experts idle
    (37, 8, 3, 32, 48, torch.float32),  # inter not a multiple of BLOCK_N
    (300, 4, 2, 32, 32, torch.float32),  # the large-M tile config
    (9, 6, 2, 64, 64, torch.float16),
    (9, 6, 2, 64, 64, torch.bfloat16),
])
def test_fused_experts_matches_reference(t, e, top_k, hidden, inter, dtype):
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly (garbage ~1e10); runs on GPU")
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, hidden, generator=g).to(dtype).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.2).to(dtype).to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 0.2).to(dtype).to(DEVICE)
    logits = torch.randn(t, e, generator=g).to(DEVICE)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    got = fused_experts(x, w13, w2, weights, ids)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    # Half precision: the reference rounds after each GEMM, the kernel accumulates in fp32 (a wrong expert is O(1)).
    tol = {torch.float32: 1e-4, torch.float16: 3e-2}.get(dtype, 6e-2)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_fused_experts_rejects_mismatched_shapes():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="do not agree"):
        fused_experts(x, torch.zeros(2, 8, 8), torch.zeros(2, 8, 3), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32))


@pytest.mark.parametrize("t, inter", [(5, 32), (37, 48)])
def test_silu_in_the_first_gemm_equals_the_separate_kernel(t, inter):
    # Small tiles compute SiLU-and-mul in GEMM 1's epilogue; a tile past FUSED_SILU_MAX_TILE runs GEMM 1
    # into [gate | up] and kernels/activation.py's silu_and_mul after it. Same K tiles: the same sums.
    from pagedllm.kernels.moe_grouped_gemm import FUSED_SILU_MAX_TILE

    g = torch.Generator().manual_seed(t)
    e, top_k, hidden = 6, 2, 64
    x = torch.randn(t, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 0.2).to(DEVICE)
    weights, ids = select_experts(torch.randn(t, e, generator=g).to(DEVICE), top_k, renormalize=True)
    fused = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)
    separate = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=2)
    assert fused["BLOCK_M"] * fused["BLOCK_N"] <= FUSED_SILU_MAX_TILE < separate["BLOCK_M"] * separate["BLOCK_N"]
    a = fused_experts(x, w13, w2, weights, ids, config=fused)
    b = fused_experts(x, w13, w2, weights, ids, config=separate)
    # 1e-5: the interpreter's tl.dot (numpy) may sum a 128-wide tile in another order than a 64-wide one.
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, fused_experts_ref(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_down_gemm_takes_its_own_tiles():
    # GEMM 2 with its own BLOCK_N / BLOCK_K (config["DOWN"]) computes the same experts; BLOCK_M must stay.
    g = torch.Generator().manual_seed(3)
    t, e, top_k, hidden, inter = 21, 5, 2, 96, 48
    x = torch.randn(t, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 0.2).to(DEVICE)
    weights, ids = select_experts(torch.randn(t, e, generator=g).to(DEVICE), top_k, renormalize=True)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2,
               DOWN=dict(BLOCK_N=64, BLOCK_K=16, num_stages=3, GROUP_M=1))
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, config=cfg),
                               fused_experts_ref(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="BLOCK_M"):
        fused_experts(x, w13, w2, weights, ids, config=dict(cfg, DOWN=dict(BLOCK_M=32)))


@pytest.mark.parametrize("fuse_silu", [True, False])
def test_tma_weight_tiles_equal_the_pointer_kernel(fuse_silu):
    # inter 48 over BLOCK_N 32: the last column block's TMA tile reaches into the next expert's rows
    # (computed, not stored); GEMM 2's K = 48 over BLOCK_K 32: the descriptor zero-fills past K.
    g = torch.Generator().manual_seed(5)
    t, e, top_k, hidden, inter = 40, 4, 2, 64, 48
    x = torch.randn(t, hidden, generator=g).half().to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.2).half().to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 0.2).half().to(DEVICE)
    weights, ids = select_experts(torch.randn(t, e, generator=g).to(DEVICE), top_k, renormalize=True)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2, FUSE_SILU=fuse_silu)
    pointer = fused_experts(x, w13, w2, weights, ids, config=cfg)
    tma = fused_experts(x, w13, w2, weights, ids, config=dict(cfg, TMA=True))
    # The same tiles and K order; on a GPU the two kernels may still pick different MMA layouts.
    torch.testing.assert_close(tma, pointer, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(tma.float(), fused_experts_ref(x, w13, w2, weights, ids).float(), atol=3e-2, rtol=3e-2)


def test_expert_row_lists_hold_each_experts_pairs_in_order():
    from pagedllm.kernels.moe_align import _moe_expert_rows_kernel

    ids = torch.tensor([3, 1, 3, 0, 3, 1], dtype=torch.int32, device=DEVICE)
    rows = torch.full((4, 6), -7, dtype=torch.int32, device=DEVICE)
    counts = torch.empty(4, dtype=torch.int32, device=DEVICE)
    _moe_expert_rows_kernel[(4,)](ids, rows, counts, 6, 6, CHUNK=4)  # two chunks: the rank carries over
    assert counts.tolist() == [1, 2, 0, 3]
    assert [rows[e, :c].tolist() for e, c in enumerate(counts.tolist())] == [[3], [1, 5], [], [0, 2, 4]]


@pytest.mark.parametrize("t, e, top_k, block_m", [
    (5, 4, 2, 16),    # decode-sized: one row block per expert, some experts idle
    (1, 8, 2, 16),    # one token
    (300, 4, 2, 16),  # ~150 pairs per expert: ten row blocks each, weights read once per block
    (37, 8, 3, 64),
])
def test_row_list_path_matches_reference(t, e, top_k, block_m):
    g = torch.Generator().manual_seed(t)
    hidden, inter = 32, 48  # inter not a multiple of BLOCK_N
    x = torch.randn(t, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 0.2).to(DEVICE)
    weights, ids = select_experts(torch.randn(t, e, generator=g).to(DEVICE), top_k, renormalize=True)
    cfg = dict(SCAN=True, BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2, DOWN=dict(BLOCK_N=16))
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, config=cfg),
                               fused_experts_ref(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("t, e, top_k, shared, block_m", [
    (5, 6, 2, 2, 16),    # routed top_k 2 of 4, 2 shared: one token chunk per shared expert
    (40, 6, 3, 2, 16),   # three chunks (40 tokens / 16), the last ragged
    (1, 5, 2, 1, 16),    # one token
    (37, 9, 4, 1, 32),
])
def test_row_list_path_with_shared_experts_matches_reference(t, e, top_k, shared, block_m):
    # DeepSeek's layout: the last `shared` experts take every token at weight 1 (select_experts appends
    # them); their programs compute the pairs of BLOCK_M-token chunks instead of reading a list.
    g = torch.Generator().manual_seed(t + shared)
    hidden, inter = 32, 48
    x = torch.randn(t, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 0.2).to(DEVICE)
    weights, ids = select_experts(torch.randn(t, e - shared, generator=g).to(DEVICE), top_k, True,
                                  num_fused_shared_experts=shared)  # (t, top_k + shared)
    cfg = dict(SCAN=True, BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2, DOWN=dict(BLOCK_N=16))
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, config=cfg, shared_experts=shared),
                               fused_experts_ref(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_decode_batches_take_the_row_lists():
    from pagedllm.kernels.moe_row_lists import _scan_config

    assert _scan_config(256 * 8, 128, torch.bfloat16)["BLOCK_M"] == 32  # Qwen3-30B-A3B at 256 tokens
    assert _scan_config(128 * 8, 128, torch.bfloat16)["BLOCK_M"] == 16
    assert _scan_config(8, 128, torch.bfloat16)["BLOCK_M"] == 16
    assert _scan_config(384 * 8, 128, torch.bfloat16) is None  # 24 pairs an expert: the align path
    assert _scan_config(1024 * 8, 128, torch.bfloat16) is None  # prefill sizes: the align path
    # With shared experts (every token on the last S): the row lists by the routed pairs (default
    # PAGEDLLM_MOE_SCAN_SHARED), the align path past them; the same result either way.
    g = torch.Generator().manual_seed(1)
    t, e, hidden, inter = 6, 5, 32, 32
    x = torch.randn(t, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 0.2).to(DEVICE)
    weights, ids = select_experts(torch.randn(t, e - 1, generator=g).to(DEVICE), 2, True, num_fused_shared_experts=1)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, shared_experts=1),
                               fused_experts_ref(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)
    align = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)  # the align path, shared experts
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, config=align, shared_experts=1),
                               fused_experts_ref(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_shared_experts_take_the_row_lists_when_switched_on(monkeypatch):
    # PAGEDLLM_MOE_SCAN_SHARED=1: the routed experts' pairs pick the tiles (DeepSeek-V2-Lite at 128
    # tokens: 12 routed pairs an expert -> 32 rows), and the result stays the reference's.
    from pagedllm.kernels import fused_moe as fm

    assert fm._scan_config(128 * 6, 64, torch.bfloat16)["BLOCK_M"] == 32
    scan, shared_seen = fm._fused_experts_scan, []

    def spy(*args):
        shared_seen.append(args[-1])
        return scan(*args)

    monkeypatch.setattr(fm, "_SCAN_SHARED", True)
    monkeypatch.setattr(fm, "_fused_experts_scan", spy)
    g = torch.Generator().manual_seed(3)
    t, e, hidden, inter = 7, 6, 32, 32
    x = torch.randn(t, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 0.2).to(DEVICE)
    weights, ids = select_experts(torch.randn(t, e - 2, generator=g).to(DEVICE), 2, True, num_fused_shared_experts=2)
    torch.testing.assert_close(fm.fused_experts(x, w13, w2, weights, ids, shared_experts=2),
                               fused_experts_ref(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)
    assert shared_seen == [2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_sum_equals_torch_sum(dtype):
    from pagedllm.kernels.moe_sum import moe_sum

    g = torch.Generator().manual_seed(2)
    down = torch.randn(7 * 3, 1500, generator=g).to(dtype).to(DEVICE)  # hidden past one 1024-wide block
    ref = down.view(7, 3, 1500).float().sum(dim=1).to(dtype)
    # fp32 exactly; bf16 within one unit of the last place (Triton's interpreter rounds fp32 -> bf16
    # by truncation, the GPU to nearest).
    tol = 0 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(moe_sum(down, 3), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("t", [5, 300])  # the row-list path and the align path
def test_unsummed_topk_outputs_sum_to_the_summed_call(t):
    from pagedllm.kernels.moe_sum import moe_sum

    g = torch.Generator().manual_seed(t)
    e, top_k, hidden, inter = 4, 2, 32, 32
    x = torch.randn(t, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 0.2).to(DEVICE)
    weights, ids = select_experts(torch.randn(t, e, generator=g).to(DEVICE), top_k, renormalize=True)
    parts = fused_experts(x, w13, w2, weights, ids, sum_topk=False)
    assert parts.shape == (t, top_k, hidden)
    torch.testing.assert_close(moe_sum(parts.reshape(t * top_k, hidden), top_k), fused_experts(x, w13, w2, weights, ids),
                               atol=0, rtol=0)
