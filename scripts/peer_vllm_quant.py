# vLLM as the side-by-side peer on W1 with a quantized config: ../shared/peers/peer_vllm.py's W1 (same
# generator, seed 0, same prompts and output lengths as ours), plus vLLM's quantization / KV-cache
# flags. Run by scripts/gpu_quant_bench.sh when vLLM 0.21.0 is under /tmp/site. Not part of the package.
# ruff: noqa: E401, E702, I001
"""Usage: python3 peer_vllm_quant.py CONFIG_DIR [--quantization Q] [--kv-cache-dtype D] [--gpu-memory-utilization F]

Dummy weights (load_format="dummy", in the quantized layout the config's quantization_config asks for),
no tokenizer, prompts as token ids, temperature 0.6, ignore_eos.
"""
import argparse, json, random, time

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config"); ap.add_argument("--quantization", default=None); ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9); ap.add_argument("-n", type=int, default=256)
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(a.n)]
    outs = [rng.randint(100, 1024) for _ in range(a.n)]
    t0 = time.perf_counter()
    llm = LLM(model=a.config, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0,
              quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype, gpu_memory_utilization=a.gpu_memory_utilization)
    ready = time.perf_counter() - t0
    sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o, detokenize=False) for o in outs]
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=8, detokenize=False), use_tqdm=False)
    t = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
    dt = time.perf_counter() - t
    toks = sum(len(r.outputs[0].token_ids) for r in res)
    import vllm
    print(json.dumps({"peer": f"vllm-{vllm.__version__}", "config": a.config, "quantization": a.quantization,
                      "kv_cache_dtype": a.kv_cache_dtype, "requests": a.n, "output_tokens": toks,
                      "seconds": round(dt, 2), "output_tok_per_s": round(toks / dt, 1), "startup_s": round(ready, 1)}), flush=True)

if __name__ == "__main__":
    main()
