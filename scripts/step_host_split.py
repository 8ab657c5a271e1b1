"""Where the host time of a batch-1 decode step goes: schedule / launch / wait / update / output.

`bench latency` gives one figure per step; this splits it, so an A/B of two trees shows whether a
slower step is more host work (schedule, launch, update, output grow) or lost overlap (wait grows:
the host blocks on the device). It wraps the engine core's calls from outside, so the same script
runs against an older tree, whose core calls its ModelRunner directly:

    PYTHONPATH=/path/to/tree python scripts/step_host_split.py --model qwen3-0.6b --load-format dummy

(one H200, ~1 minute a model; the table is printed last). On the CPU it runs the same way on any
model path (`--device cpu`), where every step is synchronous and `wait` is ~0.

`--w1 N --max-num-seqs S` runs N of W1's requests instead (all added at once, as `bench throughput`
does) and splits decode-only steps from steps that carry a prefill chunk, e.g. the 64-concurrent load
of the server benchmark: `--w1 256 --max-num-seqs 64`. A step whose `wait` is ~0 while the device is
not saturated is host-bound: the host's schedule + launch + update + output exceed the device's step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=257)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--w1", type=int, default=0, help="run this many W1 requests at once instead of batch 1")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args = ap.parse_args()

    from pagedllm import LLM
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams
    from pagedllm.worker import model_runner

    llm = LLM(args.model, load_format=args.load_format, device=args.device, max_model_len=args.max_model_len,
              skip_tokenizer_init=True, max_num_seqs=args.max_num_seqs)
    engine = llm.llm_engine
    core = engine.engine_core
    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    launcher = getattr(core, "model_executor", None) or core.model_runner  # new tree / older tree
    launcher.execute_model = timed("launch", launcher.execute_model)
    core.scheduler.schedule = timed("schedule", core.scheduler.schedule)
    core.scheduler.update_from_output = timed("update", core.scheduler.update_from_output)
    model_runner.PendingOutput.get = timed("wait", model_runner.PendingOutput.get)
    engine.output_processor.process_outputs = timed("output", engine.output_processor.process_outputs)

    if args.w1:
        return w1_split(engine, spent, args)
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    rows: dict[str, list[float]] = defaultdict(list)
    vocab = min(engine.config.model_config.vocab_size, 10000)
    for it in range(args.num_iters + 1):  # the first is a warm-up
        engine.add_request(f"it{it}", {"prompt_token_ids": [1 + (i * 7919) % (vocab - 1) for i in range(args.input_len)]},
                           params)
        n = 0
        while engine.has_unfinished_requests():
            spent.clear()
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            n += 1
            if it == 0 or n <= 3:  # prefill and the first decode steps are not the steady state
                continue
            rows["step"].append(total)
            for k in ("schedule", "launch", "wait", "update", "output"):
                rows[k].append(spent[k])
            rows["other"].append(total - sum(spent.values()))
    print(f"batch-1 decode step, {len(rows['step'])} steps ({args.model}, async_scheduling="
          f"{engine.config.scheduler_config.async_scheduling})")
    print(f"{'part':<10}{'mean us':>10}{'p50 us':>10}")
    for k in ("step", "schedule", "launch", "wait", "update", "output", "other"):
        v = rows[k]
        print(f"{k:<10}{statistics.fmean(v) * 1e6:>10.1f}{statistics.median(v) * 1e6:>10.1f}")


PARTS = ("schedule", "launch", "wait", "update", "output")


def w1_split(engine, spent: dict[str, float], args: argparse.Namespace) -> None:
    """Every step of a W1 run, split into decode-only and prefill-carrying steps."""
    from pagedllm.benchmarks.datasets import w1_requests
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    core = engine.engine_core
    last = {}
    schedule = core.scheduler.schedule

    def schedule_and_note():
        so = schedule()
        last["so"] = so
        return so

    core.scheduler.schedule = schedule_and_note
    for it in range(2):  # the first run warms up (compiles, grows the allocator)
        requests = w1_requests(args.w1 if it else 16, 0)
        for i, r in enumerate(requests):
            engine.add_request(f"w{it}-{i}", {"prompt_token_ids": r.prompt_token_ids},
                               SamplingParams(temperature=0.6, max_tokens=r.expected_output_len, ignore_eos=True,
                                              detokenize=False, output_kind=RequestOutputKind.DELTA))
        rows: dict[str, dict[str, list[float]]] = {"decode": defaultdict(list), "prefill": defaultdict(list)}
        t_run = time.perf_counter()
        while engine.has_unfinished_requests():
            spent.clear()
            last.clear()
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            so = last.get("so")
            if so is None or not so.num_scheduled_tokens:
                continue
            kind = "decode" if so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) else "prefill"
            rows[kind]["step"].append(total)
            rows[kind]["batch"].append(len(so.num_scheduled_tokens))
            for k in PARTS:
                rows[kind][k].append(spent[k])
            rows[kind]["other"].append(total - sum(spent[k] for k in PARTS))
        wall = time.perf_counter() - t_run
    print(f"W1 x {args.w1}, max_num_seqs {args.max_num_seqs} ({args.model}): {wall:.2f} s, "
          f"async_scheduling={engine.config.scheduler_config.async_scheduling}")
    print(f"{'part':<10}" + "".join(f"{k + ' mean':>14}{k + ' sum s':>14}" for k in rows))
    for k in ("step", *PARTS, "other"):
        print(f"{k:<10}" + "".join(
            f"{statistics.fmean(r[k]) * 1e6 if r[k] else 0:>12.1f}us{sum(r[k]):>13.2f}s" for r in rows.values()))
    print("steps     " + "".join(f"{len(r['step']):>14}{'':>14}" for r in rows.values()))
    # A mean can hide a few outliers (a kernel variant compiled mid-run): the median and the largest.
    print("step p50  " + "".join(f"{statistics.median(r['step']) * 1e6 if r['step'] else 0:>12.1f}us{'':>14}"
                                 for r in rows.values()))
    print("launch p50" + "".join(f"{statistics.median(r['launch']) * 1e6 if r['launch'] else 0:>12.1f}us{'':>14}"
                                 for r in rows.values()))
    print("step max  " + "".join(f"{max(r['step']) * 1e3 if r['step'] else 0:>12.1f}ms{'':>14}"
                                 for r in rows.values()))
    print("mean batch" + "".join(f"{statistics.fmean(r['batch']) if r['batch'] else 0:>14.1f}{'':>14}"
                                 for r in rows.values()))


if __name__ == "__main__":
    main()
