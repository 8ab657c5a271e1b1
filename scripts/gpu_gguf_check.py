"""GGUF blocks on the GPU (issue 19): kernels vs their torch reference at Llama-3.1-8B linear shapes, times
vs bf16 cuBLAS, a GEMV config sweep, the memory a GGUF model's weights take vs dense, and greedy
generation on the GPU vs the CPU. One call, < 3 minutes on one H200 (needs the `gguf` wheel):

    python3 scripts/gpu_gguf_check.py [--sections kernels,model,tiny,sweep,tests] [--budget 150]

kernels  Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K at (N, K) = (4096, 4096), (14336, 4096), (4096, 14336), M = 1, 4,
         16, 256, 2048 (random valid blocks): the repack's dequantization equals gguf.quants.dequantize
         (first 64 rows, bit for bit), `gguf_linear` (bf16 x) within 2e-2 of max |ref| of the fp32
         reference, and its time vs bf16 F.linear (cuBLAS); GB/s of the blocks at M = 1
sweep    GEMV configs (BLOCK_N, BLOCK_KP, split target, warps, stages; at M = 1 prefetching the next step,
         "/p", and the default tile also factored, "/f", and unprefetched) at M = 1 and 16, Q4_K / Q6_K;
         at M = 32 and 64 the GEMV (default config) vs dequantize + cuBLAS (where the dispatch switches)
model    a 2-layer GGUF with Llama-3.1-8B-sized layers (Q4_K; layer 0's down and layer 1's v Q6_K, as
         Q4_K_M files mix them), loaded in bf16 by
         the real selection: bytes of the model's weights vs the same file loaded dense, and greedy
         tokens of the block path vs the dense bf16 path
tiny     a tiny GGUF mixing all five types (+ Q5_K, dense): greedy tokens on the GPU (bf16, the real
         selection; and the block method forced in float32) vs the CPU float32 dense reference
tests    tests/kernels/test_gguf_kernels.py compiled for the GPU (subprocess; skipped after --budget s)
Times: CUDA-graph replays of 20 calls rotating over enough weight copies (>= 150 MB) that L2 cannot
hold them; microseconds per call. Table last.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gguf  # noqa: E402
from _gpu_common import rel_err, rotating_graph_us  # noqa: E402  (this script's folder is on sys.path)

from pagedllm.kernels.gguf_dequant import (  # noqa: E402
    GGUF_BLOCK,
    GGUFPacked,
    dequantize_packed,
    dequantize_packed_ref,
    repack_gguf_rows,
)
from pagedllm.kernels.gguf_gemv import (  # noqa: E402
    GGUFGemvConfig,
    gguf_gemv,
    gguf_gemv_config,
    gguf_linear,
    gguf_linear_ref,
)

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
MS = [1, 4, 16, 256, 2048]
ROTATE_BYTES = 150e6
RESULTS: list[tuple[str, str]] = []
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def record(name: str, value: str) -> None:
    RESULTS.append((name, value))
    print(f"## {name}: {value}", flush=True)


def random_raw(qtype: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(n, bytes) uint8 random blocks on the GPU with finite fp16 scales (w ~ N(0, ~0.05))."""
    qk, nbytes = GGUF_BLOCK[qtype]
    raw = torch.randint(0, 256, (n, k // qk, nbytes), dtype=torch.uint8, device="cuda", generator=gen)
    unit = {"Q4_0": 0.05 / 4.6, "Q4_1": 0.05 / 4.6, "Q8_0": 0.05 / 74, "Q4_K": 0.05 / 200, "Q6_K": 0.05 / 1300}
    d = (unit[qtype] * (0.5 + torch.rand(n, k // qk, device="cuda", generator=gen))).half()
    db = d.view(torch.uint8).reshape(n, k // qk, 2)
    if qtype == "Q6_K":
        raw[..., 208:210] = db
    else:
        raw[..., 0:2] = db
        if qtype == "Q4_1":
            raw[..., 2:4] = (-8 * d).half().view(torch.uint8).reshape(n, k // qk, 2)
        elif qtype == "Q4_K":
            raw[..., 2:4] = (7.5 * d).half().view(torch.uint8).reshape(n, k // qk, 2)
    return raw.reshape(n, -1)


def clone_packed(p: GGUFPacked) -> GGUFPacked:
    return p._replace(**{f: getattr(p, f).clone() for f in ("qs", "qh", "scales", "mins", "d", "dmin")
                         if getattr(p, f) is not None})


def run_kernels() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in SHAPES:
        dense_bytes = n * k * 2
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                 for _ in range(max(1, min(8, math.ceil(ROTATE_BYTES / dense_bytes))))]
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) for m in MS}
        base = {m: rotating_graph_us(lambda i, x=xs[m], w=dense: F.linear(x, w[i]), len(dense)) for m in MS}
        record(f"bf16 cuBLAS {n}x{k}", " / ".join(f"M={m} {base[m]:.1f} us" for m in MS)
               + f"; M=1 {dense_bytes / base[1] / 1e3:.0f} GB/s")
        for qtype in TYPES:
            raw = random_raw(qtype, n, k, gen)
            p = repack_gguf_rows(raw, qtype, k)
            expect = gguf.quants.dequantize(raw[:64].cpu().numpy(), gguf.GGMLQuantizationType[qtype])
            w_ref = dequantize_packed_ref(p)  # (K, N) fp32
            exact = np.array_equal(expect, w_ref[:, :64].T.cpu().numpy()) and torch.equal(
                dequantize_packed(p, torch.float32), w_ref)
            del w_ref
            del raw
            copies = [p] + [clone_packed(p) for _ in range(max(0, min(7, math.ceil(ROTATE_BYTES / p.nbytes())) - 1))]
            cells, worst = [], 0.0
            for m in MS:
                err = rel_err(gguf_linear(xs[m], p), gguf_linear_ref(xs[m], p))
                worst = max(worst, err)
                us = rotating_graph_us(lambda i, x=xs[m], c=copies: gguf_linear(x, c[i]), len(copies))
                cells.append(f"M={m} {us:.1f} us ({base[m] / us:.2f}x)")
                if m == 1:
                    gbs = p.nbytes() / us / 1e3
            ok = "ok" if exact and worst <= 2e-2 else "FAIL"
            record(f"{qtype} {n}x{k}", f"{ok} (dequant exact {exact}, max rel err {worst:.1e}); "
                   + " / ".join(cells) + f"; M=1 {gbs:.0f} GB/s of {p.nbytes() / 1e6:.1f} MB")
            copies = p = None
            torch.cuda.empty_cache()
        dense = None


def run_sweep() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    # (BLOCK_N, BLOCK_KP, split target (programs), warps, stages); the default is timed beside them
    # (none of these spills registers on sm_90 for Q4_K / Q6_K)
    grid = {1: [(128, 32, 512, 8, 3), (256, 16, 512, 8, 3), (64, 32, 1024, 4, 3), (64, 16, 1024, 4, 4),
                (128, 16, 1024, 8, 4)],
            16: [(128, 16, 192, 8, 2), (128, 32, 192, 8, 3), (256, 16, 384, 8, 3), (64, 16, 384, 4, 3)]}
    for qtype in ("Q4_K", "Q6_K"):
        for n, k in SHAPES:
            p = repack_gguf_rows(random_raw(qtype, n, k, gen), qtype, k)
            copies = [p] + [clone_packed(p) for _ in range(max(0, min(7, math.ceil(ROTATE_BYTES / p.nbytes())) - 1))]
            for m, cfgs in grid.items():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                ref = gguf_linear_ref(x, p)
                res = []
                default = gguf_gemv_config(m, p)
                # M = 1: every config prefetching ("/p", the default's choice), the default tile also with
                # the scales factored out of the inner loop ("/f") and without prefetch (round 2's kernel)
                if m == 1:
                    variants = [(c, False, True) for c in cfgs] + [((128, 16, 512, 8, 3), True, True),
                                                                   ((128, 16, 512, 8, 3), False, False)]
                else:
                    variants = [(c, False, False) for c in cfgs]
                for (bn, bk, target, warps, stages), fac, pre in variants:
                    steps = k // (bk * 8)  # Q4_K / Q6_K: 8 values a word
                    split = 1
                    while math.ceil(n / bn) * split < target and split * 8 <= steps:
                        split *= 2
                    cfg = GGUFGemvConfig(bn, bk, split, warps, stages, fac, pre)
                    name = f"{bn}/{bk}/s{split}/w{warps}/st{stages}{'/f' if fac else ''}{'/p' if pre else ''}"
                    try:
                        err = rel_err(gguf_gemv(x, p, None, cfg), ref)
                        us = rotating_graph_us(lambda i, cfg=cfg, x=x, c=copies: gguf_gemv(x, c[i], None, cfg), len(copies))
                        res.append((us, name, err))
                    except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                        res.append((float("inf"), f"{name} {type(e).__name__}", 0))
                res.sort()
                best = res[0]
                dus = rotating_graph_us(lambda i, x=x, c=copies: gguf_gemv(x, c[i]), len(copies))
                record(f"sweep {qtype} {n}x{k} M={m}",
                       f"best {best[1]} {best[0]:.1f} us ({p.nbytes() / best[0] / 1e3:.0f} GB/s, err {best[2]:.0e}); "
                       f"default {tuple(default)} {dus:.1f} us; others "
                       + ", ".join(f"{name} {us:.1f}" for us, name, _ in res[1:]))
            for m in (32, 64):  # mid-size batches: the GEMV (weights read once) vs dequantize + cuBLAS
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                ref = gguf_linear_ref(x, p)
                err = max(rel_err(gguf_gemv(x, p), ref), rel_err(gguf_linear(x, p, None, dequant_min_m=1), ref))
                g_us = rotating_graph_us(lambda i, x=x, c=copies: gguf_gemv(x, c[i]), len(copies))
                d_us = rotating_graph_us(lambda i, x=x, c=copies: gguf_linear(x, c[i], None, dequant_min_m=1), len(copies))
                record(f"mid-M {qtype} {n}x{k} M={m}", f"GEMV {g_us:.1f} us vs dequant + cuBLAS {d_us:.1f} us "
                       f"(max rel err {err:.0e})")
            copies = p = None
            torch.cuda.empty_cache()


def model_bytes(model: torch.nn.Module) -> int:
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    return total + sum(p.nbytes() for m in model.modules() for p in getattr(m, "gguf_packed", ()))


def build(path: str, **kw):
    from pagedllm import LLM

    llm = LLM(path, max_model_len=256, num_gpu_blocks_override=64, enable_prefix_caching=False, **kw)
    return llm, llm.llm_engine.engine_core.model_executor.driver_worker.model


def greedy(llm, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    from pagedllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def drop(llm) -> None:
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def match(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b))
    first = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None) for x, y in zip(a, b)]
    return f"{same}/{len(a)} prompts identical (first divergence per prompt {first})"


PROMPTS = [[5, 80, 81, 200], [7] * 30, list(range(10, 60)), [3, 9, 27, 81, 243, 100]]


def run_model(tmp: str) -> None:
    from transformers import LlamaConfig

    from pagedllm.loader import model_loader
    from pagedllm.quantization.gguf_gpu import GGUFGPULinearMethod
    from tests.kernels.gguf_blocks import write_random_llama_gguf

    config = LlamaConfig(vocab_size=263, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096)
    types = [("Q4_K", "Q4_K", "Q4_K", "Q6_K"), (("Q4_K", "Q4_K", "Q6_K"), "Q4_K", "Q4_K", "Q4_K")]
    path = write_random_llama_gguf(os.path.join(tmp, "llama8b-2layers-q4km.gguf"), config, types,
                                   np.random.default_rng(0), std=0.02, head_type="Q6_K")
    log(f"wrote {os.path.getsize(path) / 1e6:.0f} MB")
    # CUDA graphs (decode batches 1, 2, 4: the GEMV captured as served, split-K workspace included)
    llm, model = build(str(path), dtype="bfloat16", max_num_seqs=4, cudagraph_capture_sizes=[1, 2, 4])
    n_blocks = sum(isinstance(getattr(m, "quant_method", None), GGUFGPULinearMethod) for m in model.modules())
    q_bytes, q_tok = model_bytes(model), greedy(llm, PROMPTS)
    drop(llm)
    orig = model_loader.get_quant_config
    model_loader.get_quant_config = lambda *a: None
    try:
        llm, model = build(str(path), dtype="bfloat16", enforce_eager=True)
        d_bytes, d_tok = model_bytes(model), greedy(llm, PROMPTS)
        drop(llm)
    finally:
        model_loader.get_quant_config = orig
    record("8B-layer GGUF (Q4_K/Q6_K) weights on the GPU",
           f"{n_blocks} linears on blocks (expect 9: 8 + the LM head); {q_bytes / 1e9:.3f} GB vs dense bf16 {d_bytes / 1e9:.3f} GB "
           f"({q_bytes / d_bytes:.2f}x); file {os.path.getsize(path) / 1e9:.3f} GB")
    record("8B-layer GGUF greedy, blocks vs dense bf16 (GPU)", match(q_tok, d_tok))


def run_tiny(tmp: str) -> None:
    from transformers import LlamaConfig

    from pagedllm.loader import model_loader
    from pagedllm.loader.gguf_weights import gguf_tensor_types
    from pagedllm.quantization.gguf import GGUFConfig
    from pagedllm.quantization.gguf_gpu import GGUFGPULinearMethod
    from tests.kernels.gguf_blocks import write_random_llama_gguf

    config = LlamaConfig(vocab_size=263, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    types = [(("Q4_K", "Q4_K", "Q6_K"), "Q6_K", "Q4_K", "Q6_K"), ("Q4_0", "Q8_0", "Q4_1", "Q5_K")]
    path = str(write_random_llama_gguf(os.path.join(tmp, "tiny-mixed.gguf"), config, types,
                                       np.random.default_rng(0), head_type="Q6_K"))
    orig = model_loader.get_quant_config
    forced = GGUFConfig(gguf_tensor_types(path), gpu=True)
    runs = {"cpu": (lambda *a: None, dict(dtype="float32", device="cpu", kv_cache_dtype="float32")),
            "bf16": (orig, dict(dtype="bfloat16", enforce_eager=True)),
            "fp32": (lambda *a: forced, dict(dtype="float32", enforce_eager=True))}
    tokens = {}
    for name, (quant, kw) in runs.items():
        model_loader.get_quant_config = quant
        try:
            llm, model = build(path, **kw)
            blocks = sum(isinstance(getattr(m, "quant_method", None), GGUFGPULinearMethod) for m in model.modules())
            tokens[name] = greedy(llm, PROMPTS, 24)
            drop(llm)
            log(f"tiny {name}: {blocks} linears on blocks")
        except Exception as e:  # noqa: BLE001 - report and go on with the other runs
            record(f"tiny mixed GGUF {name} run", f"FAILED {type(e).__name__}: {str(e)[:200]}")
        finally:
            model_loader.get_quant_config = orig
    if "cpu" in tokens:
        for name, what in (("fp32", "GPU fp32 blocks (forced)"), ("bf16", "GPU bf16 blocks (real selection)")):
            if name in tokens:
                record(f"tiny mixed GGUF greedy, {what} vs CPU fp32 dense", match(tokens[name], tokens["cpu"]))


def run_tests() -> None:
    import subprocess

    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_gguf_kernels.py"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = (r.stdout + r.stderr).strip().splitlines()
    record("tests/kernels/test_gguf_kernels.py on the GPU",
           " | ".join([ln for ln in lines if ln.startswith("FAILED")][:5] + lines[-1:]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="kernels,model,tiny,sweep,tests")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds after which the tests section is skipped")
    args = ap.parse_args()
    sections = args.sections.split(",")
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("kernels", run_kernels), ("model", lambda: run_model(tmp)), ("tiny", lambda: run_tiny(tmp)),
                         ("sweep", run_sweep), ("tests", run_tests)):
            if name == "tests" and time.time() - T0 > args.budget:
                record("section tests", f"skipped: {time.time() - T0:.0f} s spent (--budget {args.budget:.0f})")
                continue
            if name in sections:
                log(f"section {name}")
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - one failed section must not hide the others
                    import traceback

                    traceback.print_exc()
                    record(f"section {name}", f"FAILED {type(e).__name__}: {str(e)[:200]}")
    log("done")
    print("\n| check | result |\n|---|---|")
    for name, value in RESULTS:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
