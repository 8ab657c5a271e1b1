"""Side-by-side peer: HF transformers' continuous batching (`generate_batch`) on workload W1.

Run on the GPU machine from the repository root, in the same command as pagedllm's own run:

    python3 scripts/peer_hf_generate_batch.py qwen3-0.6b              # W1: 256 requests
    python3 scripts/peer_hf_generate_batch.py llama3-8b 256 --timeout 290
    pagedllm bench throughput --model qwen3-0.6b --load-format dummy --dataset w1

Same model shape (pagedllm/model_configs/<name>/config.json, or any config directory), dummy
(random) weights in bf16, the same W1 requests token for token (drawn by
pagedllm/benchmarks/datasets.py), EOS ignored, each request with its own max_new_tokens. It times
the continuous-batching manager that `generate_batch` drives (`init_continuous_batching`), from the
first add_request to the last result, after a short `generate_batch` warm-up, as
/work/shared/peers/peer_hf_cb.py does. Greedy, as that peer: the sampling rule costs nothing next
to the forward passes. Prints one JSON line (output_tok_per_s); `--timeout` stops a run that would
not end and reports what finished.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_w1(num_prompts: int) -> tuple[list[list[int]], list[int]]:
    # Load datasets.py by path: it needs only the standard library, and importing the pagedllm
    # package would pull the whole engine into the peer's process.
    spec = importlib.util.spec_from_file_location("_pagedllm_datasets", REPO / "pagedllm/benchmarks/datasets.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while building SampleRequest
    spec.loader.exec_module(mod)
    reqs = mod.w1_requests(num_prompts)
    return [r.prompt_token_ids for r in reqs], [r.expected_output_len for r in reqs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="qwen3-0.6b, llama3-8b, or a directory with a config.json")
    p.add_argument("num_prompts", nargs="?", type=int, default=256)
    p.add_argument("--attn", default="paged|sdpa", help="attn_implementation for continuous batching")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the timed run")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg_dir = Path(args.model)
    if not (cfg_dir / "config.json").is_file():
        cfg_dir = REPO / "pagedllm/model_configs" / args.model
    config = AutoConfig.from_pretrained(cfg_dir)
    prompts, outs = load_w1(args.num_prompts)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, args.dtype), attn_implementation=args.attn
        )
    model.eval()
    gen = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    # Warm-up exactly as peer_hf_cb.py calls it (the manager below then starts the way it did there).
    model.generate_batch(prompts[:4], generation_config=gen, max_new_tokens=16)
    if args.device == "cuda":
        torch.cuda.synchronize()

    mgr = model.init_continuous_batching(generation_config=gen)
    mgr.start()
    t0 = time.perf_counter()
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        mgr.add_request(prompt, request_id=f"w1-{i}", max_new_tokens=out)
    finished = tokens = 0
    deadline = t0 + args.timeout
    while finished < len(prompts) and time.perf_counter() < deadline:
        r = mgr.get_result(timeout=max(0.1, min(5.0, deadline - time.perf_counter())))
        if r is not None and r.is_finished():
            finished += 1
            tokens += len(r.generated_tokens)
    elapsed = time.perf_counter() - t0
    mgr.stop(block=finished == len(prompts))  # a timed-out run is left behind, not joined
    result = {
        "peer": f"transformers-{transformers.__version__} continuous batching {args.attn}",
        "model": args.model,
        "requests": len(prompts),
        "finished": finished,
        "output_tokens": tokens,
        "expected_output_tokens": sum(outs),
        "seconds": round(elapsed, 2),
        "output_tok_per_s": round(tokens / elapsed, 1),
        "timed_out": finished < len(prompts),
    }
    print(json.dumps(result), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
