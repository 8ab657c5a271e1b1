"""Host time of one decode step at batch 32..256, on the CPU, split by phase: what the GPU waits on.

Two harnesses, both offline through `LLM`'s engine (the same calls `bench throughput` makes):
- `null`: the engine with pagedllm/benchmarks/null_executor.py (no model): scheduler, engine core,
  update_from_output and the output processor, i.e. the engine core's own per-request Python;
- `real`: a tiny random Qwen3 (2 layers, hidden 64, fp32, on the CPU) through the real worker path
  (ModelRunner, InputBatch, SamplingMetadata, Sampler, PendingOutput), async scheduling on as on a
  GPU, so the forward is cheap and the Python around it dominates.

Each run adds `batch` requests at once (`max_num_seqs` = batch, prompts of 32 tokens, `--output-len`
new tokens, temperature 0.6, ignore_eos, detokenize=False, DELTA outputs as the server asks) and
times the decode-only steps after the first few. Phases are timed by wrapping the engine's calls
from outside (as scripts/step_host_split.py does), so the script runs unchanged against an older
tree for an A/B:

    PYTHONPATH=/path/to/tree python scripts/host_step_cost.py [--batches 64 256] [--repeats 3]
    ... --profile real:64     # cProfile of that run's steps instead, top functions by own time

The machine may be loaded: compare phases within one run, take medians over `--repeats`.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections import defaultdict

# This thread's CPU time: on a loaded machine wall time also counts the waits for a core. (The real
# harness's torch kernels run on intra-op threads too: its forward reads low, the Python around it not.)
CLOCK = time.thread_time
COUNT_CALLS = False
TOP = ("schedule", "launch", "wait", "update", "output")  # disjoint calls of one step; the rest run inside launch
PARTS_NULL = ("schedule", "launch", "update", "output")
PARTS_REAL = ("schedule", "update_states", "prepare_inputs", "forward", "logits", "sampling_md", "sampler",
              "launch", "wait", "update", "output")


def build(kind: str, batch: int, output_len: int):
    from pagedllm import LLM
    from tests.utils import tiny_model

    path, _ = tiny_model("qwen3")
    kw = dict(device="cpu", max_model_len=1024, skip_tokenizer_init=True, max_num_seqs=batch,
              max_num_batched_tokens=max(2048, 32 * batch), async_scheduling=True,
              cpu_threads=1)  # no intra-op threads spinning beside the Python being timed
    if kind == "null":
        kw["distributed_executor_backend"] = "pagedllm.benchmarks.null_executor.NullExecutor"
        kw["num_gpu_blocks_override"] = batch * (32 + output_len + 32) // 16 + 64  # the batch at once, not more
    return LLM(path, **kw)


def instrument(engine, kind: str, spent: dict[str, float]) -> None:
    def timed(name, obj, attr):
        fn = getattr(obj, attr)

        def wrapper(*a, **kw):
            t0 = CLOCK()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += CLOCK() - t0
        setattr(obj, attr, wrapper)

    core = engine.engine_core
    timed("schedule", core.scheduler, "schedule")
    timed("update", core.scheduler, "update_from_output")
    timed("output", engine.output_processor, "process_outputs")
    timed("launch", core.model_executor, "execute_model")
    if kind == "null":
        return
    from pagedllm.sample import metadata
    from pagedllm.worker import model_runner

    runner = core.model_executor.driver_worker.model_runner  # the uniproc executor's one worker
    timed("update_states", runner.input_batch, "update_states")
    timed("prepare_inputs", runner.input_batch, "prepare_inputs")
    timed("forward", runner, "forward")
    timed("logits", runner.model, "compute_logits")
    timed("sampler", runner, "sampler")
    timed("wait", model_runner.PendingOutput, "get")
    build_fn = metadata.SamplingMetadata.build.__func__

    def build_timed(cls, *a, **kw):
        t0 = CLOCK()
        try:
            return build_fn(cls, *a, **kw)
        finally:
            spent["sampling_md"] += CLOCK() - t0
    metadata.SamplingMetadata.build = classmethod(build_timed)


def run_once(llm, kind: str, batch: int, output_len: int, tag: str, profiler: cProfile.Profile | None,
             waiting: int = 0):
    """Per-part seconds of each of this run's decode-only steps (the first 4 skipped)."""
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    engine = llm.llm_engine
    core = engine.engine_core
    spent: dict[str, float] = engine._h36_spent
    last = engine._h36_last
    params = SamplingParams(temperature=0.6, max_tokens=output_len, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    for i in range(batch + waiting):  # the extra ones wait in the queue while the first `batch` decode
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": [1 + (i * 31 + j * 7) % 500 for j in range(32)]}, params)
    rows: dict[str, list[float]] = defaultdict(list)
    n = 0
    while engine.has_unfinished_requests():
        spent.clear()
        last.clear()
        t0 = CLOCK()
        if profiler is not None and n > 4:
            profiler.enable()
        calls = [0, 0]
        if COUNT_CALLS:
            # Python and C function calls of the step: a cost measure the machine's load cannot move.
            def count(frame, event, arg, calls=calls):
                if event == "call":
                    calls[0] += 1
                elif event == "c_call":
                    calls[1] += 1
            sys.setprofile(count)
        engine.step()
        if COUNT_CALLS:
            sys.setprofile(None)
        if profiler is not None:
            profiler.disable()
        total = CLOCK() - t0
        n += 1
        so = last.get("so")
        if n <= 4 or so is None or len(so.num_scheduled_tokens) != batch or so.total_num_scheduled_tokens != batch:
            continue
        rows["step"].append(total)
        rows["py_calls"].append(calls[0])
        rows["c_calls"].append(calls[1])
        for k, v in spent.items():
            rows[k].append(v)
    assert core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == core.num_gpu_blocks
    return rows, len(rows["step"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--kinds", nargs="+", default=["null", "real"], choices=["null", "real"])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", default=None, help="kind:batch to run under cProfile (e.g. real:64)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="this thread's CPU time, or wall time")
    ap.add_argument("--waiting", type=int, default=0,
                    help="requests queued beyond the batch (W1 x 256 at max_num_seqs 64 queues 192)")
    ap.add_argument("--count-calls", action="store_true",
                    help="count each step's Python / C function calls (sys.setprofile; slows the timing)")
    args = ap.parse_args()
    global CLOCK, COUNT_CALLS
    COUNT_CALLS = args.count_calls
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter

    results = []
    for kind in args.kinds:
        for batch in args.batches:
            llm = build(kind, batch, args.output_len)
            engine = llm.llm_engine
            engine._h36_spent = defaultdict(float)
            engine._h36_last = {}
            instrument(engine, kind, engine._h36_spent)
            sched = engine.engine_core.scheduler
            schedule = sched.schedule

            def noting(schedule=schedule, last=engine._h36_last):
                so = schedule()
                last["so"] = so
                return so
            sched.schedule = noting
            prof = cProfile.Profile() if args.profile == f"{kind}:{batch}" else None
            run_once(llm, kind, batch, 8, "warm", None)
            reps = [run_once(llm, kind, batch, args.output_len, f"r{r}", prof, args.waiting)
                    for r in range(args.repeats)]
            parts = PARTS_NULL if kind == "null" else PARTS_REAL
            # Per part, the median over every timed step of every repeat (robust to a loaded machine's spikes).
            med = {k: statistics.median([x for r in reps for x in r[0].get(k, [])] or [0.0])
                   for k in ("step", "py_calls", "c_calls", *parts)}
            results.append((kind, batch, reps[0][1], med, parts))
            if prof is not None:
                pstats.Stats(prof).sort_stats("tottime").print_stats(r"pagedllm/(core|engine|worker|sample|request|host_copy|sampling_params|outputs)", 40)
            engine.shutdown()
            del llm

    print(f"\nhost time per decode-only step, us ({args.clock} clock; median over every timed step of every repeat; parts' medians need not sum to the step's)")
    for kind, batch, nsteps, med, parts in results:
        other = med["step"] - sum(med.get(k, 0.0) for k in TOP)
        cols = "  ".join(f"{k} {med[k] * 1e6:.0f}" for k in parts)
        # What a GPU's host would still run: the step less the CPU's model and sampling math.
        host = med["step"] - sum(med.get(k, 0.0) for k in ("forward", "logits", "sampler"))
        calls = f" | calls py {med['py_calls']:.0f} c {med['c_calls']:.0f}" if args.count_calls else ""
        print(f"{kind:<5} batch {batch:>4} ({nsteps} steps): step {med['step'] * 1e6:8.0f}  host {host * 1e6:7.0f} | "
              f"{cols}  other {other * 1e6:.0f}{calls}")


if __name__ == "__main__":
    main()
