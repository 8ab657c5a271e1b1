"""W1 on an MoE shape, pagedllm and vLLM 0.21 in one call, plus the fused MoE kernel per step against
its floor. Table printed last.

Usage, from the repo root on the GPU machine, vLLM under /tmp/site (../shared/peers/README.md):
    PYTHONPATH=$PWD python3 scripts/gpu_moe_w1.py qwen3-30b-a3b      (~4 min)
    PYTHONPATH=$PWD python3 scripts/gpu_moe_w1.py deepseek-v2-lite   (~4 min)
Both in one call (~8 min): pass both names. --skip-vllm runs pagedllm only.

W1 is the peers' workload (scripts/peer_vllm.py): 256 requests, prompts of 100-1024 random token ids,
100-1024 new tokens each (ignore_eos, temperature 0.6), dummy bf16 weights, max_model_len 4096, on the
real models' shapes (pagedllm/model_configs/<name>/config.json). pagedllm runs
`pagedllm bench throughput --dataset w1` (the same requests, token for token); vLLM runs
scripts/peer_vllm.py on the same config directory. Both report output tokens per second of the
generate call alone (start-up excluded, shown separately). The kernel section times `fused_experts`
(CUDA-graph replay) at W1's decode batch sizes for the model's expert shape: per layer and per step
(x the MoE layers), against the floor of reading the experts hit once at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

from _gpu_common import bench_w1, copy_bandwidth, graph_time_us, moe_expert_weights, moe_floor_us, print_results, record

MODELS = ("qwen3-30b-a3b", "deepseek-v2-lite")


def config_dir(model: str) -> str:
    return os.path.join(os.getcwd(), "pagedllm", "model_configs", model)


def run_pagedllm(model: str) -> float | None:
    r, proc, seconds = bench_w1(model, timeout=200)
    if r is None:
        record(f"pagedllm W1 {model}", f"FAILED rc={proc.returncode}")
        return None
    record(f"pagedllm W1 {model}", f"{r['output_tokens_per_second']:.0f} output tok/s ({r['total_output_tokens']} tokens "
           f"in {r['elapsed_time']:.1f} s; ready in {r['startup_seconds']:.0f} s; {seconds:.0f} s in all)")
    return float(r["output_tokens_per_second"])


def run_vllm(model: str) -> float | None:
    site = os.environ.get("VLLM_SITE", "/tmp/site")
    if not os.path.isdir(os.path.join(site, "vllm")):
        record(f"vLLM W1 {model}", f"not run: no vLLM under {site}")
        return None
    env = dict(os.environ, PYTHONPATH=site, HF_HUB_OFFLINE="1", VLLM_USE_FLASHINFER_SAMPLER="0")
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "scripts/peer_vllm.py", config_dir(model)], env=env,
                              capture_output=True, text=True, timeout=230)
    except subprocess.TimeoutExpired:
        record(f"vLLM W1 {model}", "FAILED: over 230 s")
        return None
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("{") and '"peer"' in ln), None)
    if line is None:
        print(proc.stdout[-3000:], proc.stderr[-6000:], flush=True)
        record(f"vLLM W1 {model}", f"FAILED rc={proc.returncode}")
        return None
    r = json.loads(line)
    record(f"vLLM W1 {model}", f"{r['output_tok_per_s']:.0f} output tok/s ({r['output_tokens']} tokens in "
           f"{r['seconds']:.1f} s; ready in {r['startup_s']:.0f} s; {time.monotonic() - t0:.0f} s in all)")
    return float(r["output_tok_per_s"])


def kernel_per_step(model: str) -> None:
    import torch

    from pagedllm.kernels.fused_moe import _config, fused_experts
    from pagedllm.layers.fused_moe.router import select_experts

    with open(os.path.join(config_dir(model), "config.json")) as f:
        cfg = json.load(f)
    e = cfg.get("num_experts") or cfg["n_routed_experts"]
    top_k, hidden, inter = cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    moe_layers = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 0)
    bw = copy_bandwidth()
    w13, w2 = moe_expert_weights(e, hidden, inter)
    from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

    for t in (3, 300):  # the kernel (align included) against the torch reference, on this GPU
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = select_experts(torch.randn(t, e, device="cuda"), top_k, True)
        got, ref = fused_experts(x, w13, w2, weights, ids).float(), fused_experts_ref(x, w13, w2, weights, ids).float()
        rel = ((got - ref).norm() / ref.norm()).item()
        record(f"fused MoE {model} {t} tokens == torch reference", f"{'OK' if rel < 2e-2 else 'WRONG'} (rel err {rel:.1e})")
    for t in (1, 32, 128, 256):  # W1's decode batches: 256 running at first, fewer at the tail
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = select_experts(torch.randn(t, e, device="cuda"), top_k, True)
        us = graph_time_us(functools.partial(fused_experts, x, w13, w2, weights, ids))
        hit = int(torch.unique(ids).numel())
        floor = moe_floor_us(hit, hidden, inter, bw)
        tiles = "/".join(str(v) for v in _config(t * top_k, torch.bfloat16).values())
        record(f"fused MoE {model}, decode batch {t} ({hit}/{e} experts hit, tiles {tiles})",
               f"{us:.0f} us per layer, {us * moe_layers / 1000:.2f} ms per step ({moe_layers} MoE layers); floor "
               f"{floor * moe_layers / 1000:.2f} ms at {bw / 1e12:.2f} TB/s: {floor / us * 100:.0f}% of floor speed")
    del w13, w2
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+", choices=MODELS)
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    start = time.monotonic()
    for model in args.models:
        ours = run_pagedllm(model)
        peer = None if args.skip_vllm else run_vllm(model)
        if ours and peer:
            target = 1.15 if model == "qwen3-30b-a3b" else 1.0
            record(f"W1 {model}: pagedllm / vLLM", f"{ours / peer:.2f}x (target >= {target}x: "
                   f"{'MET' if ours / peer >= target else 'NOT MET'})")
    # Last, in this process: the engines above each had the whole GPU to themselves.
    for model in args.models:
        try:
            kernel_per_step(model)
        except Exception as exc:
            record(f"fused MoE {model}", f"ERROR {exc!r}")
    print(f"[{time.monotonic() - start:.0f} s in all]")
    print_results()


if __name__ == "__main__":
    main()
