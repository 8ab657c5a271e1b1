# vLLM batch-1 / batch-32 decode step time as the side-by-side peer: ../shared/peers/peer_vllm_latency.py,
# copied unchanged below these comment lines (its style kept, hence the ruff exemption). Run by
# scripts/gpu_bench.sh (section vllm-latency) when vLLM 0.21.0 is under /tmp/site. Same prompts and
# step definition as `pagedllm bench latency` / scripts/gpu_check.py latency_run. Not part of the package.
# ruff: noqa: E401, E702, I001
"""Peer anchor: vLLM single-request decode latency (batch 1) and batch-32 step time, dummy weights.

Usage: python3 peer_vllm_latency.py CONFIG_DIR
Prints time per output token at batch 1 (prompt 128, 256 new tokens) and at batch 32.
"""
import json, random, sys, time

def main():
    cfg = sys.argv[1]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=cfg, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0)
    rng = random.Random(1)
    res = {"peer": "vllm", "config": cfg}
    for bs in (1, 32):
        prompts = [TokensPrompt(prompt_token_ids=[rng.randint(0, 10000) for _ in range(128)]) for _ in range(bs)]
        for new in (1, 257):
            sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new, detokenize=False)
            llm.generate(prompts, sp, use_tqdm=False)  # warm
            t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); res[f"bs{bs}_new{new}_s"] = time.perf_counter() - t
        res[f"bs{bs}_ms_per_step"] = round((res[f"bs{bs}_new257_s"] - res[f"bs{bs}_new1_s"]) / 256 * 1000, 3)
    print(json.dumps(res), flush=True)

if __name__ == "__main__":
    main()
