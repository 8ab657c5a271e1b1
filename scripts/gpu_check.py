"""One GPU session's worth of checks and timings, printed as a table at the end.

Usage (on the GPU machine): python3 scripts/gpu_check.py [--skip-8b] [--only SECTION ...]
Sections: see `sections` in main().
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


def release_gpu_memory() -> None:
    """Collect dropped engines (they hold reference cycles) and hand their cached blocks back, so
    the next engine's memory profile sees free memory. Callers `del` every name that still refers
    to an engine first; main() also runs this between sections, after each section's locals die."""
    gc.collect()
    torch.cuda.empty_cache()


def tiny_model_dir(config_cls: str, **extra) -> str:
    """A saved 2-layer random model of a transformers config class (8 heads, 2 kv heads, vocab 1000),
    weights std 0.1 so that logits are far from ties."""
    import transformers

    cfg = getattr(transformers, config_cls)(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
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
    return path


def correctness() -> None:
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
        path = tiny_model_dir(cls, **extra)
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
            del outs, llm  # before the next engine starts: its memory profile counts what is alive
            release_gpu_memory()
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


def correctness_batch() -> None:
    """Large decode batches: CUDA graphs (cuBLASLt captures, padded-up sizes, longest-first attention
    order from 128 rows) against eager steps, fp32 greedy, a tiny Llama-3 and 200 prompts."""
    from pagedllm import LLM, SamplingParams

    path = tiny_model_dir("LlamaConfig")
    rng = random.Random(1)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(5, 600))] for _ in range(200)]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for name, kw in {"graphs": {}, "eager": dict(enforce_eager=True)}.items():
        llm = LLM(path, skip_tokenizer_init=True, max_model_len=1024, dtype="float32", gpu_memory_utilization=0.9,
                  num_gpu_blocks_override=8192, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        runs[name] = [o.outputs[0].token_ids for o in outs]
        gr = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.graph_runner
        if gr is not None:
            from pagedllm.worker.graph_plan import describe

            lt = [bs for bs, lib in gr.backends.items() if lib != "cublas"]
            record("tiny llama3 graph plan", f"cuBLASLt sizes {sorted(lt)}; padded up: "
                   f"{describe(gr.dispatch, gr.sizes) or 'none'}")
        # Drop every reference before the next engine starts: its memory profile counts what is alive.
        del gr, outs, llm
        release_gpu_memory()
    same = sum(a == b for a, b in zip(runs["graphs"], runs["eager"]))
    record(f"llama3 fp32 greedy, {len(prompts)} prompts (batches up to 200): graphs == eager", f"{same}/{len(prompts)}")


def capture_sizes_check() -> None:
    """vLLM's capture-size knobs on real graphs: explicit sizes, vLLM's max-size pattern and a
    compilation_config JSON, each against eager steps (fp32 greedy, 30 prompts whose batch shrinks
    from 30 to 1, so batches pad to every size and run eagerly above the largest)."""
    from pagedllm import LLM, SamplingParams

    path = tiny_model_dir("LlamaConfig")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 1000) for _ in range(rng.randint(3, 40))]} for _ in range(30)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 48), ignore_eos=True) for _ in prompts]
    runs = {}
    for name, kw in {"eager": dict(enforce_eager=True), "cudagraph_capture_sizes=[3, 8, 24]": dict(
            cudagraph_capture_sizes=[3, 8, 24]), "max_cudagraph_capture_size=20": dict(max_cudagraph_capture_size=20),
            "compilation_config JSON [1, 32]": dict(compilation_config='{"cudagraph_capture_sizes": [1, 32]}')}.items():
        llm = LLM(path, skip_tokenizer_init=True, max_model_len=256, dtype="float32", max_num_seqs=32,
                  num_gpu_blocks_override=512, **kw)
        gr = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.graph_runner
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if gr is not None:
            same = sum(a == b for a, b in zip(runs[name], runs["eager"]))
            record(f"{name}: graphs {gr.sizes} == eager", f"{same}/{len(prompts)}")
        del gr, llm
        release_gpu_memory()


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


