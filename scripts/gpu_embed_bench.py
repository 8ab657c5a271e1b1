"""Embedding throughput on one GPU: pagedllm's pooling runner beside vLLM 0.21's, same texts, one call.

    python3 scripts/gpu_embed_bench.py MODEL_DIR [--num-texts 20000] [--dtype float16]

MODEL_DIR: an all-MiniLM-L6-v2 folder (config, tokenizer, sentence-transformers' pooling files); the
weights are dummy for both engines (`load_format="dummy"`: throughput does not depend on their values,
and the CPU benchmark, scripts/bench_embed.py, holds our outputs to sentence-transformers'). vLLM runs in
a child process with PYTHONPATH=$VLLM_SITE (default /tmp/site) after ours has freed the GPU. Texts: the
docstring pieces of scripts/bench_embed.py (~89 tokens each), truncated at the model's 256 tokens by both.
Each engine embeds all texts once to warm up, then three timed passes; texts/s of the best pass and the
start-up time are printed, a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
from vllm import LLM
texts = json.load(open(sys.argv[1]))
t0 = time.perf_counter()
llm = LLM(model=sys.argv[2], runner="pooling", load_format="dummy", dtype=sys.argv[3])
ready = time.perf_counter() - t0
llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
best = float("inf")
for _ in range(3):
    s = time.perf_counter()
    llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
    best = min(best, time.perf_counter() - s)
print("RESULT", json.dumps({"ready_s": ready, "best_s": best}))
"""


def ours(texts: list[str], model: str, dtype: str) -> dict[str, float]:
    import torch

    from pagedllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=model, runner="pooling", load_format="dummy", dtype=dtype)
    ready = time.perf_counter() - t0
    out = llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
    assert len(out) == len(texts) and len(out[0].outputs.embedding) == 384, "wrong embedding shape"
    best = float("inf")
    for _ in range(3):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        s = time.perf_counter()
        llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
        best = min(best, time.perf_counter() - s)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"ready_s": ready, "best_s": best}


def vllm(texts: list[str], model: str, dtype: str, path: str) -> dict[str, float] | str:
    site = os.environ.get("VLLM_SITE", "/tmp/site")
    env = dict(os.environ, PYTHONPATH=site, HF_HUB_OFFLINE="1", VLLM_USE_FLASHINFER_SAMPLER="0")
    proc = subprocess.run([sys.executable, "-c", CHILD, path, model, dtype], env=env, capture_output=True,
                          text=True, timeout=400)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return "failed: " + (proc.stderr or proc.stdout)[-1500:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--num-texts", type=int, default=20000)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    from bench_embed import make_texts

    base = make_texts(1000)
    texts = [base[i % len(base)] + ("" if i < len(base) else f" ({i // len(base)})") for i in range(args.num_texts)]
    path = "/tmp/embed_texts.json"
    with open(path, "w") as f:
        json.dump(texts, f)
    rows = [("pagedllm", ours(texts, args.model, args.dtype))]
    if not args.skip_vllm:
        rows.append(("vLLM 0.21", vllm(texts, args.model, args.dtype, path)))
    print(f"\n{args.num_texts} texts, {args.dtype}, dummy weights, best of 3 passes")
    print("| engine | ready s | texts/s | ratio to vLLM |")
    print("|---|---|---|---|")
    peer = rows[-1][1]["best_s"] if len(rows) == 2 and isinstance(rows[-1][1], dict) else None
    for name, r in rows:
        if isinstance(r, str):
            print(f"| {name} | {r[:300]} | | |")
            continue
        ratio = f"{peer / r['best_s']:.2f}x" if peer else ""
        print(f"| {name} | {r['ready_s']:.1f} | {args.num_texts / r['best_s']:,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
