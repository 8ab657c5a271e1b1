"""MLA's expanded-heads prefill (attention/mla_prefill.py, kernels/mla_prefill.py) on the GPU, then the
tiny fp32 DeepSeek V2/V3 greedy check and DeepSeek-V2-Lite W1. Table printed last. ~3-4 min on one H200.

    PYTHONPATH=$PWD python3 scripts/gpu_mla_prefill_check.py [--only kernel models w1 decode moe]

kernel   DeepSeek-V2-Lite's attention shape (16 heads, latent 512 + 64, nope 128, v 128, bf16, block 16):
         one layer's MLA attention for prefill steps - 2048 new tokens with 0 / 2048 tokens of context,
         a W1-like step (8 prompts of ~1000), a mixed step (4 chunks + 128 decodes) - through the Triton
         backend's old path (all absorbed: the unified kernel in latent space) and the new split
         (decodes absorbed, chunks expanded): error against an fp32 torch reference of the absorbed
         form, ms per layer call (eager, as mixed steps run); the prefill kernel alone per tile config.
models   tiny fp32 DeepSeek V2 and V3 (scripts/gpu_models_check.py): greedy 48 tokens x 15 prompts on
         CUDA with graphs and eager == the CPU torch reference (chunked prefill with context)
decode   scripts/gpu_mla_decode_sweep.py with 4 tile variants: the latent decode kernel per layer-step at
         256 / 128 / 64 / 8 requests, split counts auto / 1 / 2 / 4 / 8 and fixed
         partitions of 256 / 512 keys, against the unified kernel and the latent bytes' floor (its own table)
moe      fused_experts at DeepSeek-V2-Lite's expert shape (E=64 top-6, 2048 -> 1408) for decode batches of
         128 / 256 tokens (decode) and 2048 / 8192 (prefill: W1's steps are 8192), the current tiles and candidates (CUDA-graph replay)
         against the floor (experts hit, read once, at the copy bandwidth measured here)
w1       `pagedllm bench throughput --model deepseek-v2-lite --load-format dummy --dataset w1
         --max-model-len 4096` (ours; vLLM's 12,743 output tok/s: BENCHMARKS.md, ninth session)
"""

from __future__ import annotations

import functools
import random

import torch
from _gpu_common import bench_w1, record, run_sections

from pagedllm.attention.metadata import build_metadata
from pagedllm.attention.mla import MLAAttention
from pagedllm.attention.mla_prefill import plan_mla_step
from pagedllm.attention.mla_ref import mla_attention_ref
from pagedllm.attention.triton_backend import TritonAttentionBackend

H, R, ROPE, NOPE, V, BS = 16, 512, 64, 128, 128, 16
SCALE = 192**-0.5
TILES = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3)]


