"""The KV cache's memory order on one H200: token-major "NHD" (block, slot, kv head, dim; the default) against
head-major "HND" (block, kv head, slot, dim; PAGEDLLM_KV_CACHE_LAYOUT=HND), kernel by kernel.

    python3 scripts/gpu_kv_layout_probe.py [--budget 120] [--sections attn,stream,prefill]

Both layouts hold the same values in a tensor of the same shape, (2, num_blocks, 16, kv heads, head_dim); only
the strides differ, which every kernel takes. With NHD a program's keys of one block are 16 rows of 256 bytes
(bf16, head_dim 128) 2 KB apart (8 kv heads); with HND one 4 KB run.

Sections (Llama-3.1-8B heads: 32 / 8, head_dim 128; blocks of 16, shuffled; CUDA-graph replays):
  attn     the fused decode kernel (`decode_attention_fused`, what the decode graphs run) at W1-like batches
           (256 x 600-1000 keys, 64 x 900-1500) and a long-context one (64 x 2800-4000), bf16 and fp8 caches,
           a few (BLOCK_M, TILE_N, warps, stages); each HND output held to the NHD one of the same config
           (bitwise: the same values in the same order), TB/s of the K / V bytes.
  stream   the same batches' K / V bytes only read and summed (the access pattern's own bandwidth).
  prefill  `paged_attention` of a mixed 8192-token step (prompt chunks + 40 decodes) and the fused rotary +
           K/V write of 8192 tokens, both layouts.
Prints the table last.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

T0 = time.monotonic()
ROWS: list[str] = []
CASES = {"decode256": (256, 600, 1000), "decode64": (64, 900, 1500), "long64": (64, 2800, 4000)}
CONFIGS = {  # cache -> [(variant, config or None = the dispatch's own)]
    "bf16": [(0, None), (0, (16, 64, 4, 2)), (0, (16, 64, 4, 3)), (0, (16, 128, 4, 2)), (0, (16, 128, 4, 3)),
             (0, (16, 128, 8, 3)), (0, (16, 256, 8, 2))],
    "fp8": [(3, None), (3, (16, 64, 4, 3)), (3, (16, 64, 4, 2)), (3, (16, 128, 4, 2)), (3, (16, 256, 8, 2)),
            (0, None)],
}


def left(budget: float) -> float:
    return budget - (time.monotonic() - T0)


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:5.1f} s] {msg}", flush=True)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values in HND memory order (as the worker allocates it), the same (2, blocks, slots, heads, dim) shape."""
    from pagedllm.worker import kv_cache

    out = kv_cache.head_major(torch.empty, cache.shape, dtype=cache.dtype, device=cache.device)
    out.copy_(cache)
    return out


