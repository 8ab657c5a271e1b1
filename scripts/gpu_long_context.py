"""Long contexts on the H200 (issue 16): 64 requests x 3000-token prompts x 1000 new tokens, Llama-3.1-8B
shape, dummy weights; and the decode attention variants behind it.

    python3 scripts/gpu_long_context.py            # sweep + end to end (current choice and the sweep's best)
    python3 scripts/gpu_long_context.py --sweep    # the kernel sweep only (~1 min)
    python3 scripts/gpu_long_context.py --e2e      # end to end only
    PYTHONPATH=/tmp/site python3 scripts/gpu_long_context.py --vllm   # vLLM 0.21 on the same workload

Sweep: the fused decode kernel (kernels/decode_attention.py, what decode steps run in the CUDA graphs)
at batch 64 x context {1000, 2000, 3000, 4000}, every (split count x tile) variant checked against the
torch reference and timed in a CUDA graph, beside the floor of its K/V bytes at 4.3 TB/s.
End to end: tok/s of the exact workload beside its floor (weights + K/V bytes per decode step at
4.3 TB/s, prefill FLOPs at 790 TFLOP/s), and a prefill-only pass (max_tokens 1) to split the time.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # graph_timing

BW, FLOPS = 4.3e12, 790e12
N, PROMPT, OUT = 64, 3000, 1000
HEADS, KVH, D, BS, LAYERS = 32, 8, 128, 16, 32
TILES = [(128, 4, 3), (64, 4, 3), (64, 4, 2), (32, 4, 3), (128, 8, 3), (64, 8, 2)]  # (TILE_N, warps, stages)
SPLITS = [1, 2, 4, 8]
ROWS: list[tuple[str, ...]] = []
DEVICE, DTYPE = "cuda", torch.bfloat16  # the CPU check of this script (interpreter) runs float32


def floor_seconds(n: int = N, prompt: int = PROMPT, out: int = OUT, budget: int = 8192) -> tuple[float, float]:
    """(prefill, decode) floor of the workload, roofline.py's model for Llama-3.1-8B in bf16."""
    h, inter, vocab = 4096, 14336, 128256
    layer = h * HEADS * D + 2 * h * KVH * D + HEADS * D * h + 3 * h * inter
    params = LAYERS * layer + 2 * vocab * h
    kv_tok = LAYERS * 2 * KVH * D * 2
    tokens = n * prompt
    attn = n * 2 * 2 * LAYERS * HEADS * D * prompt * prompt / 2
    prefill = max((-(-tokens // budget) * params * 2 + tokens * kv_tok) / BW, (2 * params * tokens + attn) / FLOPS)
    decode = sum((params * 2 + n * (prompt + i) * kv_tok) / BW for i in range(out))
    return prefill, decode


def decode_case(ctx: int, seed: int = 0):
    """A decode-only batch of N requests, each at context ctx (its new token at position ctx), with
    blocks scattered through the cache, as the fused kernel sees it inside a CUDA graph."""
    from pagedllm.attention.metadata import build_metadata

    g = torch.Generator().manual_seed(seed)
    nb = -(-(ctx + 1) // BS)
    perm = torch.randperm(N * nb, generator=g).tolist()
    tables = [perm[i * nb:(i + 1) * nb] for i in range(N)]
    md = build_metadata([1] * N, [ctx + 1] * N, tables, BS, device=DEVICE)
    md.max_seq_len = 4096  # the graphs' static maximum (max_model_len)
    kv = torch.randn(2, N * nb, BS, KVH, D, device=DEVICE, dtype=DTYPE)
    qkv = torch.randn(N, (HEADS + 2 * KVH) * D, device=DEVICE, dtype=DTYPE)
    positions = torch.full((N,), ctx, device=DEVICE, dtype=torch.int64)
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float32), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).to(DEVICE)
    return qkv, positions, cos_sin, kv, md


def sweep() -> dict[tuple[int, int, int, int], float]:
    """-> (TILE_N, warps, stages, splits) -> summed us over contexts 3000 and 4000 (checked variants only)."""
    from graph_timing import graph_us

    from pagedllm.kernels import decode_attention as da
    from pagedllm.kernels import split_k

    orig = da._tile_config
    scale = D ** -0.5
    score: dict[tuple[int, int, int, int], float] = {}
    for ctx in (1000, 2000, 3000, 4000):
        qkv, positions, cos_sin, kv, md = decode_case(ctx)
        ref = da.decode_attention_fused_ref(qkv, positions, cos_sin, kv.clone(), md, scale, HEADS, KVH, D).float()
        floor_us = N * ctx * KVH * D * 2 * 2 / BW * 1e6
        default = split_k.choose_num_splits(N, KVH, 1, md.max_seq_len)
        for tile in TILES:
            for splits in SPLITS:
                da._tile_config = lambda qpk, hdp, dec, few_programs=False, t=tile: (16, 4, *t) if dec else orig(
                    qpk, hdp, dec)
                name = f"tile {tile[0]}/w{tile[1]}/s{tile[2]} splits {splits}"
                if tile == ((64, 4, 2) if default == 1 else (128, 4, 3)) and splits == default:
                    name += " (current)"
                try:
                    fn = functools.partial(da.decode_attention_fused, qkv, positions, cos_sin, kv, md, scale, HEADS,
                                           KVH, D, num_splits=splits)
                    err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
                    us = graph_us([fn] * 10)
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row, not a crash
                    ROWS.append((f"ctx {ctx}", name, "FAILED", f"{type(e).__name__}: {e!s:.50}", "", ""))
                    continue
                finally:
                    da._tile_config = orig
                ok = err < 2e-2
                ROWS.append((f"ctx {ctx}", name, f"{us:.1f}", f"{floor_us:.1f}", f"{floor_us / us:.2f}",
                             f"{err:.1e}" + ("" if ok else " WRONG")))
                if ok and ctx >= 3000:
                    key = (*tile, splits)
                    score[key] = score.get(key, 0.0) + us
        del qkv, kv, ref, fn
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return score


PREFILL_TILES = [(64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 2), (128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 4, 2)]


MIXED = ([(2000, 3000), (3000, 3000), (2192, 2192)], 61, 3001)  # (new tokens, seq_len) chunks; decode rows; their seq_len


def mixed_case(seed: int = 0):
    """One step of the workload's prefill phase under the 8192-token budget: chunks of three prompts
    (2000 new tokens after a 1000-token context, 3000 from 0, 3000 - 1000 + 192 from 0) and 64 - 3
    = 61 decode rows at context 3000 (the requests already prefilled). -> query, kv, md, FLOPs."""
    from pagedllm.attention.metadata import build_metadata

    chunks, decodes, decode_seq = MIXED
    q_lens = [q for q, _ in chunks] + [1] * decodes
    seq = [s for _, s in chunks] + [decode_seq] * decodes
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-x // BS) for x in seq]
    perm = torch.randperm(sum(nbs), generator=g).tolist()
    tables, at = [], 0
    for nb in nbs:
        tables.append(perm[at:at + nb])
        at += nb
    md = build_metadata(q_lens, seq, tables, BS, device=DEVICE)
    kv = torch.randn(2, sum(nbs), BS, KVH, D, device=DEVICE, dtype=DTYPE)
    q = torch.randn(sum(q_lens), HEADS, D, device=DEVICE, dtype=DTYPE)
    # Causal FLOPs: 2 (QK, PV) x 2 x heads x head_dim per (query, visible key).
    flops = sum(4 * HEADS * D * sum(s - ql + i + 1 for i in range(ql)) for ql, s in zip(q_lens, seq))
    return q, kv, md, flops


def sweep_prefill() -> dict[tuple[int, int, int, int], float]:
    """Mixed-step attention (paged_attention, prefill tiles) -> (BLOCK_M, TILE_N, warps, stages) -> us."""
    from graph_timing import graph_us

    from pagedllm.kernels import paged_attention as pa

    orig = pa._tile_config
    q, kv, md, flops = mixed_case()
    ref = pa.paged_attention_ref(q, kv, md, D ** -0.5).float()
    score = {}
    for tile in PREFILL_TILES:
        bm, tn, w, st = tile
        pa._tile_config = lambda qpk, hdp, dec, few_programs=False, bm=bm, tn=tn, w=w, st=st: (
            orig(qpk, hdp, dec, few_programs) if dec else (bm, bm // qpk, tn, w, st))
        name = f"BLOCK_M {bm} TILE_N {tn} w{w} s{st}" + (" (current)" if tile == PREFILL_TILES[0] else "")
        try:
            fn = functools.partial(pa.paged_attention, q, kv, md, D ** -0.5)
            err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
            us = graph_us([fn] * 3)
        except Exception as e:  # noqa: BLE001
            ROWS.append(("mixed 8192-token step", name, "FAILED", f"{type(e).__name__}: {e!s:.50}", "", ""))
            continue
        finally:
            pa._tile_config = orig
        floor_us = flops / FLOPS * 1e6
        ok = err < 2e-2
        ROWS.append(("mixed 8192-token step", name, f"{us:.1f}", f"{floor_us:.1f} (FLOPs)", f"{floor_us / us:.2f}",
                     f"{err:.1e}" + ("" if ok else " WRONG")))
        if ok:
            score[tile] = us
    return score


def sweep_gemm() -> None:
    """The decode step's weight reads at 64 rows (Llama-3.1-8B linears, bf16), per BLAS library, in
    CUDA graphs, beside their bytes at 4.3 TB/s: the other half of a decode step's floor."""
    from graph_timing import graph_us

    shapes = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672),
              "down_proj": (14336, 4096), "lm_head": (4096, 128256)}
    default = torch.backends.cuda.preferred_blas_library()
    total = {}
    try:
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            for name, (k, n) in shapes.items():
                x = torch.randn(N, k, device=DEVICE, dtype=DTYPE)
                w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) * 0.01
                us = graph_us([functools.partial(torch.nn.functional.linear, x, w)] * 10)
                floor_us = n * k * 2 / BW * 1e6
                per_step = LAYERS if name != "lm_head" else 1
                total[lib] = total.get(lib, (0.0, 0.0))
                total[lib] = (total[lib][0] + us * per_step, total[lib][1] + floor_us * per_step)
                ROWS.append((f"GEMM M={N}", f"{name} {k}x{n} {lib}", f"{us:.1f}", f"{floor_us:.1f}",
                             f"{floor_us / us:.2f}", f"x{per_step} a step"))
    finally:
        torch.backends.cuda.preferred_blas_library(default)
    for lib, (us, fl) in total.items():
        ROWS.append((f"GEMM M={N}", f"all linears of a step, {lib}", f"{us:.0f}", f"{fl:.0f}", f"{fl / us:.2f}", ""))


def patched(tile: tuple[int, int, int] | None, splits: int | None, prefill: tuple[int, ...] | None = None):
    """Install a decode tile / split count for batches of 64+ rows (what the end-to-end run decodes),
    and a prefill tile (BLOCK_M, TILE_N, warps, stages) for mixed steps."""
    from pagedllm.kernels import decode_attention as da
    from pagedllm.kernels import paged_attention as pa
    from pagedllm.kernels import split_k

    orig_tile, orig_split, orig_pa_tile = da._tile_config, split_k.choose_num_splits, pa._tile_config
    if tile is not None:
        da._tile_config = lambda qpk, hdp, dec, few_programs=False: (16, 4, *tile) if dec else orig_tile(qpk, hdp, dec)
    if prefill is not None:
        bm, tn, w, st = prefill
        pa._tile_config = lambda qpk, hdp, dec, few_programs=False: (
            orig_pa_tile(qpk, hdp, dec, few_programs) if dec else (bm, bm // qpk, tn, w, st))
    if splits is not None:
        def choose(num_reqs, num_kv_heads, max_query_len, max_seq_len):
            if max_query_len == 1 and num_reqs >= 64:
                return splits
            return orig_split(num_reqs, num_kv_heads, max_query_len, max_seq_len)
        for mod in (da, pa, split_k):
            mod.choose_num_splits = choose

    def undo():
        da._tile_config = orig_tile
        pa._tile_config = orig_pa_tile
        for mod in (da, pa, split_k):
            mod.choose_num_splits = orig_split
    return undo


def workload(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(0, 10000) for _ in range(PROMPT)] for _ in range(N)]


def e2e(label: str, tile=None, splits=None, prefill=None) -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.gc_heap import unfreeze_gc_heap

    undo = patched(tile, splits, prefill)
    try:
        t0 = time.perf_counter()
        llm = LLM("llama3-8b", load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0)
        ready = time.perf_counter() - t0
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)
        one = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1, detokenize=False)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in workload(1)], one, use_tqdm=False)  # other prompts: no prefix hits
        t_pf = time.perf_counter() - t
        sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=OUT, detokenize=False)
        t = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in workload(0)], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = sum(len(r.outputs[0].token_ids) for r in res)
        assert toks == N * OUT, toks
        pf, dec = floor_seconds()
        ROWS.append(("e2e", label, f"{toks / dt:,.0f} tok/s", f"{N * OUT / (pf + dec):,.0f} tok/s floor",
                     f"{(pf + dec) / dt:.2f}", f"run {dt:.1f} s: prefill-only pass {t_pf:.1f} s (floor "
                     f"{pf:.1f}), the rest {(dt - t_pf) / (OUT - 1) * 1e3:.2f} ms a decode step (floor "
                     f"{dec / OUT * 1e3:.2f}); ready in {ready:.1f} s"))
        print(ROWS[-1], flush=True)
        del llm, res
    finally:
        undo()
        unfreeze_gc_heap()
        gc.collect()
        torch.cuda.empty_cache()


