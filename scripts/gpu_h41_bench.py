"""Branch h41's kernel A/B on the GPU at DeepSeek-V2-Lite's shapes (CUDA-graph replay, bf16), ~15 s:

moe     fused_experts with the 2 shared experts stacked after the 64 routed ones (top 6 + 2) at decode
        batches of 128 / 256 tokens: SiLU in GEMM 1 or separate, program groups GROUP_M 8 or 1 (before), against
        the floor (every expert hit read once at the copy bandwidth measured here); Qwen3-30B-A3B's
        experts at 256 tokens, now and before
decode  mla_decode at W1-like batches (lengths uniform in [0.1, 2] x the mean): choose_num_splits's
        equal splits against fixed partitions of 256 / 512 keys (split_chunk), with the latent floor

    PYTHONPATH=$PWD python3 scripts/gpu_h41_bench.py
"""

from __future__ import annotations

import functools
import random

import torch
from _gpu_common import copy_bandwidth, graph_time_us, shuffled_decode_metadata

from pagedllm.kernels.fused_moe import _config, fused_experts
from pagedllm.kernels.mla_decode import mla_decode, mla_decode_ref
from pagedllm.kernels.moe_router import topk_softmax

E, S, TOP_K, HIDDEN, INTER = 64, 2, 6, 2048, 1408
H, R, P, BS = 16, 512, 64, 16


def moe(bw: float, rows: list) -> None:
    w13 = (torch.randn(E + S, 2 * INTER, HIDDEN, device="cuda") * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E + S, HIDDEN, INTER, device="cuda") * 0.02).to(torch.bfloat16)
    for t in (128, 256):
        x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
        weights, ids = topk_softmax(torch.randn(t, E, device="cuda"), TOP_K, False, num_shared=S)
        hit = int(torch.unique(ids).numel())
        floor = hit * 3 * HIDDEN * INTER * 2 / bw * 1e6
        base = _config(t * (TOP_K + S), torch.bfloat16)
        ref = None
        for name, extra in (("SiLU in GEMM 1, GROUP_M 8 (now)", {}), ("SiLU separate, GROUP_M 8", dict(FUSE_SILU=False)),
                            ("SiLU separate, GROUP_M 1 (before)", dict(FUSE_SILU=False, GROUP_M=1))):
            cfg = dict(base, **extra)
            run = functools.partial(fused_experts, x, w13, w2, weights, ids, config=cfg)
            out = run().float()
            ref = out if ref is None else ref
            err = ((out - ref).norm() / ref.norm()).item()
            us = graph_time_us(run)
            rows.append(("moe", f"{t} tokens, {hit} experts", name, us, floor, f"diff vs first {err:.1e}"))
    del w13, w2
    # Qwen3-30B-A3B's experts (128, top 8, 2048 -> 768, no shared): the same kernel changes, now / before.
    w13 = (torch.randn(128, 2 * 768, HIDDEN, device="cuda") * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(128, HIDDEN, 768, device="cuda") * 0.02).to(torch.bfloat16)
    t = 256
    x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weights, ids = topk_softmax(torch.randn(t, 128, device="cuda"), 8, True)
    floor = int(torch.unique(ids).numel()) * 3 * HIDDEN * 768 * 2 / bw * 1e6
    base = _config(t * 8, torch.bfloat16)
    for name, extra in (("Qwen3-30B-A3B: SiLU in GEMM 1, GROUP_M 8", {}),
                        ("Qwen3-30B-A3B: before", dict(FUSE_SILU=False, GROUP_M=1))):
        us = graph_time_us(functools.partial(fused_experts, x, w13, w2, weights, ids, config=dict(base, **extra)))
        rows.append(("moe", f"{t} tokens, 128 experts", name, us, floor, ""))


def decode(bw: float, rows: list) -> None:
    for n, ctx in ((256, 700), (128, 900), (64, 1100)):
        rng = random.Random(n)
        s_lens = [max(1, int(ctx * rng.uniform(0.1, 2.0))) for _ in range(n)]
        md, num_blocks = shuffled_decode_metadata(s_lens, BS, rng)
        cache = (torch.randn(1, num_blocks, BS, 1, R + P, device="cuda") * 0.5).to(torch.bfloat16)
        q = (torch.randn(n, H, R + P, device="cuda") * 0.1).to(torch.bfloat16)
        ref = mla_decode_ref(q.float(), cache.float(), md, 0.1, R)
        floor = sum(s_lens) * (R + P) * 2 / bw * 1e6
        for name, kw in (("auto splits (now)", {}), ("chunks of 256", dict(split_chunk=256)),
                         ("chunks of 512", dict(split_chunk=512))):
            run = functools.partial(mla_decode, q, cache, md, 0.1, R, **kw)
            err = ((run().float() - ref).norm() / ref.norm()).item()
            us = graph_time_us(run)
            rows.append(("mla_decode", f"{n} reqs, mean ctx {sum(s_lens) // n}", name, us, floor, f"rel err {err:.1e}"))


class _Rows(list):
    """Each row printed as it is appended: a run cut short by its timeout keeps what it measured."""

    def append(self, row) -> None:
        super().append(row)
        kernel, case, name, us, floor, note = row
        print(f"| {kernel} | {case} | {name} | {us:.1f} | {floor:.1f} | {floor / us * 100:.0f}% | {note} |", flush=True)


def main() -> None:
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; per layer call, CUDA-graph replay")
    print("| kernel | case | variant | us | floor us | fraction | note |\n|---|---|---|---|---|---|---|", flush=True)
    rows = _Rows()
    for section in (moe, decode):
        try:
            section(bw, rows)
        except Exception as exc:  # one section failing must not hide the other's rows
            rows.append((section.__name__, "", f"ERROR {exc!r}"[:90], float("nan"), float("nan"), ""))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
