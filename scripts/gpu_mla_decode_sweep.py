"""The MLA decode kernel (kernels/mla_decode.py) on the GPU: correctness against the torch reference and
time per layer-step for DeepSeek-V2-Lite's shape (16 heads, 512 + 64 latent, bf16, block size 16), every
(TILE_N, num_warps, num_stages) variant and split count, beside the unified kernel it replaces and the
floor (the batch's latent bytes at the copy bandwidth measured here). CUDA-graph replay. ~1 min.

    PYTHONPATH=$PWD python3 scripts/gpu_mla_decode_sweep.py
"""

from __future__ import annotations

import functools
import random

import torch
from _gpu_common import copy_bandwidth, graph_time_us, shuffled_decode_metadata

from pagedllm.kernels.mla_decode import mla_decode, mla_decode_ref
from pagedllm.kernels.paged_attention import paged_attention

H, R, P, BS = 16, 512, 64, 16
TILES = [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 8, 2), (16, 4, 2)]
SPLITS = (None, 1, 8, "c512")  # None: choose_num_splits's pick; "cK": fixed partitions of K keys
CASES = ((256, 800), (64, 1500), (8, 3000))  # (decode requests, mean context)


def main() -> None:
    bw = copy_bandwidth()
    rows = []
    for n, ctx in CASES:
        rng = random.Random(n)
        s_lens = [max(1, int(ctx * rng.uniform(0.5, 1.5))) for _ in range(n)]
        md, num_blocks = shuffled_decode_metadata(s_lens, BS, rng)
        cache = (torch.randn(1, num_blocks, BS, 1, R + P, device="cuda") * 0.5).to(torch.bfloat16)
        q = (torch.randn(n, H, R + P, device="cuda") * 0.1).to(torch.bfloat16)
        ref = mla_decode_ref(q.float(), cache.float(), md, 0.1, R)
        err = ((mla_decode(q, cache, md, 0.1, R).float() - ref).norm() / ref.norm()).item()
        floor = sum(s_lens) * (R + P) * 2 / bw * 1e6
        kv = cache.expand(2, *cache.shape[1:])
        us = graph_time_us(functools.partial(paged_attention, q, kv, md, 0.1))
        rows.append((n, ctx, "unified kernel (before)", "", us, floor, ""))
        for tile in TILES:
            for splits in SPLITS:
                # "c512": fixed partitions of 512 keys (mla_decode's split_chunk); else a split count.
                kw = dict(split_chunk=int(splits[1:])) if isinstance(splits, str) else dict(num_splits=splits)
                try:
                    run = functools.partial(mla_decode, q, cache, md, 0.1, R, tile=tile, **kw)
                    if isinstance(splits, str):
                        kw["err"] = ((run().float() - ref).norm() / ref.norm()).item()
                    us = graph_time_us(run)
                except Exception as exc:  # a variant out of shared memory must not hide the others
                    rows.append((n, ctx, f"tile {tile}", str(splits), float("nan"), floor, repr(exc)[:60]))
                    continue
                note = f"rel err {kw.get('err', err):.1e}" if (tile == TILES[0] and splits is None) or "err" in kw else ""
                rows.append((n, ctx, f"tile {tile}", "auto" if splits is None else str(splits), us, floor, note))
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; DeepSeek-V2-Lite latent (16 heads, 512 + 64), bf16, per layer-step")
    print("| batch | mean ctx | kernel | splits | us | floor us | fraction | note |\n|---|---|---|---|---|---|---|---|")
    for n, ctx, name, splits, us, floor, note in rows:
        print(f"| {n} | {ctx} | {name} | {splits} | {us:.1f} | {floor:.1f} | {floor / us * 100:.0f}% | {note} |")


if __name__ == "__main__":
    main()
