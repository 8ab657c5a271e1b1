"""Why a step that carries a prefill chunk costs ~19 ms of host launch time at 64 concurrent requests.

`step_host_split.py --w1 256 --max-num-seqs 64` showed the 187 prefill-carrying steps of that run
spending 18.6 ms each inside `execute_model`, against 2.8 ms for a decode-only step. This script
runs the same schedule (offline, W1 requests all added at once) and separates the candidate causes:

    compiles   every Triton compilation during the measured runs (kernel, seconds, step)
    per step   launch time of each prefill-carrying step against its token and request counts,
               on a second, fully warm pass (p10 / p50 / p90 / max)
    profile    torch.profiler (CPU + CUDA) over a few prefill-carrying steps: the host ops that take
               the time, kernel launches per step, and time in synchronizing CUDA calls
    syncs      torch.cuda.set_sync_debug_mode("warn") over a few prefill-carrying steps: each call
               site that synchronizes the host with the device

    python3 scripts/mixed_step_probe.py --model qwen3-0.6b --load-format dummy --w1 256 --max-num-seqs 64

(one H200, ~2 minutes; the table is printed last).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import traceback
import warnings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--w1", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--cudagraph-mode", default=None, help="compilation_config cudagraph_mode, e.g. FULL_DECODE_ONLY")
    args = ap.parse_args()

    import torch
    from triton.runtime import jit

    from pagedllm import LLM
    from pagedllm.benchmarks.datasets import w1_requests
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    compiles: list[tuple[int, str, float]] = []
    state = {"step": -1, "pass": "start"}
    original = jit.JITFunction._do_compile

    def timed_compile(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return original(self, *a, **kw)
        finally:
            compiles.append((state["step"], f"{state['pass']}:{self.fn.__name__}", time.perf_counter() - t0))

    jit.JITFunction._do_compile = timed_compile

    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, max_model_len=args.max_model_len, skip_tokenizer_init=True,
              max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
              compilation_config={"cudagraph_mode": args.cudagraph_mode} if args.cudagraph_mode else None)
    print(f"ready in {time.perf_counter() - t0:.1f} s; {len(compiles)} compiles during start-up", flush=True)
    engine = llm.llm_engine
    core = engine.engine_core
    executor = core.model_executor
    launch = executor.execute_model
    last: dict = {}

    def timed_launch(so):
        t = time.perf_counter()
        try:
            return launch(so)
        finally:
            last["launch"] = time.perf_counter() - t
            last["so"] = so

    executor.execute_model = timed_launch
    results: list[tuple[str, str]] = []

    def record(name: str, value: str) -> None:
        results.append((name, value))
        print(f"## {name}: {value}", flush=True)

    def run(tag: str, n: int, on_prefill_step=None) -> list[tuple[int, int, float, float]]:
        """One W1 run; (tokens, requests, launch s, step s) of every prefill-carrying step."""
        state["pass"] = tag
        for i, r in enumerate(w1_requests(n, 0)):
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": r.prompt_token_ids},
                               SamplingParams(temperature=0.6, max_tokens=r.expected_output_len, ignore_eos=True,
                                              detokenize=False, output_kind=RequestOutputKind.DELTA))
        rows = []
        decode = []
        t_run = time.perf_counter()
        k = 0
        while engine.has_unfinished_requests():
            last.clear()
            state["step"] = k
            ctx = on_prefill_step(k) if on_prefill_step else None
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            if ctx is not None:
                ctx.close()
            k += 1
            so = last.get("so")
            if so is None or not so.num_scheduled_tokens:
                continue
            if so.total_num_scheduled_tokens == len(so.num_scheduled_tokens):
                decode.append(dt)
            else:
                rows.append((so.total_num_scheduled_tokens, len(so.num_scheduled_tokens), last["launch"], dt))
        wall = time.perf_counter() - t_run
        print(f"{tag}: {wall:.2f} s, {len(decode)} decode steps (p50 {statistics.median(decode) * 1e3:.2f} ms), "
              f"{len(rows)} prefill-carrying", flush=True)
        return rows

    def pct(v: list[float], q: float) -> float:
        v = sorted(v)
        return v[min(len(v) - 1, int(q * len(v)))]

    run("warm16", 16)
    n_start = len(compiles)
    for tag in ("pass1", "pass2"):
        engine.reset_prefix_cache() if hasattr(engine, "reset_prefix_cache") else None
        rows = run(tag, args.w1)
        lt = [r[2] * 1e3 for r in rows]
        record(f"{tag} prefill-carrying launch ms p10/p50/p90/max/mean",
               f"{pct(lt, .1):.2f} / {pct(lt, .5):.2f} / {pct(lt, .9):.2f} / {max(lt):.1f} / {statistics.fmean(lt):.2f}")
        st = [r[3] * 1e3 for r in rows]
        record(f"{tag} prefill-carrying step ms p50/mean", f"{pct(st, .5):.2f} / {statistics.fmean(st):.2f}")
        by = collections.defaultdict(list)
        for tok, _, la, _ in rows:
            by[min(tok // 1024, 8)].append(la * 1e3)
        record(f"{tag} launch ms by tokens (k-tokens: n, p50)",
               ", ".join(f"{b}k: {len(v)}, {statistics.median(v):.1f}" for b, v in sorted(by.items())))
    mid = compiles[n_start:]
    record("compiles during the measured passes",
           f"{len(mid)}, {sum(c[2] for c in mid):.2f} s" + (": " + ", ".join(f"{n}@{s} {t:.2f}s" for s, n, t in mid[:12])
                                                          if mid else ""))

    # torch.profiler over a few prefill-carrying steps of a third pass.
    try:
        from torch.profiler import ProfilerActivity, profile

        engine.reset_prefix_cache() if hasattr(engine, "reset_prefix_cache") else None
        state["pass"] = "prof"
        for i, r in enumerate(w1_requests(args.w1, 0)):
            engine.add_request(f"prof-{i}", {"prompt_token_ids": r.prompt_token_ids},
                               SamplingParams(temperature=0.6, max_tokens=r.expected_output_len, ignore_eos=True,
                                              detokenize=False, output_kind=RequestOutputKind.DELTA))
        profiled = 0
        events = collections.Counter()
        self_cpu = collections.Counter()
        launches = 0
        sync_us = 0.0
        n_steps = 0
        while engine.has_unfinished_requests():
            so_next_is_mixed = profiled < args.profile_steps and n_steps > 40
            if so_next_is_mixed:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    last.clear()
                    engine.step()
                    torch.cuda.synchronize()
                so = last.get("so")
                mixed = so is not None and so.total_num_scheduled_tokens != len(so.num_scheduled_tokens)
                if mixed:
                    profiled += 1
                    for e in prof.key_averages():
                        self_cpu[e.key] += e.self_cpu_time_total
                        events[e.key] += e.count
                        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
                            launches += e.count
                        if "Synchronize" in e.key or e.key in ("cudaMemcpy", "cudaMemcpyAsync"):
                            sync_us += e.self_cpu_time_total
                    print(f"profiled a step of {so.total_num_scheduled_tokens} tokens / "
                          f"{len(so.num_scheduled_tokens)} requests: launch {last['launch'] * 1e3:.1f} ms", flush=True)
            else:
                engine.step()
            n_steps += 1
        if profiled:
            top = self_cpu.most_common(25)
            print("top host ops by self CPU time over the profiled prefill-carrying steps (us per step, calls):")
            for key, us in top:
                print(f"  {us / profiled:>10.0f}  {events[key] / profiled:>7.1f}  {key}")
            record("profiled prefill-carrying steps", str(profiled))
            record("kernel launches per step", f"{launches / profiled:.0f}")
            record("sync/memcpy CPU us per step", f"{sync_us / profiled:.0f}")
            record("top 5 self-CPU ops (us/step)", "; ".join(f"{k} {v / profiled:.0f}" for k, v in top[:5]))
    except Exception:
        traceback.print_exc()
        record("profile", "ERROR")

    # Synchronizing call sites.
    try:
        engine.reset_prefix_cache() if hasattr(engine, "reset_prefix_cache") else None
        sites = collections.Counter()

        def show(message, category, filename, lineno, file=None, line=None):
            stack = [f"{f.filename.split('site-packages/')[-1].split('pagedllm/')[-1]}:{f.lineno} {f.name}"
                     for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
            sites[" <- ".join(reversed(stack[-5:]))] += 1

        warnings.showwarning = show
        warnings.simplefilter("always")
        for i, r in enumerate(w1_requests(64, 1)):
            engine.add_request(f"sync-{i}", {"prompt_token_ids": r.prompt_token_ids},
                               SamplingParams(temperature=0.6, max_tokens=min(r.expected_output_len, 200),
                                              ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA))
        n = 0
        while engine.has_unfinished_requests():
            if 5 <= n < 25:
                torch.cuda.set_sync_debug_mode("warn")
            engine.step()
            torch.cuda.set_sync_debug_mode(0)
            n += 1
        print("synchronizing call sites (count, innermost first):")
        for site, c in sites.most_common(15):
            print(f"  {c:>5}  {site}")
        record("distinct synchronizing sites over 20 steps", f"{len(sites)} ({sum(sites.values())} syncs)")
    except Exception:
        traceback.print_exc()
        record("syncs", "ERROR")

    print("\n| check | result |\n|---|---|")
    for name, value in results:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
