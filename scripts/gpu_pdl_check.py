"""Programmatic dependent launch (kernels/pdl.py) on a GPU: the same tokens with and without, and the time.

    PYTHONPATH=$PWD python3 scripts/gpu_pdl_check.py [--cfg DIR] [--budget S]

For each model (Llama-3.1-8B shape, dummy weights: bf16, and AWQ int4 g128 when --cfg names the folder
gpu_quant_bench.sh writes its configs to), one process per PAGEDLLM_PDL value:
  tokens   greedy, 8 prompts x 48 tokens at batch 1 (one request at a time) and at batch 8, token ids
           compared between PDL off and on (PDL changes when kernels start, not what they compute: the
           ids must be equal)
  latency  `pagedllm bench latency --batch-size 1 --input-len 128 --output-len 257`, the decode step
Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def tokens_child(model: str, out: str) -> None:
    import random

    from pagedllm import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(8000) for _ in range(rng.randint(16, 64))]} for _ in range(8)]
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=1024, gpu_memory_utilization=0.5,
              enable_prefix_caching=False, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    one = [list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
    batch = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    json.dump({"one": one, "batch": batch}, open(out, "w"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None, help="gpu_quant_bench.sh's OUT/cfg (for the AWQ config)")
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--child", nargs=2)
    args = ap.parse_args()
    if args.child:
        tokens_child(*args.child)
        return 0
    t0 = time.monotonic()
    models = [("bf16", "pagedllm/model_configs/llama3-8b")]
    if args.cfg:
        models.append(("awq", os.path.join(args.cfg, "llama3-8b-awq")))
    root = tempfile.mkdtemp(prefix="pdl_")
    rows = []
    for tag, model in models:
        toks, steps = {}, {}
        for pdl in ("0", "1"):
            if time.monotonic() - t0 > args.budget - 90:
                print(f"(budget: {tag} PDL={pdl} skipped)")
                continue
            env = {**os.environ, "PAGEDLLM_PDL": pdl}
            out = os.path.join(root, f"{tag}_{pdl}.json")
            p = subprocess.run([sys.executable, __file__, "--child", model, out], env=env, capture_output=True,
                               text=True, timeout=300)
            if p.returncode:
                print(f"{tag} PDL={pdl} tokens FAILED\n{p.stderr[-1500:]}")
            else:
                toks[pdl] = json.load(open(out))
            lat = os.path.join(root, f"lat_{tag}_{pdl}.json")
            p = subprocess.run([sys.executable, "-m", "pagedllm", "bench", "latency", "--model", model, "--load-format",
                                "dummy", "--skip-tokenizer-init", "--batch-size", "1", "--input-len", "128",
                                "--output-len", "257", "--max-model-len", "4096", "--num-iters", "3",
                                "--num-iters-warmup", "1", "--output-json", lat], env=env, capture_output=True,
                               text=True, timeout=300)
            step = [line for line in p.stdout.splitlines() if "Decode step" in line]
            steps[pdl] = step[-1].strip() if step else f"FAILED {p.stderr[-800:]}"
            print(f"[{time.monotonic() - t0:.0f} s] {tag} PDL={pdl}: {steps[pdl]}", flush=True)
        same = {k: toks["0"][k] == toks["1"][k] for k in ("one", "batch")} if len(toks) == 2 else "n/a"
        rows.append((tag, same, steps.get("0"), steps.get("1")))
    print("\n| model | tokens equal (batch 1, batch 8) | decode step, PDL off | PDL on |\n|---|---|---|---|")
    for tag, same, off, on in rows:
        print(f"| {tag} | {same} | {off} | {on} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
