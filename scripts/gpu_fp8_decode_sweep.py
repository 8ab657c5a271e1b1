"""The fused decode kernel on an fp8 KV cache at few warps a program, on one H200.

    python3 scripts/gpu_fp8_decode_sweep.py [--budget 150] [--cases decode256,decode64,long64]

The fp8 cache's loop (4 warps) holds ~240 registers, two programs an SM, and took ~1.4x the time its K / V
bytes stream in (BENCHMARKS.md, issue 19): latency-bound. With one or two warps a program, a (request, kv
head) program's reductions over keys stay inside its warps (4-warp tiles reduce across warps through shared
memory) and more programs fit an SM. This sweeps both loops (0: query rows as the MMA's M, fp16 dots; 3: keys
as M, e4m3 QK, the softmax denominators summed after the loop) over (BLOCK_M, TILE_N, warps, stages), the cache in the
GPU's default head-major order, CUDA-graph replays; each output against the fp32 reference of the same
cache values (max |out - ref| / max |ref|), registers and spills of the compiled kernel. Prints the table
last.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

T0 = time.monotonic()
ROWS: list[str] = []
FP8 = [(3, None), (3, (16, 64, 4, 3)), (3, (16, 64, 4, 2)), (3, (16, 128, 4, 2)), (3, (16, 128, 4, 4)),
       (3, (16, 256, 8, 2)), (3, (16, 64, 2, 3)), (0, (16, 64, 2, 3)), (3, (16, 32, 2, 3))]
BF16 = [(0, None), (0, (16, 64, 2, 3)), (0, (16, 64, 2, 2)), (0, (16, 32, 2, 3)), (0, (16, 64, 4, 3))]


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:5.1f} s] {msg}", flush=True)


def kernel_regs(jit_fn) -> dict[tuple, tuple[int, int]]:
    """(num_warps, num_stages, name hash) -> (registers, spills) of every compiled variant so far."""
    out = {}
    for caches in getattr(jit_fn, "device_caches", {}).values():
        for k in caches[0].values():
            md = getattr(k, "metadata", None)
            key = (getattr(md, "num_warps", None), getattr(md, "num_stages", None), getattr(md, "hash", id(k)))
            out[key] = (getattr(k, "n_regs", -1), getattr(k, "n_spills", -1))
    return out


def main() -> int:
    from gpu_kv_layout_probe import decode_case, graph_us, head_major

    from pagedllm.kernels import decode_attention as da

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--cases", default="decode256,decode64,long64")
    ap.add_argument("--caches", default="fp8,bf16")
    ap.add_argument("--best", default=None, help="write the fastest fp8 loop of the first case whose error is "
                                                 "<= 6e-2 and that does not spill, as VARIANT,BLOCK_M,TILE_N,warps,"
                                                 "stages (PAGEDLLM_FP8_KV_DECODE's form), to this file")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    best: tuple[float, str] | None = None
    for kind in args.cases.split(","):
        for cname, dt, configs in (("fp8", torch.float8_e4m3fn, FP8), ("bf16", torch.bfloat16, BF16)):
            if (kind != "decode256" and cname == "bf16") or cname not in args.caches.split(","):
                continue
            qkv, pos, cs, cache, md, kv_bytes = decode_case(kind, dt)
            cache = head_major(cache)
            ref_cache = cache.float()
            ref = da.decode_attention_fused_ref(qkv.float(), pos, cs, ref_cache, md, 0.088, 32, 8, 128)
            scale = ref.abs().max().item()
            # One untimed graph first: the first timing of a process read ~10% slow (bf16 dispatch 226 us, then
            # 206 us again at the end of the same sweep; BENCHMARKS.md, issue 19, twentieth session).
            graph_us(functools.partial(da.decode_attention_fused, qkv, pos, cs, head_major(cache), md, 0.088, 32, 8,
                                       128))
            for variant, cfg in configs:
                if time.monotonic() - T0 > args.budget:
                    log("budget spent")
                    break
                seen = kernel_regs(da._decode_fused_kernel)
                try:
                    work = head_major(cache)
                    run = functools.partial(da.decode_attention_fused, qkv, pos, cs, work, md, 0.088, 32, 8, 128,
                                            variant=variant, config=cfg)
                    out = run()
                    err = (out.float() - ref).abs().max().item() / scale
                    us = graph_us(run)
                    new = [v for k, v in kernel_regs(da._decode_fused_kernel).items() if k not in seen]
                    regs = f"{new[0][0]} / {new[0][1]}" if new else "cached"
                    cell = f"{us:.1f} | {kv_bytes / us / 1e6:.2f} | {err:.1e} | {regs}"
                    spills = new[0][1] if new else 0
                    if (kind == args.cases.split(",")[0] and cname == "fp8" and err <= 6e-2 and spills <= 0
                            and (best is None or us < best[0])):
                        c = cfg or da.FP8_KV_CONFIG
                        best = (us, ",".join(map(str, (variant, *c))))
                except Exception as e:  # noqa: BLE001 - a config over the shared memory etc.
                    cell = f"ERR {type(e).__name__}: {str(e)[:70]} | | |"
                row = f"| {kind} | {cname} | v{variant} {cfg or 'dispatch'} | {cell} |"
                ROWS.append(row)
                log(row)
            del cache, ref_cache
            torch.cuda.empty_cache()
    print("\n| case | cache | loop (BLOCK_M, TILE_N, warps, stages) | us | TB/s | error | regs / spills |\n"
          "|---|---|---|---|---|---|---|")
    print("\n".join(ROWS))
    if args.best and best is not None:
        with open(args.best, "w") as f:
            f.write(best[1])
        print(f"fastest fp8 loop: {best[1]} ({best[0]:.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