def jit_keys() -> set[tuple[str, str]]:
    """(kernel, specialisation key) of every compiled Triton variant of pagedllm.kernels so far, to
    see JIT compiles inside a timed run and which launch caused them."""
    import importlib
    import pkgutil

    import triton

    import pagedllm.kernels as pk

    keys = set()
    for m in pkgutil.iter_modules(pk.__path__):
        mod = importlib.import_module(f"pagedllm.kernels.{m.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.jit.JITFunction):
                for cache in getattr(obj, "device_caches", {}).values():
                    keys.update((f"{m.name}.{name}", str(k)) for k in cache[0])
    return keys


def timeline_run(preset: str, label: str, passes: int = 2, **kw) -> None:
    """W1 step by step: where the wall time goes (mixed vs decode steps, by batch size), next to
    each step's floor (weights + K/V bytes over 4.26 TB/s). With async scheduling a step() call
    waits for the previous launch, so call i's wall time is charged to launch i - 1. Pass 1 runs on
    a fresh engine (after a short warm-up, as `bench throughput`), later passes on the warm one;
    the last pass also profiles the kernels of its first prefill steps."""
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.roofline import ModelShape
    from pagedllm.sampling_params import RequestOutputKind

    llm = LLM(preset, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0, **kw)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)
    eng = llm.llm_engine
    sched = eng.engine_core.scheduler
    shape = ModelShape.from_hf_config(eng.config.model_config.hf_config)
    w_bytes = (shape.params - (0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size)) * 2
    kv_tok = shape.kv_bytes_per_token(2)
    bw = 4.26e12
    launches: list[tuple[int, int, int]] = []  # (num decode reqs, prefill tokens, context tokens read)
    orig = sched.schedule

    def logged():
        so = orig()
        dec = pre = ctx = 0
        for rid, n in so.num_scheduled_tokens.items():
            r = sched.requests[rid]
            if n == 1 and r.num_computed_tokens >= r.num_prompt_tokens:
                dec += 1
            else:
                pre += n
            ctx += r.num_computed_tokens + n
        launches.append((dec, pre, ctx))
        return so

    sched.schedule = logged
    # Host-bound or device-bound: time spent waiting for the device in PendingOutput.get, and in
    # Python's garbage collector, per pass.
    import gc

    from pagedllm.worker import model_runner as mr

    waits = [0.0]
    orig_get = mr.PendingOutput.get

    def timed_get(self):
        if self.event is not None:
            t = time.perf_counter()
            self.event.synchronize()
            waits[0] += time.perf_counter() - t
        return orig_get(self)

    mr.PendingOutput.get = timed_get
    gc_time = [0.0, 0.0, 0]

    def on_gc(phase, info):
        if phase == "start":
            gc_time[1] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_time[1]
            gc_time[2] += 1

    gc.callbacks.append(on_gc)
    prompts, outs = w1()
    for p_i in range(1, passes + 1):
        assert llm.reset_prefix_cache()  # the same prompts again must be computed again
        launches.clear()
        sp = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o, detokenize=False,
                             output_kind=RequestOutputKind.FINAL_ONLY) for o in outs]
        for i, (p, s) in enumerate(zip(prompts, sp)):
            eng.add_request(f"{p_i}-{i}", {"prompt_token_ids": p}, s)
        jit0 = jit_keys()
        waits[0] = gc_time[0] = 0.0
        gc_time[2] = 0
        walls = []
        t_all = time.perf_counter()
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - t)
        total = time.perf_counter() - t_all
        n = min(len(launches), len(walls) - 1)
        buckets: dict[str, list[float]] = {}
        for i in range(n):
            dec, pre, ctx = launches[i]
            wall = walls[i + 1]
            floor = (w_bytes + ctx * kv_tok) / bw
            key = "mixed" if pre else ("decode b<=8" if dec <= 8 else "decode b<=64" if dec <= 64
                                       else "decode b<=192" if dec <= 192 else "decode b>192")
            b = buckets.setdefault(key, [0, 0.0, 0.0, 0])
            b[0] += 1
            b[1] += wall
            b[2] += floor
            b[3] += dec
        new_keys = jit_keys() - jit0
        for name, key in sorted(new_keys):
            print(f"  compiled during pass {p_i}: {name} {key[:400]}")
        record(f"{label} pass {p_i} total", f"{total:.2f} s, {len(walls)} step calls, {sum(outs) / total:,.0f} tok/s, "
               f"{len(new_keys)} Triton variants compiled during the pass; host waited for the device "
               f"{waits[0]:.2f} s; {gc_time[2]} GC runs took {gc_time[0]:.3f} s")
        for key, (cnt, wall, floor, dec) in sorted(buckets.items()):
            record(f"{label} pass {p_i} {key}", f"{cnt} steps, {wall:.3f} s wall ({wall / cnt * 1e3:.2f} ms/step), "
                   f"floor {floor:.3f} s, {dec} decode tokens")
        slow = sorted(range(n), key=lambda i: -walls[i + 1])[:6]
        print("slowest steps (index, decode reqs, prefill tokens, ctx, wall ms):",
              [(i, *launches[i], round(walls[i + 1] * 1e3, 1)) for i in slow])
        print("first steps (decode reqs, prefill tokens, ctx, wall ms):",
              [(*launches[i], round(walls[i + 1] * 1e3, 1)) for i in range(min(24, n))])
    # Kernels of the prefill-heavy steps of a warm run.
    assert llm.reset_prefix_cache()
    for i, p in enumerate(prompts):
        eng.add_request(f"prof-{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=4, ignore_eos=True,
                                                                           detokenize=False))
    eng.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(6):
            eng.step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=60))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    while eng.has_unfinished_requests():
        eng.step()
    gc.callbacks.remove(on_gc)
    mr.PendingOutput.get = orig_get


