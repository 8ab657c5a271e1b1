"""One GPU session's worth of checks and timings, printed as a table at the end.

Usage (on the GPU machine): python3 scripts/gpu_check.py [--skip-8b] [--only SECTION ...]
Sections: correctness, w1-0.6b, latency-0.6b, w1-8b, latency-8b.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
import traceback

import torch

RESULTS: list[tuple[str, str]] = []


def record(name: str, value: str) -> None:
    RESULTS.append((name, value))
    print(f"## {name}: {value}", flush=True)


def w1(n: int = 256, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    return prompts, [rng.randint(100, 1024) for _ in range(n)]


def free_engine(llm) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def correctness() -> None:
    import transformers

    from pagedllm import LLM, SamplingParams

    archs = {
        "llama3": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 256})),
        "mistral": ("MistralConfig", dict(sliding_window=None)),
        "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
        "qwen3": ("Qwen3Config", dict(head_dim=64, tie_word_embeddings=False)),
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(5, 300))] for _ in range(12)]
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1)
    for arch, (cls, extra) in archs.items():
        cfg = getattr(transformers, cls)(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                                         max_position_embeddings=2048, **extra)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.1)
        path = tempfile.mkdtemp()
        model.save_pretrained(path)
        runs = {}
        for name, kw in {
            "ref-cpu-fp32": dict(device="cpu", dtype="float32"),
            "fast-fp32": dict(device="cuda", dtype="float32"),
            "eager-fp32": dict(device="cuda", dtype="float32", enforce_eager=True),
            "fast-bf16": dict(device="cuda", dtype="bfloat16"),
        }.items():
            llm = LLM(path, skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=16, gpu_memory_utilization=0.3,
                      num_gpu_blocks_override=512, **kw)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
            runs[name] = [o.outputs[0] for o in outs]
            free_engine(llm)
        ref = runs["ref-cpu-fp32"]
        for name in ("fast-fp32", "eager-fp32"):
            same = sum(a.token_ids == b.token_ids for a, b in zip(ref, runs[name]))
            record(f"{arch} {name} greedy == torch ref (64 tok x {len(prompts)})", f"{same}/{len(prompts)}")
        # bf16: logprob of the reference's first token, compared position by position until divergence
        diffs = []
        for a, b in zip(ref, runs["fast-bf16"]):
            for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
                if ta != tb:
                    break
                diffs.append(abs(la[ta].logprob - lb[tb].logprob))
        same16 = sum(a.token_ids == b.token_ids for a, b in zip(ref, runs["fast-bf16"]))
        record(f"{arch} bf16 vs fp32: max |logprob diff|, identical seqs", f"{max(diffs):.4f}, {same16}/{len(prompts)}")


def w1_run(preset: str, label: str, **kw) -> None:
    from pagedllm import LLM, SamplingParams

    prompts, outs = w1()
    t0 = time.perf_counter()
    llm = LLM(preset, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0, **kw)
    ready = time.perf_counter() - t0
    record(f"{label} start to ready", f"{ready:.1f} s (KV blocks {llm.llm_engine.engine_core.num_gpu_blocks})")
    sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o, detokenize=False) for o in outs]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)
    t = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    dt = time.perf_counter() - t
    toks = sum(len(r.outputs[0].token_ids) for r in res)
    assert toks == sum(outs), (toks, sum(outs))
    pre = llm.llm_engine.engine_core.scheduler.num_preemptions
    record(f"{label} W1", f"{toks / dt:,.0f} output tok/s ({toks} tokens in {dt:.2f} s, preemptions {pre})")
    free_engine(llm)


def latency_run(preset: str, label: str, **kw) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(preset, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0, **kw)
    rng = random.Random(1)
    for bs in (1, 32):
        prompts = [{"prompt_token_ids": [rng.randint(0, 10000) for _ in range(128)]} for _ in range(bs)]
        times = {}
        for new in (1, 257):
            sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new, detokenize=False)
            llm.generate(prompts, sp, use_tqdm=False)
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            times[new] = time.perf_counter() - t
        record(f"{label} decode step, batch {bs}", f"{(times[257] - times[1]) / 256 * 1000:.3f} ms")
    free_engine(llm)


def profile_run(preset: str, label: str, batch: int = 256, ctx: int = 800) -> None:
    """Steady decode at `batch` requests of `ctx` tokens: wall time per step and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    llm = LLM(preset, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0)
    eng = llm.llm_engine
    rng = random.Random(2)
    sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=200, detokenize=False,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(batch):
        eng.add_request(str(i), {"prompt_token_ids": [rng.randint(0, 10000) for _ in range(ctx)]}, sp)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.engine_core.scheduler.requests.values()):
        eng.step()
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(40):
        eng.step()
    torch.cuda.synchronize()
    record(f"{label} decode step wall, batch {batch} ctx ~{ctx}", f"{(time.perf_counter() - t) / 40 * 1000:.2f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
    record(f"{label} GPU kernel time per step (profiled)", f"{gpu_us / 10 / 1000:.2f} ms")
    print(ka.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    eng.abort_request([str(i) for i in range(batch)])
    while eng.has_unfinished_requests():
        eng.step()
    free_engine(llm)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--skip-8b", action="store_true")
    args = ap.parse_args()
    sections = {
        "correctness": correctness,
        "w1-0.6b": lambda: w1_run("qwen3-0.6b", "qwen3-0.6b"),
        "latency-0.6b": lambda: latency_run("qwen3-0.6b", "qwen3-0.6b"),
        "profile-0.6b": lambda: profile_run("qwen3-0.6b", "qwen3-0.6b"),
        "w1-8b": lambda: w1_run("llama3-8b", "llama3-8b"),
        "latency-8b": lambda: latency_run("llama3-8b", "llama3-8b"),
    }
    for name, fn in sections.items():
        if args.only and name not in args.only:
            continue
        if args.skip_8b and "8b" in name:
            continue
        gc.collect()
        torch.cuda.empty_cache()
        try:
            fn()
        except Exception as e:  # keep going: one call, every section
            traceback.print_exc()
            record(f"{name} FAILED", f"{type(e).__name__}: {str(e)[:300]}")
    print("\n| check | result |\n|---|---|")
    for k, v in RESULTS:
        print(f"| {k} | {v} |")
    print(json.dumps(dict(RESULTS)))


if __name__ == "__main__":
    main()