def _step(q_lens: list[int], s_lens: list[int], seed: int):
    rng = random.Random(seed)
    blocks = [-(-s // BS) for s in s_lens]
    perm = list(range(sum(blocks)))
    rng.shuffle(perm)
    tables, i = [], 0
    for nb in blocks:
        tables.append(perm[i : i + nb])
        i += nb
    md = build_metadata(q_lens, s_lens, tables, BS, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf16 = torch.bfloat16
    cache = (torch.randn(1, sum(blocks), BS, 1, R + ROPE, device="cuda", generator=g) * 0.5).to(bf16)
    t = md.num_actual_tokens
    q_nope = torch.randn(t, H, NOPE, device="cuda", generator=g).to(bf16)
    q_pe = torch.randn(t, H, ROPE, device="cuda", generator=g).to(bf16)
    w_kv = (torch.randn(H, NOPE + V, R, device="cuda", generator=g) * R**-0.5).to(bf16)
    latent = cache.view(-1, R + ROPE)[md.slot_mapping].clone()  # the step's latents, rewritten where they are
    return md, cache, q_nope, q_pe, w_kv, latent


def _ms(fn, iters: int = 5) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).norm() / ref.norm()).item()


def kernel() -> None:
    rng = random.Random(0)
    w1_lens = [rng.randint(900, 1100) for _ in range(8)]
    cases = {
        "2048 new, ctx 0": ([2048], [2048]),
        "2048 new, ctx 2048": ([2048], [4096]),
        "W1-like step: 8 prompts ~1000": (w1_lens, w1_lens),
        "mixed: 4 x 512 (ctx 1000) + 128 decodes": ([512] * 4 + [1] * 128,
                                                    [1512] * 4 + [rng.randint(300, 1500) for _ in range(128)]),
    }
    for name, (q_lens, s_lens) in cases.items():
        _case(name, q_lens, s_lens)
        torch.cuda.empty_cache()


def _case(name: str, q_lens: list[int], s_lens: list[int]) -> None:
    from pagedllm.attention.mla_prefill import mla_prefill_forward
    from pagedllm.kernels.mla_prefill import mla_prefill_attention

    md, cache, q_nope, q_pe, w_kv, latent = _step(q_lens, s_lens, seed=len(q_lens))
    attn = MLAAttention(H, R, ROPE, SCALE)
    attn.bind_kv_cache(cache, TritonAttentionBackend())
    kv_c, k_pe = latent[:, :R], latent[:, R:]
    w_uk, w_uv = w_kv[:, :NOPE], w_kv[:, NOPE:]
    query = torch.cat([torch.einsum("thn,hnr->thr", q_nope.float(), w_uk.float()), q_pe.float()], -1)
    ref = torch.einsum("thr,hvr->thv", mla_attention_ref(query, latent.float(), cache.float(), md, SCALE, R),
                       w_uv.float()).reshape(md.num_actual_tokens, -1)
    new = functools.partial(attn.forward_mla, q_nope, q_pe, kv_c, k_pe, w_kv, md)
    old = functools.partial(attn._absorbed, q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, md)
    err_new, err_old = _rel(new(), ref), _rel(old(), ref)
    ms_new, ms_old = _ms(new), _ms(old)
    record(f"{name}: old (latent, unified kernel) / new (expanded) ms per layer",
           f"{ms_old:.2f} / {ms_new:.2f} ({ms_old / ms_new:.1f}x); rel err {err_old:.1e} / {err_new:.1e}")
    if name.startswith("2048 new, ctx 2048"):
        multi = plan_mla_step(md, BS, max_keys=1500)  # cut over 3 passes, merged through lse
        out = torch.empty(md.num_actual_tokens, H, V, device="cuda", dtype=q_nope.dtype)
        mla_prefill_forward(out, q_nope, q_pe, cache, w_kv.reshape(-1, R), multi, SCALE, use_triton=True)
        record(f"{name}: {len(multi.passes)} passes of 1500 keys, rel err", f"{_rel(out.reshape(ref.shape), ref):.1e}")
    # The kernel alone (one pass, keys already expanded), per tile config.
    p = plan_mla_step(md, BS).passes[0]
    lat = cache.view(-1, R + ROPE)[p.slots]
    kv = torch.nn.functional.linear(lat[:, :R], w_kv.reshape(-1, R)).view(lat.shape[0], H, -1)
    out = torch.empty(md.num_actual_tokens, H, V, device="cuda", dtype=q_nope.dtype)
    lse = torch.empty(md.num_actual_tokens, H, device="cuda")
    pairs = sum(ql * (s - ql) + ql * (ql + 1) / 2 for ql, s in zip(q_lens, s_lens) if ql > 1)
    flops = 2 * pairs * H * (NOPE + ROPE + V)
    cells = []
    for tile in TILES:
        try:
            run = functools.partial(mla_prefill_attention, out, lse, q_nope, q_pe, kv[..., :NOPE], lat[:, R:],
                                    kv[..., NOPE:], p.entries, p.tiles_for(tile[0]), SCALE, tile=tile)
            ms = _ms(run, iters=10)
            cells.append(f"{tile}: {ms * 1e3:.0f} us ({flops / ms / 1e9:.0f} TFLOP/s)")
        except Exception as exc:  # one config out of resources must not hide the others
            cells.append(f"{tile}: {type(exc).__name__}")
    record(f"{name}: prefill kernel alone per tile (BLOCK_M, BLOCK_N, warps, stages)", "; ".join(cells))


MOE_DECODE = {
    "m32 n64 k128 w4 s3": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "m64 n64 k128 w4 s3": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "m64 n128 k64 w4 s3": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
    "m64 n64 k64 w4 s4": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
}
MOE_PREFILL = {  # these and MOE_DECODE compile for sm_90 without spills (69-195 registers)
    "m128 n256 k64 w8 s4": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
    "m128 n128 k64 w8 s4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    "m64 n256 k64 w8 s4": dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
}


def moe() -> None:
    from _gpu_common import MOE_SHAPES, copy_bandwidth, graph_time_us, moe_expert_weights, moe_floor_us

    from pagedllm.kernels.fused_moe import _config, fused_experts
    from pagedllm.layers.fused_moe.router import select_experts

    e, top_k, hidden, inter = MOE_SHAPES["deepseek-v2-lite"]
    from pagedllm.models import deepseek_v2

    x = torch.randn(256, hidden, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(e, hidden, device="cuda") * 0.02).to(torch.bfloat16)
    got, want = deepseek_v2.router_logits(x, w), x.float() @ w.float().t()
    us = graph_time_us(functools.partial(deepseek_v2.router_logits, x, w))
    us_fp32 = graph_time_us(lambda: torch.nn.functional.linear(x.float(), w.float()))
    record("DeepSeek router logits, 256 tokens (bf16 GEMM, fp32 out / the fp32 GEMM before)",
           f"{us:.1f} / {us_fp32:.1f} us, mm out_dtype used: {deepseek_v2._MM_OUT_DTYPE[0]}, dtype {got.dtype}, "
           f"rel err {_rel(got, want):.1e}")
    bw = copy_bandwidth()
    w13, w2 = moe_expert_weights(e, hidden, inter)
    for t in (128, 256, 2048, 8192):
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = select_experts(torch.randn(t, e, device="cuda"), top_k, False)
        floor = moe_floor_us(int(torch.unique(ids).numel()), hidden, inter, bw)
        ref = fused_experts(x, w13, w2, weights, ids)
        cands = {"current " + " ".join(f"{v}" for v in _config(t * top_k, torch.bfloat16).values()): None,
                 **(MOE_DECODE if t <= 256 else MOE_PREFILL)}
        cells = []
        for name, cfg in cands.items():
            try:
                err = (fused_experts(x, w13, w2, weights, ids, config=cfg).float() - ref.float()).abs().max().item()
                us = graph_time_us(functools.partial(fused_experts, x, w13, w2, weights, ids, config=cfg))
                cells.append((us, f"{name}: {us:.0f} us ({floor / us * 100:.0f}%{'' if err < 1e-2 else f', err {err:.1e}'})"))
            except Exception as exc:  # a tile that does not fit shared memory
                cells.append((float("inf"), f"{name}: {type(exc).__name__}"))
        best = min(cells)[1].split(":")[0]
        flops = 2 * t * top_k * 3 * hidden * inter
        fastest = min(cells)[0]
        record(f"fused MoE deepseek-v2-lite {t} tok (floor {floor:.0f} us, best {best}: {flops / fastest / 1e6:.0f} TFLOP/s)",
               "; ".join(c[1] for c in cells))


def decode() -> None:
    import gpu_mla_decode_sweep as ds

    ds.TILES = [(32, 4, 2), (64, 4, 2), (32, 8, 3), (16, 4, 2)]
    ds.SPLITS = (None, 1, 2, 4, 8, "c256", "c512")
    ds.CASES = ((256, 800), (128, 1000), (64, 1500), (8, 3000))
    ds.main()


def models() -> None:
    import gpu_models_check as g

    g.ARCHS = {k: v for k, v in g.ARCHS.items() if k.startswith("deepseek")}
    g.correctness()


def w1() -> None:
    r, proc, seconds = bench_w1("deepseek-v2-lite", timeout=240)
    if r is None:
        record("W1 deepseek-v2-lite", f"FAILED rc={proc.returncode}")
        return
    record("W1 deepseek-v2-lite (dummy bf16, ours)", f"{r['output_tokens_per_second']:.0f} output tok/s, "
           f"{r['tokens_per_second']:.0f} tok/s total ({seconds:.0f} s incl. start); vLLM 0.21: 12,743 (ninth session)")


def main() -> None:
    # W1 and the greedy check first after the prefill kernel: a run cut short still has them.
    sections = {"kernel": kernel, "models": models, "w1": w1, "decode": decode, "moe": moe}
    run_sections(sections)


if __name__ == "__main__":
    main()