def kernel_table(preset: str, label: str, batch: int = 1, ctx: int = 128) -> None:
    """Steady decode at `batch`: every kernel of 10 steps with its count and mean time."""
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    llm = LLM(preset, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0)
    eng = llm.llm_engine
    rng = random.Random(3)
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=100, detokenize=False,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(batch):
        eng.add_request(str(i), {"prompt_token_ids": [rng.randint(0, 10000) for _ in range(ctx)]}, sp)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.engine_core.scheduler.requests.values()):
        eng.step()  # prefill first: the table is of decode steps
    for _ in range(5):
        eng.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    ka = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    ka.sort(key=lambda e: -e.self_device_time_total)
    tot = sum(e.self_device_time_total for e in ka)
    record(f"{label} kernels per step, batch {batch}",
           f"{sum(e.count for e in ka) / 10:.0f} kernels, {tot / 10 / 1000:.3f} ms GPU time")
    for e in ka[:14]:
        print(f"  {e.count / 10:6.0f}/step {e.self_device_time_total / e.count:8.2f} us  "
              f"{e.self_device_time_total / 10 / 1000:7.3f} ms/step  {e.key[:90]}")
    eng.abort_request([str(i) for i in range(batch)])
    while eng.has_unfinished_requests():
        eng.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--skip-8b", action="store_true")
    args = ap.parse_args()
    sections = {
        "correctness": correctness,
        "correctness-batch": correctness_batch,
        "capture-sizes": capture_sizes_check,
        "w1-0.6b": lambda: w1_run("qwen3-0.6b", "qwen3-0.6b"),
        "latency-0.6b": lambda: latency_run("qwen3-0.6b", "qwen3-0.6b"),
        "profile-0.6b": lambda: profile_run("qwen3-0.6b", "qwen3-0.6b"),
        "timeline-0.6b": lambda: timeline_run("qwen3-0.6b", "qwen3-0.6b"),
        "kernels-0.6b": lambda: kernel_table("qwen3-0.6b", "qwen3-0.6b"),
        "kernels-0.6b-b256": lambda: kernel_table("qwen3-0.6b", "qwen3-0.6b", batch=256, ctx=800),
        "w1-8b": lambda: w1_run("llama3-8b", "llama3-8b"),
        "profile-8b": lambda: profile_run("llama3-8b", "llama3-8b"),
        "timeline-8b": lambda: timeline_run("llama3-8b", "llama3-8b", passes=1),
        "kernels-8b": lambda: kernel_table("llama3-8b", "llama3-8b"),
        "kernels-8b-b256": lambda: kernel_table("llama3-8b", "llama3-8b", batch=256, ctx=800),
        "latency-8b": lambda: latency_run("llama3-8b", "llama3-8b"),
    }
    for name, fn in sections.items():
        if args.only and name not in args.only:
            continue
        if args.skip_8b and "8b" in name:
            continue
        release_gpu_memory()
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
