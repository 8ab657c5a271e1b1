"""Tile configurations of the fused MoE kernel (kernels/fused_moe.py) at the Qwen3-30B-A3B and
DeepSeek-V2-Lite expert shapes, bf16, CUDA-graph replay, against the floor (experts hit, read once
at the measured copy bandwidth). Candidates: the current `_config` and vLLM-like H200 tiles (larger
BLOCK_K / BLOCK_N, explicit pipeline stages). Before them: the one-program align kernel against its
torch reference (correct, and both timed), and the fused softmax top-k router against the torch routing. Tables printed last, best tile per row marked.

Usage, from the repo root on the GPU machine (~1-2 min):  python3 scripts/moe_config_sweep.py [--quick]
"""

from __future__ import annotations

import argparse
import functools

import torch
from _gpu_common import MOE_SHAPES, copy_bandwidth, graph_time_us, moe_expert_weights, moe_floor_us

from pagedllm.kernels.fused_moe import _config, fused_experts, moe_align_block_size, moe_align_block_size_ref
from pagedllm.layers.fused_moe.router import select_experts

CANDIDATES = {
    "m16 n64 k128 w4 s3": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "m16 n128 k128 w4 s2": dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=2),
    "m16 n64 k256 w4 s2": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=2),
    "m32 n256 k128 w4 s2": dict(BLOCK_M=32, BLOCK_N=256, BLOCK_K=128, num_warps=4, num_stages=2),
    "m64 n128 k64 w4 s3": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
    "m128 n256 k64 w8 s4": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
    "m64 n256 k64 w8 s4": dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
}
SHAPES = dict(MOE_SHAPES)
TOKENS = (1, 16, 64, 256, 1024, 4096)


def align_check() -> list[tuple[str, str]]:
    """The one-program align kernel against the torch reference (same pairs per expert run) and
    both timed (CUDA-graph replay)."""
    out = []
    for e, top_k in ((128, 8), (64, 6)):
        for t, bm in ((1, 16), (256, 16), (256, 64), (8192, 64)):
            ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(t)]).int()
            got, ref = moe_align_block_size(ids, bm, e), moe_align_block_size_ref(ids, bm, e)
            same = got[1].equal(ref[1]) and got[2].equal(ref[2])
            n = int(ref[2][0]) // bm
            for b in range(n):  # the pairs of each expert, in any order within its run
                ex = int(ref[1][b])
                if b == 0 or int(ref[1][b - 1]) != ex:
                    rows_of = (ref[1][:n] == ex).nonzero().flatten()
                    lo, hi = int(rows_of[0]) * bm, (int(rows_of[-1]) + 1) * bm
                    same &= got[0][lo:hi].sort().values.equal(ref[0][lo:hi].sort().values)
            us_k = graph_time_us(functools.partial(moe_align_block_size, ids, bm, e))
            us_r = graph_time_us(functools.partial(moe_align_block_size_ref, ids, bm, e))
            out.append((f"align E={e} top_k={top_k} T={t} BLOCK_M={bm}",
                        f"{'OK' if same else 'WRONG'}: kernel {us_k:.1f} us, torch {us_r:.1f} us"))
            print(*out[-1], flush=True)
    # The fused softmax top-k router against the torch routing (run on the CPU copy), both timed.
    from pagedllm.kernels.moe_router import topk_softmax

    for e, top_k, renorm in ((128, 8, True), (64, 6, False)):
        for t in (1, 256, 8192):
            logits = torch.randn(t, e, device="cuda", dtype=torch.bfloat16)
            w, ids = topk_softmax(logits, top_k, renorm)
            rw, rids = select_experts(logits.cpu(), top_k, renorm)
            # bf16 logits tie often: the picked experts' probabilities must equal the reference's k-th
            # best (ties keep any index), and the weights agree.
            p = torch.softmax(logits.cpu().float(), dim=-1)
            ok = torch.allclose(p.gather(1, ids.cpu().long()), p.gather(1, rids.long()), atol=1e-6, rtol=0) and \
                torch.allclose(w.cpu(), rw, atol=1e-5, rtol=1e-4) and bool((ids.cpu().sort(1).values.diff(dim=1) != 0).all())
            us_k = graph_time_us(functools.partial(topk_softmax, logits, top_k, renorm))
            torch_path = functools.partial(_torch_routing, logits, top_k, renorm)
            us_r = graph_time_us(torch_path)
            out.append((f"router E={e} top_k={top_k} T={t}",
                        f"{'OK' if ok else 'WRONG'}: kernel {us_k:.1f} us, torch {us_r:.1f} us"))
            print(*out[-1], flush=True)
    return out


def _torch_routing(logits: torch.Tensor, top_k: int, renorm: bool) -> None:
    """select_experts' torch path on the GPU (what ran before the fused router)."""
    p = torch.softmax(logits.float(), dim=-1)
    ids = torch.topk(p, top_k, dim=-1).indices
    w = p.gather(1, ids)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    ids.to(torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true",
                        help="the align check, then Qwen3-30B-A3B only at 1 / 256 / 2048 tokens, 3 candidates (~40 s)")
    args = parser.parse_args()
    global SHAPES, TOKENS, CANDIDATES
    if args.quick:
        SHAPES = {"qwen3-30b-a3b": SHAPES["qwen3-30b-a3b"]}
        TOKENS = (1, 256, 2048)
        keep = ("m16 n64 k128 w4 s3", "m32 n256 k128 w4 s2", "m128 n256 k64 w8 s4")
        CANDIDATES = {k: v for k, v in CANDIDATES.items() if k in keep}
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    align_rows = align_check()
    rows = []
    for shape, (e, top_k, hidden, inter) in SHAPES.items():
        w13, w2 = moe_expert_weights(e, hidden, inter)
        for t in TOKENS:
            x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
            weights, ids = select_experts(torch.randn(t, e, device="cuda"), top_k, True)
            ref = fused_experts(x, w13, w2, weights, ids)
            hit = int(torch.unique(ids).numel())
            floor = moe_floor_us(hit, hidden, inter, bw)
            cands = {"current " + str(tuple(_config(t * top_k, torch.bfloat16).values())): None, **CANDIDATES}
            times = {}
            for name, cfg in cands.items():
                try:
                    out = fused_experts(x, w13, w2, weights, ids, config=cfg)
                    err = (out.float() - ref.float()).abs().max().item()
                    times[name] = (graph_time_us(functools.partial(fused_experts, x, w13, w2, weights, ids, config=cfg)), err)
                except Exception as exc:  # a tile that does not fit shared memory
                    times[name] = (float("inf"), str(exc)[:60])
            best = min(times, key=lambda n: times[n][0])
            for name, (us, err) in times.items():
                rows.append((shape, t, name, us, floor, err, name == best))
                print(f"{shape} T={t} {name}: {us:.1f} us (floor {floor:.1f}) err {err}", flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    print("\n| align / router | result |\n|---|---|")
    for name, value in align_rows:
        print(f"| {name} | {value} |")
    print("\n| shape | tokens | config | time | floor | % of floor | max err | best |\n|---|---|---|---|---|---|---|---|")
    for shape, t, name, us, floor, err, best in rows:
        err_s = f"{err:.2e}" if isinstance(err, float) else err
        print(f"| {shape} | {t} | {name} | {us:.1f} us | {floor:.1f} us | {floor / us * 100:.0f}% | {err_s} | "
              f"{'**best**' if best else ''} |")


if __name__ == "__main__":
    main()
