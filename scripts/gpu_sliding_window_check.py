"""Mistral v0.1's geometry on the GPU: a 32K context behind a 4K sliding window, greedy tokens equal
to transformers', in a KV pool far smaller than the context (blocks behind the window are freed:
core/kv_cache_manager.py). Table printed last.

Usage, from the repo root on the GPU machine (~2-3 min):
    PYTHONPATH=$PWD python3 scripts/gpu_sliding_window_check.py [--context 32000] [--new-tokens 64]
(a CPU smoke run of the same code: --device cpu --context 600 --window 64 --new-tokens 8;
--variants graphs runs only the first variant below, ~1.5 min)

The model is a random 2-layer MistralForCausalLM (hidden 512, 4 heads of 128, 2 KV heads,
max_position_embeddings 32768, sliding_window 4096) in fp32, so greedy tokens compare exactly.
For each prefill chunk size (8192 = 2 windows, with CUDA graphs; 2048 = half a window, eager):
  turn 1  a `--context`-token random prompt, `--new-tokens` greedy tokens
  turn 2  turn 1's prompt + output + 200 new tokens (a prefix hit through the last window only),
          16 greedy tokens
each compared with transformers' generate (sdpa, its sliding-window cache) on the same GPU. The pool
is 800 blocks of 16 (12,800 tokens < the context): the request is only accepted because a request
holds about (window + chunk) / 16 blocks; the peak number of blocks in use is printed.
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
import traceback

import torch
from _gpu_common import print_results, record

from tests import utils as test_utils
from tests.utils import track_peak_blocks

WINDOW = 4096  # --window
DEVICE = "cuda"  # --device
POOL_BLOCKS = 800
BLOCK = 16


def build_model(path: str):
    import transformers

    # Mistral-7B-v0.1's context and window, 2 narrow layers.
    cfg = transformers.MistralConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=1000,
                                     max_position_embeddings=32768, sliding_window=WINDOW,
                                     architectures=["MistralForCausalLM"])
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="sdpa").to(DEVICE).eval()


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    tokens = test_utils.hf_greedy(hf, prompt, n)  # on hf's device (DEVICE)
    return tokens, time.perf_counter() - t0


def run_pagedllm(path: str, chunk: int, eager: bool, prompt: list[int], n: int, follow_extra: list[int]):
    from pagedllm import LLM, SamplingParams

    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", max_model_len=32768, block_size=BLOCK,
              num_gpu_blocks_override=POOL_BLOCKS, max_num_batched_tokens=chunk, max_num_seqs=4,
              enable_prefix_caching=True, enforce_eager=eager, gpu_memory_utilization=0.3, device=DEVICE)
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.sliding_window == WINDOW, kv.sliding_window
    peak = track_peak_blocks(kv)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    t1 = time.perf_counter() - t0
    follow = prompt + list(out) + follow_extra
    hits = kv.prefix_cache_hits
    t0 = time.perf_counter()
    out2 = llm.generate([{"prompt_token_ids": follow}], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    t2 = time.perf_counter() - t0
    hit_tokens = kv.prefix_cache_hits - hits
    free_after = kv.block_pool.get_num_free_blocks()
    del llm
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return list(out), follow, list(out2), peak[0], hit_tokens, free_after, t1, t2


def main() -> None:
    global WINDOW, DEVICE
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=32000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--device", default=DEVICE)
    parser.add_argument("--variants", nargs="+", choices=("graphs", "eager"), default=["graphs", "eager"],
                        help="graphs: chunk 2 windows with CUDA graphs; eager: chunk half a window, eager")
    args = parser.parse_args()
    WINDOW, DEVICE = args.window, args.device
    print(torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch", torch.__version__, flush=True)
    path = tempfile.mkdtemp()
    hf = build_model(path)
    rng = random.Random(0)
    prompt = [rng.randrange(1, 1000) for _ in range(args.context)]
    follow_extra = [rng.randrange(1, 1000) for _ in range(200)]
    ref1, t_hf1 = hf_greedy(hf, prompt, args.new_tokens)
    record(f"transformers turn 1 ({args.context} + {args.new_tokens} tok)", f"{t_hf1:.1f} s")
    ref2 = None
    variants = {"graphs": (2 * WINDOW, False), "eager": (WINDOW // 2, True)}
    for chunk, eager in (variants[v] for v in args.variants):
        label = f"chunk {chunk} ({'>' if chunk > WINDOW else '<'} window), {'eager' if eager else 'CUDA graphs'}"
        try:
            out, follow, out2, peak, hit_tokens, free_after, t1, t2 = run_pagedllm(
                path, chunk, eager, prompt, args.new_tokens, follow_extra)
            if ref2 is None:
                ref2, t_hf2 = hf_greedy(hf, follow, 16)
                record(f"transformers turn 2 ({len(follow)} + 16 tok)", f"{t_hf2:.1f} s")
            same1 = sum(a == b for a, b in zip(out, ref1))
            same2 = sum(a == b for a, b in zip(out2, ref2))
            record(f"{label}: turn 1 greedy == transformers",
                   f"{'EQUAL' if out == ref1 else 'DIFFERENT'} ({same1}/{len(ref1)} positions, {t1:.1f} s)")
            record(f"{label}: turn 2 greedy == transformers",
                   f"{'EQUAL' if out2 == ref2 else 'DIFFERENT'} ({same2}/{len(ref2)}, prefix hit {hit_tokens} tok, "
                   f"{t2:.1f} s)")
            bound = -(-(WINDOW - 1 + chunk) // BLOCK) + 1
            whole = -(-(len(follow) + 16) // BLOCK)
            record(f"{label}: peak KV blocks in use",
                   f"{peak} of {POOL_BLOCKS} (bound {bound}; the whole context is {whole} blocks; "
                   f"{'all free after' if free_after == POOL_BLOCKS else f'{free_after} free after: LEAK'})")
        except Exception:
            traceback.print_exc()
            record(label, "ERROR (traceback above)")
    print_results()


if __name__ == "__main__":
    main()
