"""The seed articles' engine-after-engine loop on one GPU (§4.3 benchmark_model, §7.1
tune_performance): build an LLM, generate, `del llm; torch.cuda.empty_cache()` (no gc.collect, as
the articles write it), build the next. Before the fix the second engine failed with "other tensors
already allocated in this process 124.58 GiB".

    PYTHONPATH=. python scripts/gpu_seed_loop.py [--model qwen3-0.6b] [--rounds 4]

Default model: the bundled Qwen3-0.6B config with dummy weights (nothing to download). About
1-2 minutes on an H200. Look for: every round "ok", and allocated memory after `del` back to the
round-0 baseline (a few MiB), not growing by the ~125 GiB one engine holds at 0.9 utilization.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    assert torch.cuda.is_available(), "this script checks GPU memory; run it on a GPU machine"
    GiB = 1 << 30
    baseline = torch.cuda.memory_allocated() / GiB
    rows = []
    configs = [{}, {"max_num_seqs": 512, "max_num_batched_tokens": 16384}, {"enable_chunked_prefill": True},
               {"enforce_eager": False, "use_v2_block_manager": True}]
    for i in range(args.rounds):
        kwargs = configs[i % len(configs)]
        t0 = time.monotonic()
        status = "ok"
        try:
            llm = LLM(model=args.model, load_format=args.load_format, tensor_parallel_size=1,
                      gpu_memory_utilization=0.9, max_model_len=4096, trust_remote_code=True, **kwargs)
            prompts = [[1 + (j % 1000)] * 32 for j in range(64)]
            outs = llm.generate([{"prompt_token_ids": q} for q in prompts],
                                SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True), use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            held = torch.cuda.memory_allocated() / GiB
            del llm, outs
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - the table says what failed
            status, tokens, held = f"FAILED: {type(e).__name__}: {str(e)[:120]}", 0, float("nan")
        after = torch.cuda.memory_allocated() / GiB
        reserved = torch.cuda.memory_reserved() / GiB
        rows.append((i, str(kwargs) or "{}", status, tokens, held, after, reserved, time.monotonic() - t0))
        print(rows[-1], flush=True)
    print(f"\nbaseline allocated {baseline:.3f} GiB")
    print(f"{'round':>5} {'held GiB':>9} {'after del':>9} {'reserved':>9} {'tokens':>7} {'s':>6}  status / config")
    for i, cfg, status, tokens, held, after, reserved, secs in rows:
        print(f"{i:>5} {held:>9.2f} {after:>9.3f} {reserved:>9.3f} {tokens:>7} {secs:>6.1f}  {status} {cfg}")


if __name__ == "__main__":
    main()
