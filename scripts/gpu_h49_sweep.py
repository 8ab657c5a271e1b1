"""Kernel sweeps for issue 24's W1 bars, no engine (random weights of the models' shapes), CUDA-graph replays
against each kernel's floor; sections in the order given, none started after --deadline seconds:

    moe      fused_experts at Qwen3-30B-A3B's expert shape (128 x 2048 x 768, top 8), decode sizes: the
             row-list tiles (`_scan_config`'s defaults first, then variants), 8 layers' experts rotated so
             every call reads DRAM; floor = the experts hit, read once, at the copy bandwidth measured here
    dense    cuBLAS (F.linear) at the decode step's dense shapes (qkv, o_proj, router), 256 and 96 rows; 8 weight
             copies rotated; against the weight bytes (or the FLOPs at the matmul speed measured here, if more)
    attn     the fused decode attention's tiles and split counts at Qwen3-30B-A3B's heads (32 query / 4 kv,
             head_dim 128), W1-like batches early (256 short contexts) and late (96, 48 longer ones)
    mla      mla_decode's (TILE_N, warps, stages) and partition variants at DeepSeek-V2-Lite's latent
             (16 heads, 512 + 64), W1-like batches, against the latent bytes
    moe-ds   the same at DeepSeek-V2-Lite's experts (64 routed, top 6, 2 shared): the align path against
             the row lists with the shared experts as token chunks
    align    the align step at 8192 tokens: the torch version against the row-list one (PAGEDLLM_MOE_ALIGN_ROWS)
    prefill  fused_experts at 8192 tokens: the default TMA tiles against GEMM-2 (DOWN) variants, against
             the FLOPs at the bf16 matmul speed measured here

    python3 -u scripts/gpu_h49_sweep.py [--only moe attn dense mla moe-ds align prefill] [--deadline 70]
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
import traceback

T0 = time.monotonic()


def elapsed() -> float:
    return time.monotonic() - T0


def _c(m: int, n: int, k: int, w: int, st: int, **kw) -> dict:
    return dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st, **kw)


def rows(m: int, n: int, k: int, w: int, st: int, down: dict | None = None) -> dict:
    """A row-list (SCAN) config; down: GEMM 2's own BLOCK_N / BLOCK_K / warps / stages."""
    return _c(m, n, k, w, st, SCAN=True, DOWN=down or dict(BLOCK_N=128))


