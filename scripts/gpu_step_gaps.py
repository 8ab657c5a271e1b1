"""How long the GPU waits for the host between steps, without the profiler's own overhead.

    python3 scripts/gpu_step_gaps.py --model llama3-8b --load-format dummy --dataset w1 \
        --max-model-len 4096 [--quantization fp8] [any engine flag of `bench throughput`]

Runs `bench throughput`'s offline schedule once plain, then once with two CUDA events around every
`ModelRunner.execute_model` / `sample_tokens` call: one recorded before the step's first launch, one
after its last. The first completes when the stream reaches it: at the end of the work queued before
it, or, when the stream had run dry, when the host queued it. So for step N

    gap_N  = start_N - end_{N-1}    (the device idle because the host was late; 0 when it was early)
    span_N = end_N - start_N        (the step's device time, its own launch gaps included)

and wall = sum(gap) + sum(span) + the ends. Prints both sums, the gaps by step kind (decode-only: one
token a request; mixed: with a prefill chunk) and batch-size bucket, and the host's time between
step launches beside the device span of the same steps (the host is the bound where it is longer).
An event pair costs ~2-4 us of host time a step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

BUCKETS = (16, 32, 64, 128, 192, 256)  # decode-only steps grouped by rows: <= each


def main() -> int:
    import torch
    from _gpu_common import offline_plain_run

    from pagedllm.benchmarks import throughput as tp
    from pagedllm.worker import model_runner as mr

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tp.add_cli_args(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_step_gaps.py times CUDA events: no CUDA device here")
        return 2
    llm, requests, temperature, dev, plain = offline_plain_run(args)
    print(f"plain run {plain.output_tokens_per_second:.1f} output tok/s ({plain.elapsed_time:.3f} s)", flush=True)
    llm.reset_prefix_cache()

    steps: list[dict] = []
    recording = [False]
    orig_exec, orig_sample = mr.ModelRunner.execute_model, mr.ModelRunner.sample_tokens

    def timed(fn, kind):
        def wrapper(self, arg):
            if not recording[0]:
                return fn(self, arg)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            host0 = time.perf_counter()
            s.record()
            out = fn(self, arg)
            e.record()
            rec = {"s": s, "e": e, "host": host0, "host_end": time.perf_counter(), "kind": kind}
            if kind == "exec":
                tokens = arg.total_num_scheduled_tokens
                reqs = len(arg.num_scheduled_tokens)
                rec.update(tokens=tokens, reqs=reqs, decode_only=tokens == reqs)
            steps.append(rec)
            return out
        return wrapper

    mr.ModelRunner.execute_model = timed(orig_exec, "exec")
    mr.ModelRunner.sample_tokens = timed(orig_sample, "sample")
    torch.cuda.synchronize()
    first = torch.cuda.Event(enable_timing=True)
    recording[0] = True
    first.record()
    timed_run = tp.run_throughput(llm, requests, temperature, dev)
    last = torch.cuda.Event(enable_timing=True)
    last.record()
    recording[0] = False
    torch.cuda.synchronize()
    mr.ModelRunner.execute_model, mr.ModelRunner.sample_tokens = orig_exec, orig_sample

    # Merge a deferred step's sample_tokens call into its execute_model record (same step).
    merged: list[dict] = []
    for rec in steps:
        if rec["kind"] == "sample" and merged:
            merged[-1]["e"] = rec["e"]
            merged[-1]["host_end"] = rec["host_end"]
        elif rec["kind"] == "exec":
            merged.append(rec)
    merged = [r for r in merged if r["tokens"] > 0]
    total_ms = first.elapsed_time(last)
    gaps, spans = [], []
    prev_end = first
    for r in merged:
        gaps.append(max(0.0, prev_end.elapsed_time(r["s"])))
        spans.append(r["s"].elapsed_time(r["e"]))
        prev_end = r["e"]
    tail = prev_end.elapsed_time(last)
    print(f"\ntimed run {timed_run.output_tokens_per_second:.1f} tok/s ({timed_run.elapsed_time:.3f} s); "
          f"{len(merged)} steps; events' span {total_ms:.1f} ms = steps {sum(spans):.1f} + gaps {sum(gaps):.1f} "
          f"({100 * sum(gaps) / total_ms:.2f}%) + after the last step {tail:.1f}")

    def bucket(r: dict) -> str:
        if not r["decode_only"]:
            return "mixed"
        n = r["reqs"]
        for hi in BUCKETS:
            if n <= hi:
                return f"decode <= {hi}"
        return f"decode > {BUCKETS[-1]}"

    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(merged):
        groups[bucket(r)].append(i)
    print("\n| steps | count | device span ms (mean) | gap before ms (sum / mean / p90) | host launch-to-launch ms "
          "(median) | host in step ms (median) |\n|---|---|---|---|---|---|")
    order = ["mixed"] + [f"decode <= {hi}" for hi in BUCKETS] + [f"decode > {BUCKETS[-1]}"]
    for name in order:
        idx = groups.get(name)
        if not idx:
            continue
        g = [gaps[i] for i in idx]
        sp = [spans[i] for i in idx]
        l2l = [merged[i + 1]["host"] - merged[i]["host"] for i in idx if i + 1 < len(merged)]
        inside = [merged[i]["host_end"] - merged[i]["host"] for i in idx]
        p90 = sorted(g)[int(0.9 * (len(g) - 1))]
        print(f"| {name} | {len(idx)} | {statistics.fmean(sp):.3f} | {sum(g):.1f} / {statistics.fmean(g):.3f} / "
              f"{p90:.3f} | {1e3 * statistics.median(l2l) if l2l else float('nan'):.3f} | "
              f"{1e3 * statistics.median(inside):.3f} |")
    worst = sorted(range(len(merged)), key=lambda i: -gaps[i])[:10]
    print("\nlargest gaps: " + ", ".join(
        f"{gaps[i]:.2f} ms before step {i} ({merged[i]['tokens']} tokens, {merged[i]['reqs']} reqs)" for i in worst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
