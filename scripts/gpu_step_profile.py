"""Where a GPU run's time goes: the device's kernels under `torch.profiler`, grouped, and how busy it was.

    python3 scripts/gpu_step_profile.py --model qwen3-0.6b --load-format dummy --dataset w1 \
        --num-prompts 128 [--max-num-seqs 64] [any engine flag of `bench throughput`]

Runs the same offline schedule as `pagedllm bench throughput` (the engine in this process, CUDA graphs as
configured) once untimed, then once under the profiler with only CUDA activity recorded (the prefix cache
reset in between, so the profiled run computes its prompts again rather than reading them from the
cache), and prints:
- wall time of the profiled run, the union of kernel intervals (device busy) and its fraction: a
  fraction well under 1 means the host (scheduler, sampling, Python) leaves the GPU idle between steps;
- time by kernel family (GEMM, attention, MoE, norm, rotary, sampling, copies, other);
- the top kernels by total time, with calls and mean microseconds.
The profile includes prefill and decode steps as the schedule mixes them; `--num-prompts` keeps it small
enough for the profiler's buffers (every kernel of every step is one event).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict

FAMILIES = [
    ("moe", re.compile(r"moe|expert", re.I)),
    ("attention", re.compile(r"attn|attention|mla|flash|paged|unified|decode_kernel|merge", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|sm90|nvjet|cublas|xmma|wgmma|scaled_mm|matmul|_mm_|dot", re.I)),
    ("norm", re.compile(r"rms|norm", re.I)),
    ("rotary", re.compile(r"rope|rotary", re.I)),
    ("sampling", re.compile(r"sampl|topk|top_k|softmax|argmax|gumbel|multinomial|sort|cumsum|bitmask", re.I)),
    ("copy/elementwise", re.compile(r"copy|elementwise|cat|index|fill|memcpy|memset|reduce|scatter|gather", re.I)),
]


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if pattern.search(name):
            return fam
    return "other"


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on two streams may overlap)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def main() -> int:
    import torch
    from _gpu_common import offline_plain_run
    from torch.profiler import ProfilerActivity, profile

    from pagedllm.benchmarks import throughput as tp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tp.add_cli_args(parser)
    parser.add_argument("--top", type=int, default=25, help="kernels listed by total time")
    args = parser.parse_args()
    llm, requests, temperature, dev, plain = offline_plain_run(args)
    # Printed now as well: a run cut short while profiling still reports its plain throughput.
    print(f"plain run {plain.output_tokens_per_second:.0f} output tok/s ({plain.elapsed_time:.2f} s, "
          f"{len(requests)} requests)", flush=True)
    if not torch.cuda.is_available():
        print("gpu_step_profile.py profiles CUDA kernels: no CUDA device here")
        return 2
    sync = torch.cuda.synchronize
    if not llm.reset_prefix_cache():
        print("warning: the prefix cache could not be reset; the profiled run reuses cached prompt blocks")
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        profiled = tp.run_throughput(llm, requests, temperature, dev)
        sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    by_name: dict[str, list[float]] = defaultdict(list)
    intervals = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = ev.time_range.end - ev.time_range.start
        by_name[ev.name].append(dur)
        intervals.append((ev.time_range.start, ev.time_range.end))
    if not intervals:
        print("no CUDA kernel events were recorded (CUPTI unavailable?)")
        return 1
    kernel_us = sum(sum(v) for v in by_name.values())
    busy_us = busy_union(intervals)
    print(f"\nplain run {plain.output_tokens_per_second:.0f} output tok/s ({plain.elapsed_time:.2f} s); "
          f"profiled run {profiled.output_tokens_per_second:.0f} tok/s")
    print(f"profiled wall {wall_us / 1e3:.1f} ms, device busy {busy_us / 1e3:.1f} ms "
          f"({100 * busy_us / wall_us:.1f}%), kernel time {kernel_us / 1e3:.1f} ms in "
          f"{sum(len(v) for v in by_name.values())} kernels")
    fams: dict[str, float] = defaultdict(float)
    for name, durs in by_name.items():
        fams[family(name)] += sum(durs)
    print("\n| family | ms | % of kernel time |\n|---|---|---|")
    for fam, us in sorted(fams.items(), key=lambda kv: -kv[1]):
        print(f"| {fam} | {us / 1e3:.1f} | {100 * us / kernel_us:.1f} |")
    print("\n| kernel | family | calls | total ms | mean us | % |\n|---|---|---|---|---|---|")
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[: args.top]
    for name, durs in ranked:
        short = name if len(name) <= 70 else name[:67] + "..."
        print(f"| `{short}` | {family(name)} | {len(durs)} | {sum(durs) / 1e3:.1f} | "
              f"{sum(durs) / len(durs):.1f} | {100 * sum(durs) / kernel_us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
