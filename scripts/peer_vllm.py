# vLLM as the side-by-side peer on W1: ../shared/peers/peer_vllm.py, copied unchanged below these
# comment lines (its style kept, hence the ruff exemption). scripts/gpu_bench.sh runs it on the GPU machine
# when vLLM 0.21.0 is under /tmp/site (../shared/peers/README.md says how to carry its payload). Its W1
# is ours token for token (same generator, seed 0: 133,966 output tokens). Not part of the package.
# ruff: noqa: E401, E702, I001
"""Peer anchor: vLLM (0.21.0, the newest release built for torch 2.11 + CUDA 13) on workload W1, same as nano-vllm's bench.

Usage: python3 peer_vllm.py CONFIG_DIR [N] [--eager]
Dummy weights (load_format="dummy"), no tokenizer, prompts as token ids, temperature 0.6, ignore_eos.
"""
import json, random, sys, time

def main():
    cfg = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 256
    eager = "--eager" in sys.argv
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    outs = [rng.randint(100, 1024) for _ in range(n)]
    t0 = time.perf_counter()
    llm = LLM(model=cfg, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, enforce_eager=eager, seed=0)
    ready = time.perf_counter() - t0
    sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o, detokenize=False) for o in outs]
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=8, detokenize=False), use_tqdm=False)
    t = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
    dt = time.perf_counter() - t
    toks = sum(len(r.outputs[0].token_ids) for r in res)
    import vllm
    print(json.dumps({"peer": f"vllm-{vllm.__version__}", "config": cfg, "eager": eager, "requests": n, "output_tokens": toks,
                      "expected_output_tokens": sum(outs), "seconds": round(dt, 2), "output_tok_per_s": round(toks / dt, 1),
                      "startup_s": round(ready, 1)}), flush=True)

if __name__ == "__main__":
    main()
