"""Model-level check of the FP8 switches that change a model's arithmetic, on a GPU (issue 19).

PAGEDLLM_FP8_DEFER_SCALES=1 (an FP8 linear's per-token and per-channel scales applied by the kernel after
it) and PAGEDLLM_FP8_KV_DOTS=1 (an fp8 cache's e4m3 QK loop) were checked kernel by kernel; this runs a
whole model (random bf16 weights as transformers initializes them, quantized online to FP8) with each
switch off and on, and holds every run to the same model unquantized (bf16 weights, bf16 cache): 64 prompts
of 8-40 random tokens, prefill chunks of <= 256 rows (max_num_batched_tokens 256) and decode batches of 64 rows
(the deferred GEMMs' 17-256 row range), 48 greedy tokens with the top-20 log-probabilities of each position.
Compared with the bf16 run: |d logprob| of the tokens in both top-20 lists at every position whose context is
the same (the equal prefix and the first position after it), the sequences equal and the mean equal prefix
(random weights make near-ties, so sequences part with any rounding; the log-probabilities are the measure).
A switch that adds no error gives the same teacher-forced error as the run without it.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8_defer_check.py [--prompts 64] [--tokens 48] [RUN ...]

RUN: TAG[:ENV=V,ENV=V[:kv|bf16]], parsed as gpu_fp8_w1_ab.py's run specs (a value may hold commas; kv: an fp8
KV cache; bf16: no quantization, the reference; the first run must be it); default: DEFAULT_RUNS. Each run is its own process (the switches are read at import).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_fp8_w1_ab import parse_run  # noqa: E402 - the same TAG:ENV=V,...:REST run specs

TOP = 20  # top log-probabilities returned per position (the compared distribution)
DEFAULT_RUNS = [
    "bf16::bf16",
    "fp8:PAGEDLLM_FP8_DEFER_SCALES=0,PAGEDLLM_FP8_KV_DOTS=0",
    "fp8-defer-o-down:PAGEDLLM_FP8_DEFER_SCALES=1,PAGEDLLM_FP8_DEFER_LINEARS=o,down",
    "fp8-defer-all:PAGEDLLM_FP8_DEFER_SCALES=1,PAGEDLLM_FP8_DEFER_LINEARS=qkv,o,gate_up,down",
    "fp8-kv-v0:PAGEDLLM_FP8_DEFER_SCALES=0,PAGEDLLM_FP8_KV_DOTS=0:kv",
    "fp8-kv-dots:PAGEDLLM_FP8_DEFER_SCALES=0,PAGEDLLM_FP8_KV_DOTS=1:kv",
    "fp8-kv-dots-defer-all:PAGEDLLM_FP8_DEFER_SCALES=1,PAGEDLLM_FP8_KV_DOTS=1,PAGEDLLM_FP8_DEFER_LINEARS=qkv,o,gate_up,down:kv",
]


def write_model(root: str) -> str:
    """A 4-layer Llama with Llama-3.1-8B's head layout (32 / 8 heads of 128 would be 4096 wide; here 16 / 4
    heads of 128: 2048), bf16, saved as transformers writes it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=2048, intermediate_size=7168, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=1024,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.05,
                         torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    path = os.path.join(root, "tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


def child(model: str, mode: str, prompts: int, tokens: int, out: str) -> None:
    import random

    from pagedllm import LLM, SamplingParams

    rng = random.Random(0)
    ids = [[rng.randrange(8192) for _ in range(rng.randint(8, 40))] for _ in range(prompts)]
    llm = LLM(model, quantization=None if mode == "bf16" else "fp8", skip_tokenizer_init=True, max_model_len=512,
              gpu_memory_utilization=0.3, kv_cache_dtype="fp8" if mode == "kv" else "auto",
              enable_prefix_caching=False, max_num_batched_tokens=256, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)
    rows = [{"ids": list(o.outputs[0].token_ids),
             "top": [{str(t): lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]} for o in outs]
    json.dump(rows, open(out, "w"))


def compare(ref: list[dict], run: list[dict]) -> tuple[float, float, int, float]:
    """(mean, max |d logprob| over the positions whose context equals the reference's, for the tokens in
    both top-TOP lists; sequences equal; mean equal prefix)."""
    deltas, equal, prefix = [], 0, 0
    for x, y in zip(ref, run):
        n = 0
        while n < min(len(x["ids"]), len(y["ids"])) and x["ids"][n] == y["ids"][n]:
            n += 1
        equal += n == len(x["ids"]) == len(y["ids"])
        prefix += n
        for i in range(min(n + 1, len(x["ids"]), len(y["ids"]))):  # position n: same context, another pick
            a, b = x["top"][i], y["top"][i]
            deltas += [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
    return sum(deltas) / max(1, len(deltas)), max(deltas, default=0.0), equal, prefix / max(1, len(ref))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "MODE", "OUT"))
    ap.add_argument("runs", nargs="*")
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.prompts, args.tokens, args.child[2])
        return 0
    root = tempfile.mkdtemp(prefix="fp8_defer_")
    model = write_model(root)
    results: dict[str, dict] = {}
    for spec in args.runs or DEFAULT_RUNS:
        tag, switches, modes = parse_run(spec)  # gpu_fp8_w1_ab's run specs, the flags part the mode here
        env = {**os.environ, **switches}
        mode = modes[0] if modes else ""
        out = os.path.join(root, f"{tag}.json")
        proc = subprocess.run([sys.executable, __file__, "--prompts", str(args.prompts), "--tokens", str(args.tokens),
                               "--child", model, mode or "fp8", out], env=env, capture_output=True, text=True,
                              timeout=300)
        if proc.returncode:
            print(f"{tag}: FAILED rc {proc.returncode}\n{proc.stderr[-2000:]}")
            continue
        results[tag] = json.load(open(out))
        print(f"{tag}: done", flush=True)
    if not results:
        return 1
    ref = next(iter(results))
    print(f"\n| run (against {ref}) | mean abs d-logprob, same context | max | greedy sequences equal / "
          f"{args.prompts} | mean equal prefix / {args.tokens} |")
    print("|---|---|---|---|---|")
    for tag, run in results.items():
        if tag != ref:
            mean, mx, equal, prefix = compare(results[ref], run)
            print(f"| {tag} | {mean:.4f} | {mx:.3f} | {equal} | {prefix:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