# (tokens, label, config or None for fused_experts' own choice). One GEMM changed at a time against the
# defaults (GEMM 1 32x64x128 s3, GEMM 2 32x128x128 s3 at 256 tokens; 16 rows at 128). Compiled for sm_90
# (tests/kernels/sm90_compile_check.py's way), the defaults at 32 rows hold 2 programs an SM (GEMM 1: 154
# registers, 84 KB of shared memory; GEMM 2: 180, 84 KB) where the 16-row ones hold 3 and reach 97% of the
# bytes; the variants trade K depth or columns for programs an SM (noted: programs / SM).
MOE_DECODE = [
    (256, "default", None),
    (256, "down 64x128 s3 (3/SM)", rows(32, 64, 128, 4, 3, dict(BLOCK_N=64))),
    (256, "down 64x64 s3 (4/SM)", rows(32, 64, 128, 4, 3, dict(BLOCK_N=64, BLOCK_K=64))),
    (256, "down 32x128 s3 (5/SM)", rows(32, 64, 128, 4, 3, dict(BLOCK_N=32))),
    (256, "down 64x64 s4 (3/SM)", rows(32, 64, 128, 4, 3, dict(BLOCK_N=64, BLOCK_K=64, num_stages=4))),
    (256, "gemm1 32x64x64 s3 (4/SM)", rows(32, 64, 64, 4, 3)),
    (256, "gemm1 32x32x128 s3 (4/SM)", rows(32, 32, 128, 4, 3)),
    (256, "gemm1 32x64x64 s4 (3/SM)", rows(32, 64, 64, 4, 4)),
    (256, "gemm1 32x64x128 s2 (3/SM)", rows(32, 64, 128, 4, 2)),
    (128, "default", None),
    (128, "down 64x128 s3 (5/SM)", rows(16, 64, 128, 4, 3, dict(BLOCK_N=64))),
    (128, "gemm1 16x64x64 s4 (4/SM)", rows(16, 64, 64, 4, 4)),
    (192, "default", None),
    (96, "default", None),
    (48, "default", None),
    (16, "default", None),
]
# DeepSeek-V2-Lite's experts (64 routed, top 6, + 2 shared on every token; 2048 -> 1408): the align path
# (the default) against the row lists with the shared experts as token chunks (PAGEDLLM_MOE_SCAN_SHARED).
MOE_DEEPSEEK = [
    (128, "default (align)", None),
    (128, "rows 32x64x128, down 32x128x128 (2/SM)", rows(32, 64, 128, 4, 3)),
    (128, "rows 32x64x64, down 32x64x64 (4/SM)", rows(32, 64, 64, 4, 3, dict(BLOCK_N=64, BLOCK_K=64))),
    (256, "default (align)", None),
    (256, "rows 32x64x128, down 32x128x128 (2/SM)", rows(32, 64, 128, 4, 3)),
    (256, "rows 32x64x64, down 32x64x64 (4/SM)", rows(32, 64, 64, 4, 3, dict(BLOCK_N=64, BLOCK_K=64))),
    (256, "rows 64x64x64, down 64x64x64 (2-3/SM)", rows(64, 64, 64, 4, 3, dict(BLOCK_N=64, BLOCK_K=64))),
    (32, "default (align)", None),
    (32, "rows 16x64x128, down 16x128x128", rows(16, 64, 128, 4, 3)),
]
MOE_PREFILL = [
    (8192, "default", None),
    (8192, "default, down 128x256x64 w8 s3", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4,
                                                   FUSE_SILU=True, TMA=True,
                                                   DOWN=dict(BLOCK_N=256, num_stages=3))),
    (8192, "default, GROUP_M 16", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, FUSE_SILU=True,
                                       TMA=True, GROUP_M=16)),
    (8192, "default, down 128x64x64 w4 s4", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4,
                                                FUSE_SILU=True, TMA=True,
                                                DOWN=dict(BLOCK_N=64, num_warps=4))),
]
# (requests, context lengths from, to): W1's decode batches early (256 x 150-1100) and late (fewer, longer)
ATTN_BATCHES = ((256, 150, 1100), (96, 900, 2000))
ATTN_VARIANTS = [  # (label, (BLOCK_M, TILE_N, warps, stages) or None: the defaults, num_splits or None)
    ("default", None, None),
    ("64 keys s3", (16, 64, 4, 3), 1),
    ("128 keys s2", (16, 128, 4, 2), 1),
    ("64 keys s4", (16, 64, 4, 4), 1),
    ("default tiles, 2 splits", None, 2),
    ("64 keys s3, 2 splits", (16, 64, 4, 3), 2),
]
MLA_TILES = [  # (label, tile (TILE_N, warps, stages), split_chunk, num_rc: the latent in that many column chunks)
    ("default", None, None, None),
    ("chunked x4, tile 32 w4 s2 (3/SM)", (32, 4, 2), 256, 4),
    ("chunked x4, tile 16 w4 s3 (3/SM)", (16, 4, 3), 256, 4),
    ("chunked x4, tile 32 w8 s2", (32, 8, 2), 256, 4),
    ("chunked x4, tile 64 w8 s2", (64, 8, 2), 256, 4),
    ("chunked x4, tile 32 w4 s2, 128 keys", (32, 4, 2), 128, 4),
    ("tile 16 w4 s3, 256 keys (3/SM)", (16, 4, 3), 256, 0),
    ("tile 32 w8 s2, 256 keys", (32, 8, 2), 256, 0),
    ("tile 64 w8 s2, 256 keys", (64, 8, 2), 256, 0),
    ("tile 32 w4 s2, 128 keys", (32, 4, 2), 128, 0),
]


# The decode step's dense GEMMs (Qwen3-30B-A3B): weight (N, K)
DENSE_SHAPES = {"qkv 2048->5120": (5120, 2048), "o_proj 4096->2048": (2048, 4096), "router 2048->128": (128, 2048)}

# (experts incl. shared, routed top_k, shared, hidden, moe_intermediate)
MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 0, 2048, 768), "deepseek-v2-lite": (66, 6, 2, 2048, 1408)}