def vllm_e2e() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pagedllm", "model_configs", "llama3-8b")
    llm = LLM(model=cfg, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=8, detokenize=False),
                 use_tqdm=False)
    sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=OUT, detokenize=False)
    t = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in workload(0)], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    toks = sum(len(r.outputs[0].token_ids) for r in res)
    print(json.dumps({"peer": "vllm", "output_tokens": toks, "seconds": round(dt, 2),
                      "output_tok_per_s": round(toks / dt, 1)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--one", help='(internal) one end-to-end run here: LABEL[|{"decode": [TILE_N, warps, stages, splits], '
                    '"prefill": [BLOCK_M, TILE_N, warps, stages]}]')
    args = ap.parse_args()
    if args.vllm:
        return vllm_e2e()
    if args.one:
        label, _, variant = args.one.partition("|")
        v = json.loads(variant) if variant else {}
        dec = v.get("decode")
        e2e(label, tuple(dec[:3]) if dec else None, dec[3] if dec else None,
            tuple(v["prefill"]) if v.get("prefill") else None)
        print("ROW " + json.dumps(ROWS[-1]), flush=True)
        return None
    both = not (args.sweep or args.e2e)
    best, best_pf = None, None
    if args.sweep or both:
        score = sweep()
        if score:
            best = min(score, key=score.get)
            print("best decode at contexts 3000 + 4000:", best, f"{score[best]:.1f} us", flush=True)
        sweep_gemm()
        score_pf = sweep_prefill()
        if score_pf:
            best_pf = min(score_pf, key=score_pf.get)
            print("best mixed-step tile:", best_pf, f"{score_pf[best_pf]:.1f} us", flush=True)
    if args.e2e or both:
        # Each run in its own process: an engine's GPU memory is surely gone when the next one profiles.
        runs = ["current choice"]
        variant = {}
        if best is not None and best != (64, 4, 2, 1):
            variant["decode"] = list(best)
        if best_pf is not None and best_pf != PREFILL_TILES[0]:
            variant["prefill"] = list(best_pf)
        if variant:
            desc = ", ".join(f"{k} {tuple(v)}" for k, v in variant.items())
            runs.append(f"sweep's best ({desc})|" + json.dumps(variant))
        for i, one in enumerate(runs):
            # A graph plan of its own (worker/graph_plan.py keeps one per model shape), the shared Triton cache.
            env = dict(os.environ, PAGEDLLM_CACHE_ROOT=tempfile.mkdtemp(prefix=f"lc-{i}-"),
                       TRITON_CACHE_DIR=os.environ.get("TRITON_CACHE_DIR")
                       or os.path.expanduser("~/.cache/pagedllm/triton"))
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", one], capture_output=True,
                               text=True, timeout=400, env=env)
            row = next((json.loads(line[4:]) for line in p.stdout.splitlines() if line.startswith("ROW ")), None)
            if row is None:
                print(f"--- {one} failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}", flush=True)
                row = ["e2e", one, "FAILED", "", "", ""]
            ROWS.append(tuple(row))
    print("\n| case | variant | us (or tok/s) | KV floor us | floor / time | error / notes |\n|---|---|---|---|---|---|")
    for row in ROWS:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