def decode_case(kind: str, kv_dtype: torch.dtype, seed: int = 0):
    from _gpu_common import shuffled_decode_metadata

    from pagedllm.kernels.rotary import build_cos_sin_cache

    n, lo, hi = CASES[kind]
    rng = random.Random(seed)
    md, blocks = shuffled_decode_metadata([rng.randint(lo, hi) for _ in range(n)], 16, rng)
    torch.manual_seed(seed)
    cache = torch.randn(2, blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    qkv = torch.randn(n, 48 * 128, device="cuda", dtype=torch.bfloat16)
    positions = (md.seq_lens[:n] - 1).to(torch.int64)
    kv_bytes = int(md.seq_lens[:n].sum()) * 8 * 128 * 2 * cache.element_size()
    return qkv, positions, build_cos_sin_cache(128, 4096).cuda(), cache, md, kv_bytes


def graph_us(fn, reps: int = 20) -> float:
    from _gpu_common import rotating_graph_us

    return rotating_graph_us(lambda i: fn(), 1, reps)


def section_attn(budget: float) -> None:
    from pagedllm.kernels.decode_attention import decode_attention_fused

    for kind in CASES:
        for cname, dt in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            qkv, pos, cs, cache, md, kv_bytes = decode_case(kind, dt)
            layouts = {"NHD": cache, "HND": head_major(cache)}
            for variant, cfg in CONFIGS[cname]:
                cells, outs = [], {}
                for lname, c in layouts.items():
                    if left(budget) < 2:
                        log("attn: budget spent")
                        return
                    try:
                        work = c.clone() if lname == "NHD" else head_major(c)
                        run = functools.partial(decode_attention_fused, qkv, pos, cs, work, md, 0.088, 32, 8, 128,
                                                variant=variant, config=cfg)
                        outs[lname] = run()
                        us = graph_us(run)
                        cells.append(f"{us:.1f} ({kv_bytes / us / 1e6:.2f})")
                    except Exception as e:  # noqa: BLE001 - a config over the shared memory etc.
                        cells.append(f"ERR {type(e).__name__}: {str(e)[:60]}")
                same = "bitwise" if len(outs) == 2 and torch.equal(outs["NHD"], outs["HND"]) else (
                    f"max diff {(outs['NHD'].float() - outs['HND'].float()).abs().max().item():.1e}"
                    if len(outs) == 2 else "-")
                row = f"| attn {kind} {cname} v{variant} {cfg or 'dispatch'} | {cells[0]} | {cells[-1]} | {same} |"
                ROWS.append(row)
                log(row)
            del layouts, cache
            torch.cuda.empty_cache()


def section_stream(budget: float) -> None:
    from gpu_fp8_w1_probe import stream_kv

    for kind in CASES:
        for cname, dt in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            _, _, _, cache, md, kv_bytes = decode_case(kind, dt)
            cells = []
            for c in (cache, head_major(cache)):
                if left(budget) < 1:
                    log("stream: budget spent")
                    return
                out = torch.empty(md.num_reqs * 8, device="cuda")
                us = graph_us(functools.partial(stream_kv, out, c[0], c[1], md, 1, 128 if cname == "bf16" else 64,
                                                4, 3))
                cells.append(f"{us:.1f} ({kv_bytes / us / 1e6:.2f})")
            row = f"| stream {kind} {cname} (1 head a program) | {cells[0]} | {cells[1]} | |"
            ROWS.append(row)
            log(row)


def section_prefill(budget: float) -> None:
    from attn_sweep import case

    from pagedllm.kernels.paged_attention import paged_attention
    from pagedllm.kernels.qkv_prep import fused_qkv_prep
    from pagedllm.kernels.rotary import build_cos_sin_cache

    q, cache, md, kv_bytes = case("mixed8192", 32, 8)
    hnd = head_major(cache)
    outs, cells = [], []
    for c in (cache, hnd):
        run = functools.partial(paged_attention, q, c, md, 0.088)
        outs.append(run())
        cells.append(f"{graph_us(run):.1f}")
    same = "bitwise" if torch.equal(outs[0], outs[1]) else f"max diff {(outs[0] - outs[1]).abs().max().item():.1e}"
    ROWS.append(f"| prefill attention, mixed 8192-token step | {cells[0]} | {cells[1]} | {same} |")
    log(ROWS[-1])
    n = q.shape[0]
    qkv = torch.randn(n, 48 * 128, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(n, device="cuda") % 4096
    cs = build_cos_sin_cache(128, 4096).cuda()
    cells, caches = [], []
    for c in (cache.clone(), head_major(cache)):
        run = functools.partial(fused_qkv_prep, qkv, positions, cs, c, md.slot_mapping[:n], 32, 8, 128)
        run()
        cells.append(f"{graph_us(run):.1f}")
        caches.append(c)
    same = "bitwise" if torch.equal(caches[0], caches[1]) else "DIFFERS"
    ROWS.append(f"| rotary + K/V write, {n} tokens | {cells[0]} | {cells[1]} | cache {same} |")
    log(ROWS[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=120.0)
    ap.add_argument("--sections", default="attn,stream,prefill")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    runners = {"attn": section_attn, "stream": section_stream, "prefill": section_prefill}
    for name in args.sections.split(","):
        try:
            runners[name](args.budget)
        except Exception as e:  # noqa: BLE001 - reported; the next section still runs
            ROWS.append(f"| {name} | FAILED {type(e).__name__}: {str(e)[:120]} | | |")
            log(ROWS[-1])
        torch.cuda.empty_cache()
    print("\n| kernel, case, cache, variant, (BLOCK_M, TILE_N, warps, stages) | NHD us (TB/s) | HND us (TB/s) | "
          "outputs |\n|---|---|---|---|")
    print("\n".join(ROWS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