class Sweep:
    def __init__(self, deadline: float) -> None:
        import torch
        from _gpu_common import copy_bandwidth

        self.deadline = deadline
        self.bw = copy_bandwidth()
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            a @ a
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        self.flops = 10 * 2 * 8192 ** 3 / (time.perf_counter() - t)
        del a
        print(f"copy {self.bw / 1e12:.2f} TB/s, bf16 matmul {self.flops / 1e12:.0f} TFLOP/s [{elapsed():.0f} s]",
              flush=True)
        self._experts: dict[str, list] = {}
        # True during the first pass (main: `precompile`): every variant launched once, Triton recording
        # instead of compiling; nothing timed or checked. The variants then compile in parallel processes.
        self.collecting = False

    def late(self, what: str) -> bool:
        if self.collecting:
            return False
        if elapsed() > self.deadline:
            print(f"## {what}: not run (deadline)", flush=True)
            return True
        return False

    def experts(self, shape: str):
        """8 layers of random experts of the shape (~9-10 GB), made once per shape."""
        if shape not in self._experts:
            from _gpu_common import moe_expert_weights

            e, _, _, hidden, inter = MOE_SHAPES[shape]
            self._experts[shape] = [moe_expert_weights(e, hidden, inter) for _ in range(8)]
        return self._experts[shape]

    def moe(self, cases, shape: str = "qwen3-30b-a3b") -> None:
        import torch
        from _gpu_common import moe_floor_us, record, rel_err, rotating_graph_us

        from pagedllm.kernels import fused_moe as fm
        from pagedllm.layers.fused_moe.router import select_experts
        from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

        e, top_k, shared, hidden, inter = MOE_SHAPES[shape]
        ws = self.experts(shape)
        g = torch.Generator(device="cuda").manual_seed(0)
        inputs: dict[int, tuple] = {}
        for t, name, cfg in cases:
            what = f"moe {shape} {t} tokens {name}"
            if self.late(what):
                continue
            if t not in inputs:
                x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
                if self.collecting:  # no kernel runs in this pass: valid ids from torch (the align's torch path indexes by them)
                    ids = torch.randint(0, e - shared, (t, top_k), device="cuda", dtype=torch.int32)
                    ids = torch.cat([ids, torch.arange(e - shared, e, device="cuda", dtype=torch.int32).expand(t, shared)],
                                    1)
                    w = torch.rand(t, top_k + shared, device="cuda")
                else:
                    w, ids = select_experts(torch.randn(t, e - shared, device="cuda", generator=g), top_k, True,
                                            num_fused_shared_experts=shared)
                inputs[t] = (x, w, ids)
            x, w, ids = inputs[t]

            def call(i, x=x, w=w, ids=ids, cfg=cfg):
                return fm.fused_experts(x, ws[i][0], ws[i][1], w, ids, config=cfg, shared_experts=shared)

            if self.collecting:
                call(0)
                continue
            try:
                err = rel_err(call(0), fused_experts_ref(x, ws[0][0], ws[0][1], w, ids))
                us = rotating_graph_us(call, len(ws), reps=3 * len(ws))
            except Exception as exc:
                record(what, f"ERROR {type(exc).__name__}: {str(exc)[:120]}")
                continue
            hit = int(torch.unique(ids).numel())
            floor_b = moe_floor_us(hit, hidden, inter, self.bw)
            floor_f = 2 * t * (top_k + shared) * 3 * hidden * inter / self.flops * 1e6
            floor = max(floor_b, floor_f)
            pairs = t * (top_k + shared)
            shown = cfg or (None if shared else fm._scan_config(pairs, e, torch.bfloat16)) or fm._config(pairs,
                                                                                                      torch.bfloat16)
            record(what, f"{us:.1f} us/layer, {100 * floor / us:.0f}% of {floor:.1f} "
                   f"({'bytes' if floor_b >= floor_f else 'FLOPs'}; {hit} experts hit); "
                   f"{'OK' if err < 2e-2 else 'WRONG'} rel err {err:.1e}; {shown}")
        torch.cuda.empty_cache()

    def align(self) -> None:
        """The align step of prefill-sized steps (8192 tokens): the torch version (the default past the
        one-program kernel's 8192 pairs) against the two-launch row-list version (PAGEDLLM_MOE_ALIGN_ROWS)."""
        import torch
        from _gpu_common import record, rotating_graph_us

        from pagedllm.kernels import fused_moe as fm

        for e, top_k, block_m in ((128, 8, 128), (66, 8, 64)):
            ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(8192)]).int()
            for name, fn in (("torch", fm.moe_align_block_size_ref), ("row lists", fm.moe_align_block_size_rows)):
                if self.late(f"align {e} experts {name}"):
                    continue
                if self.collecting:
                    fn(ids, block_m, e)
                    continue
                got, ref = fn(ids, block_m, e), fm.moe_align_block_size_ref(ids, block_m, e)
                n = int(ref[2][0])
                same = torch.equal(got[0][:n], ref[0][:n]) and torch.equal(got[1][: n // block_m], ref[1][: n // block_m])
                us = rotating_graph_us(lambda i, fn=fn, ids=ids, b=block_m, e=e: fn(ids, b, e), 1, reps=10)
                record(f"align 8192 tokens x {top_k}, {e} experts, BLOCK_M {block_m}: {name}",
                       f"{us:.1f} us; {'same as the reference' if same else 'DIFFERENT'}")

    def dense(self) -> None:
        """cuBLAS at the decode step's dense shapes; 8 weight copies rotated, each call reads its weight from DRAM."""
        import torch
        import torch.nn.functional as F
        from _gpu_common import record, rotating_graph_us

        if self.collecting:
            return  # cuBLAS only: no Triton variant to compile ahead
        for name, (n, k) in DENSE_SHAPES.items():
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(8)]
            for m in (256, 96):
                if self.late(f"dense {name} M={m}"):
                    continue
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                floor = max(n * k * 2 / self.bw, 2 * m * n * k / self.flops) * 1e6
                us = rotating_graph_us(lambda i, x=x, ws=ws: F.linear(x, ws[i]), 8, reps=48)
                record(f"dense {name} M={m}", f"{us:.1f} us ({100 * floor / us:.0f}% of {floor:.1f})")
            del ws
        torch.cuda.empty_cache()

    def attn(self) -> None:
        """The fused decode attention at Qwen3-30B-A3B's heads, W1-like batches (early: many short
        contexts; late: fewer, longer), tiles (BLOCK_M, TILE_N, warps, stages) and split counts."""
        import torch
        from _gpu_common import graph_time_us, record, shuffled_decode_metadata

        from pagedllm.kernels import decode_attention as da
        from pagedllm.kernels.rotary import build_cos_sin_cache

        nh, nkv, hd = 32, 4, 128
        cos_sin = build_cos_sin_cache(hd, 8192, 1e6, device="cuda")
        norm_w = torch.ones(hd, device="cuda", dtype=torch.bfloat16)
        for n, lo, hi in ATTN_BATCHES:
            rng = random.Random(n)
            s_lens = [rng.randint(lo, hi) for _ in range(n)]
            md, blocks = shuffled_decode_metadata(s_lens, 16, rng)
            if n >= 128:  # as the engine's decode graphs run them (worker/cuda_graphs.py ORDER_MIN_BATCH)
                md.decode_order = torch.tensor(sorted(range(n), key=lambda i: -s_lens[i]), dtype=torch.int32,
                                               device="cuda")
            cache = torch.randn(2, blocks, 16, nkv, hd, device="cuda", dtype=torch.bfloat16)
            qkv = torch.randn(n, (nh + 2 * nkv) * hd, device="cuda", dtype=torch.bfloat16)
            pos = torch.tensor([s - 1 for s in s_lens], device="cuda")
            floor = sum(s_lens) * nkv * hd * 2 * 2 / self.bw * 1e6
            ref = None
            for name, config, splits in ATTN_VARIANTS:
                if self.late(f"attention {n} requests {name}"):
                    continue
                call = functools.partial(da.decode_attention_fused, qkv, pos, cos_sin, cache, md, hd ** -0.5, nh, nkv,
                                         hd, norm_w, norm_w, num_splits=splits, config=config)
                if self.collecting:
                    call()
                    continue
                try:
                    out = call().float()
                    ref = out if ref is None else ref
                    us = graph_time_us(call)
                except Exception as exc:
                    record(f"attention {n} requests {name}", f"ERROR {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                record(f"attention {n} requests x {lo}-{hi} keys, {name}",
                       f"{us:.1f} us ({100 * floor / us:.0f}% of {floor:.1f}); max diff from the first "
                       f"{(out - ref).abs().max().item():.1e}")
            del cache
        torch.cuda.empty_cache()

    def mla(self) -> None:
        import torch
        from _gpu_common import graph_time_us, record, shuffled_decode_metadata

        from pagedllm.kernels.mla_decode import mla_decode, mla_decode_ref

        h, r, p, bs = 16, 512, 64, 16
        for n, lo, hi in ((256, 150, 1300), (128, 500, 1800)):
            rng = random.Random(n)
            s_lens = [rng.randint(lo, hi) for _ in range(n)]
            md, blocks = shuffled_decode_metadata(s_lens, bs, rng)
            cache = (torch.randn(1, blocks, bs, 1, r + p, device="cuda") * 0.5).to(torch.bfloat16)
            q = (torch.randn(n, h, r + p, device="cuda") * 0.1).to(torch.bfloat16)
            ref = None if self.collecting else mla_decode_ref(q.float(), cache.float(), md, 0.1, r)
            floor = sum(s_lens) * (r + p) * 2 / self.bw * 1e6
            for name, tile, chunk, num_rc in MLA_TILES:
                if self.late(f"mla {n} requests {name}"):
                    continue
                run = functools.partial(mla_decode, q, cache, md, 0.1, r, tile=tile, split_chunk=chunk, num_rc=num_rc)
                if self.collecting:
                    run()
                    continue
                try:
                    err = ((run().float() - ref).norm() / ref.norm()).item()
                    us = graph_time_us(run)
                except Exception as exc:
                    record(f"mla {n} requests {name}", f"ERROR {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                record(f"mla {n} requests x {lo}-{hi} keys, {name}",
                       f"{us:.1f} us ({100 * floor / us:.0f}% of {floor:.1f}); rel err {err:.1e}")
            del cache
        torch.cuda.empty_cache()


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", default=["moe", "attn", "dense", "mla", "moe-ds", "align", "prefill"],
                        choices=["moe", "dense", "attn", "mla", "prefill", "moe-ds", "align"])
    parser.add_argument("--deadline", type=float, default=70.0, help="seconds since start: no variant starts after")
    parser.add_argument("--serial-compile", action="store_true",
                        help="no first pass: each variant compiles at its first launch, one after another")
    args = parser.parse_args()
    from _gpu_common import print_results

    if not args.serial_compile:  # the compile processes fork first: no CUDA call yet (worker/compile_pool.py)
        from pagedllm import envs
        from pagedllm.worker import compile_pool

        envs.use_triton_cache_dir()
        try:
            compile_pool._pool = compile_pool.CompilePool(compile_pool._processes(), fork=True)
        except Exception as exc:  # noqa: BLE001 - then every variant compiles at its first launch
            print(f"compile processes not forked: {exc!r}", flush=True)
    if not torch.cuda.is_available():
        print("needs a CUDA device", flush=True)
        return 1
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    sw = Sweep(args.deadline)
    sections = {"moe": lambda: sw.moe(MOE_DECODE), "dense": sw.dense, "attn": sw.attn, "mla": sw.mla,
                "prefill": lambda: sw.moe(MOE_PREFILL), "align": sw.align, "moe-ds": lambda: (sw._experts.clear(),
                                                                           sw.moe(MOE_DEEPSEEK, "deepseek-v2-lite"))}
    if not args.serial_compile:
        from pagedllm.worker.precompile import precompile

        t = elapsed()
        sw.collecting = True
        try:
            precompile(lambda: [sections[name]() for name in args.only], torch.device("cuda"))
        except Exception:  # noqa: BLE001 - the variants compile at their first launch instead
            traceback.print_exc()
        finally:
            sw.collecting = False
        print(f"[parallel compile of every variant: {elapsed() - t:.0f} s; {elapsed():.0f} s since start]", flush=True)
    for name in args.only:
        t = elapsed()
        try:
            sections[name]()
        except Exception:
            traceback.print_exc()
        print(f"[{name}: {elapsed() - t:.0f} s; {elapsed():.0f} s since start]", flush=True)
    print_results()
    return 0


if __name__ == "__main__":
    sys.exit(main())
