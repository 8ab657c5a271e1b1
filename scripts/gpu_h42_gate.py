"""Gated sampling (structured_output/gate.py) against the path it replaces, in one engine: decode of N
concurrent requests under a JSON schema vs unconstrained (scripts/gpu_structured_bench.py's schema,
prompts and output check), issue 22's bar being schema / plain >= 0.90 on the Qwen3-0.6B shape.

    PYTHONPATH=$PWD python3 scripts/gpu_h42_gate.py --model "$PEER_MODEL"          # the H200
    PYTHONPATH=$PWD python scripts/gpu_h42_gate.py --device cpu --num-requests 8 --max-tokens 16

Variants, alternating in one engine per model (each engine in its own child process):
    plain                      unconstrained
    schema, main path          PAGEDLLM_GRAMMAR_GATE off: the bitmask thread, sampling in a call of its
                               own once the fill is done (main's code path, the A/B's "before")
    schema, gated, thread      the step samples with its launch, the device waits for the bitmask
                               (the accept in the step loop, the fill on the bitmask thread)
    ..., accept on it          the same, the batch accept on the thread before the fill, with a
                               0.1 ms switch interval (the thread needs the GIL between the two)
    schema, gated, N workers   the same, accept and fill in N grammar worker processes (h38's)
First a probe of the gate itself (CUDA): the device's wait holds a copy until the host's flag, and
how long from the flag to the copy's end (stream memory op and the spinning kernel). Then the same
engine variants for a Llama-3.1-8B-shaped model with SmolLM2's 49,152-token vocabulary (config
written next to --model's tokenizer), fewer tokens, when time is left. A table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

T0 = time.perf_counter()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

from _child_runs import run_child, write_llama8b  # noqa: E402


def gate_probe() -> list[dict]:
    """The device waits for a flag in mapped host memory, then copies a buffer a host thread filled."""
    import threading

    import numpy as np
    import torch

    from pagedllm.structured_output import gate as gate_mod
    from pagedllm.structured_output.gate import FlagWords, GrammarGate, device_wait

    results = []
    dev = torch.device("cuda")
    host = torch.zeros((64, 1536), dtype=torch.int32, pin_memory=True)
    out = torch.empty((64, 1536), dtype=torch.int32, device=dev)
    for how in ("stream_op", "spin"):
        gate_mod._stream_ops_refused = how == "spin"
        flags = FlagWords(torch.zeros(2, dtype=torch.int32, pin_memory=True), dev)
        lat, ok = [], True
        for _ in range(20):
            seq = flags.next_seq()
            g = GrammarGate(["r"], host, flags.words, seq, flags.device_address)
            host.numpy().fill(-7)
            torch.cuda.synchronize()
            used = device_wait(g)
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            time.sleep(0.002)
            early = done.query()  # must be False: the flag is not up yet
            t_open = [0.0]

            def fill(seq=seq, t_open=t_open, flags=flags):
                host.numpy().fill(seq)
                t_open[0] = time.perf_counter()
                flags.words[:] = seq

            th = threading.Thread(target=fill)
            th.start()
            th.join()
            while not done.query():
                pass
            lat.append(time.perf_counter() - t_open[0])
            ok &= (not early) and bool((out == seq).all().item()) and used == how
        results.append({"probe": "gate", "mechanism": how, "correct": ok,
                        "flag_to_copy_done_us_median": round(1e6 * float(np.median(lat)), 1),
                        "min_us": round(1e6 * min(lat), 1)})
        print(json.dumps(results[-1]), flush=True)
    gate_mod._stream_ops_refused = False
    return results


def run_engine(args) -> list[dict]:
    from gpu_structured_bench import SCHEMA, OutputChecker, check_outputs, prompts

    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams
    from pagedllm.structured_output.manager import make_backend

    kwargs = dict(max_model_len=1024, seed=0, async_scheduling=True)
    if args.capture_sizes:  # a shorter start: decode graphs of these sizes only, other steps eager
        kwargs.update(compilation_config={"cudagraph_capture_sizes": args.capture_sizes,
                                          "cudagraph_mode": "FULL_DECODE_ONLY"})
    if args.model:
        kwargs.update(model=args.model, load_format="dummy")
    if args.device == "cpu":
        kwargs.update(num_gpu_blocks_override=64 * args.num_requests)
    llm = LLM(**kwargs)
    core = llm.llm_engine.engine_core
    manager = core.structured_output_manager
    runner = core.model_executor.driver_worker.model_runner
    cfg = llm.llm_engine.config
    tok = llm.get_tokenizer()
    ps = prompts(tok, args.num_requests)
    checker = OutputChecker(tok, cfg.model_config.vocab_size)
    default_backend = manager.backend()  # PAGEDLLM_GRAMMAR_WORKER=1: the grammar workers
    backends = {"default": default_backend}
    if not getattr(default_backend, "remote", False):
        backends["thread"] = default_backend
    if args.workers and any("workers" in v for v in args.variants) and "workers" not in backends:
        n, t = args.workers
        b = make_backend(tok, cfg.model_config.vocab_size, worker=True, rows=cfg.scheduler_config.max_num_seqs,
                         pin_memory=cfg.device_config.device == "cuda", threads=t, num_workers=n)
        if getattr(b, "remote", False):
            backends["workers"] = b
        else:
            print("# the grammar workers did not start; their variant is skipped", flush=True)
    w = args.workers[0] if args.workers else 0
    known = {
        "plain": ("plain", None, False),
        "main": ("schema, main path", "thread", False),
        "gated-thread": ("schema, gated, thread", "thread", True),
        "gated-thread-accept": ("schema, gated, thread, accept on it (switch 0.1 ms)", "thread+", True),
        "gated-workers": (f"schema, gated, {w} workers", "workers", True),
        "main-workers": (f"schema, main path, {w} workers (h38)", "workers", False),
        "gated": (f"schema, gated, the default backend ({type(default_backend).__name__})", "default", True),
    }
    variants = [known[v] for v in args.variants if known[v][1] is None or known[v][1].rstrip("+") in backends]
    print(f"# engine ready after {time.perf_counter() - T0:.0f} s; variants {args.variants}", flush=True)

    # Step-loop parts, per core.step call.
    times: dict[str, float] = {}

    def timed(obj, name):
        fn = getattr(obj, name)

        def run(*a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                times[name] = times.get(name, 0.0) + time.perf_counter() - t
                if name == "step":
                    times["n"] = times.get("n", 0) + 1
        setattr(obj, name, run)

    ex = core.model_executor
    for obj, name in ((core, "step"), (core.scheduler, "schedule"), (ex, "execute_model"), (ex, "sample_tokens"),
                      (core, "_collect_inflight"), (llm.llm_engine.output_processor, "process_outputs"),
                      (manager, "gate_step"), (manager, "submit_gate"), (manager, "_wait_gate_job"),
                      (manager, "_prepare"), (manager, "submit_grammar_bitmask"), (core, "_sample_deferred"),
                      (runner, "forward"), (runner, "_sample_gated"), (runner, "_sample"), (runner, "sampler"),
                      (runner, "_finish_sample")):
        timed(obj, name)
    from pagedllm.structured_output import gate as gate_mod

    timed(gate_mod, "device_wait")

    switch = sys.getswitchinterval()

    def use(backend_name: str, gated: bool) -> None:
        manager._wait_gate_job()
        manager.accept_on_thread = backend_name.endswith("+")
        sys.setswitchinterval(1e-4 if manager.accept_on_thread else switch)
        backend = backends[backend_name.rstrip("+")]
        if manager._backend is not backend:
            manager._backend, manager._remote = backend, getattr(backend, "remote", False)
            manager._bitmasks, manager._bitmask_views, manager._flags, manager._gate_layout = [], [], None, None
        core.gate_sampling = gated

    so = StructuredOutputsParams(json=SCHEMA)
    for _name, backend_name, gated in variants:  # a short warm-up of each (the budget is tight)
        if backend_name:
            use(backend_name, gated)
        llm.generate(ps, SamplingParams(temperature=0.8, max_tokens=min(args.warmup_tokens, args.max_tokens), ignore_eos=True,
                                        structured_outputs=so if backend_name else None), use_tqdm=False)
    print(f"# warm-ups done after {time.perf_counter() - T0:.0f} s", flush=True)
    results = []
    for rnd in range(args.rounds):
        for name, backend_name, gated in variants:
            if backend_name:
                use(backend_name, gated)
            sp = SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True,
                                structured_outputs=so if backend_name else None)
            times.clear()
            runner.gate_waits.clear()
            stats = getattr(manager.backend(), "stats", None) if backend_name else None
            if stats is not None:
                stats.update(steps=0, jobs=0, accept_s=0.0, fill_s=0.0, wake_s=0.0, back_s=0.0)
                if gated and hasattr(manager.backend(), "gated_stats"):
                    manager._wait_gate_job()
                    manager.backend().gated_stats()  # read and reset: the warm-up's jobs dropped
            t = time.perf_counter()
            outs = llm.generate(ps, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            assert toks == args.num_requests * args.max_tokens, toks
            n = max(times.get("n", 1), 1)
            r = {"model": args.label, "round": rnd + 1, "variant": name, "constrained": backend_name is not None,
                 "tok_per_s": round(toks / dt, 1), "seconds": round(dt, 3),
                 "loop_ms": {k: round(1e3 * v / n, 3) for k, v in times.items() if k != "n"},
                 "gate_waits": dict(runner.gate_waits)}
            if backend_name:
                r["valid_outputs"] = check_outputs(checker, outs)
            if stats is not None and gated and hasattr(manager.backend(), "gated_stats"):
                manager._wait_gate_job()
                stats = manager.backend().gated_stats()  # summed over the workers, per gated job
            if stats is not None and stats["jobs"]:
                r.update({f"worker_{k[:-2]}_ms": round(1e3 * stats[k] / stats["jobs"], 3)
                          for k in ("accept_s", "fill_s")})
            results.append(r)
            print(json.dumps(r), flush=True)
        plain = [x["tok_per_s"] for x in results if x["round"] == rnd + 1 and not x["constrained"]]
        if plain:  # this round's pairs, as they come (a kill keeps them)
            print(f"# round {rnd + 1}: plain {plain[0]:.0f} tok/s; " + "; ".join(
                f"{x['variant']} {x['tok_per_s']:.0f} ({x['tok_per_s'] / plain[0]:.3f})"
                for x in results if x["round"] == rnd + 1 and x["constrained"]), flush=True)
    if args.mixed_check:
        # Gated steps whose batch mixes constrained and greedy unconstrained rows (the masked rows by
        # index): the greedy rows' tokens equal those of the same batch with no constraint anywhere
        # (the same batch sizes, so the same kernels: only the constraint differs).
        for backend_name in [b for b in ("default", "thread", "workers") if b in backends][: args.mixed_backends]:
            use(backend_name, True)
            greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            free = SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True)
            h = min(8, len(ps) // 2)
            alone = llm.generate(ps[:2 * h], [greedy] * h + [free] * h, use_tqdm=False)
            runner.gate_waits.clear()
            mixed = llm.generate(ps[:2 * h], [greedy] * h + [SamplingParams(temperature=0.8, max_tokens=64,
                                                                           ignore_eos=True, structured_outputs=so)] * h,
                                 use_tqdm=False)
            same = all(a.outputs[0].token_ids == m.outputs[0].token_ids for a, m in zip(alone[:h], mixed[:h]))
            r = {"model": args.label, "check": f"mixed batch, gated {backend_name}", "greedy_rows_equal": same,
                 "valid_schema_outputs": check_outputs(checker, mixed[h:]), "gate_waits": dict(runner.gate_waits)}
            results.append(r)
            print(json.dumps(r), flush=True)
    manager._wait_gate_job()
    use("default", False)
    for b in {id(b): b for b in backends.values() if b is not default_backend}.values():
        b.shutdown()
    return results


def child(args, extra: list[str], timeout: float) -> list[dict]:
    """Run one child, its lines printed as they come (a kill of this script keeps the rows so far),
    killed at `timeout`."""
    cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if args.env_worker:
        env["PAGEDLLM_GRAMMAR_WORKER"] = "1"
    t = time.perf_counter()
    rc, lines = run_child(cmd, env, timeout)
    print(f"# child {' '.join(extra[:4])}: exit {rc}, {time.perf_counter() - t:.0f} s", flush=True)
    return [json.loads(line) for line in lines if line.startswith("{")]


def table(results: list[dict]) -> None:
    print("\n| model | variant | tok/s (rounds) | schema / plain, best / best | median of pairs | core step ms | "
          "execute + sample ms | collect ms | gate waits | valid |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in dict.fromkeys(r["model"] for r in results if "model" in r and "check" not in r):
        runs = [r for r in results if r.get("model") == model and "check" not in r]
        plain = [r for r in runs if not r["constrained"]]
        best_plain = max((r["tok_per_s"] for r in plain), default=0)
        for variant in dict.fromkeys(r["variant"] for r in runs):
            rs = [r for r in runs if r["variant"] == variant]
            best = max(r["tok_per_s"] for r in rs)
            pairs = sorted(r["tok_per_s"] / p["tok_per_s"] for r in rs for p in plain if p["round"] == r["round"])
            med = pairs[len(pairs) // 2] if pairs else float("nan")
            lm = [r["loop_ms"] for r in rs]
            step = "/".join(f"{m.get('step', 0):.2f}" for m in lm)
            exe = "/".join(f"{m.get('execute_model', 0) + m.get('sample_tokens', 0):.2f}" for m in lm)
            col = "/".join(f"{m.get('_collect_inflight', 0):.2f}" for m in lm)
            ratio = f"{best / best_plain:.3f}" if rs[0]["constrained"] and best_plain else ""
            waits = rs[-1].get("gate_waits") or ""
            valid = "/".join(str(r.get("valid_outputs", "-")) for r in rs)
            toks = " / ".join(f"{r['tok_per_s']:,.0f}" for r in rs)
            print(f"| {model} | {variant} | {toks} | {ratio} | "
                  f"{med:.3f} | {step} | {exe} | {col} | {waits} | {valid} |")
    for r in results:
        if "check" in r:
            print(f"{r['model']}, {r['check']}: greedy rows equal {r['greedy_rows_equal']}, schema outputs valid "
                  f"{r['valid_schema_outputs']}, gate waits {r['gate_waits']}")
        if r.get("probe") == "gate":
            print(f"gate probe, {r['mechanism']}: correct {r['correct']}, flag -> copy done median "
                  f"{r['flag_to_copy_done_us_median']} us (min {r['min_us']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="the Qwen3-0.6B-shaped folder with SmolLM2's tokenizer (PEER_MODEL)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, nargs=2, default=[2, 6], metavar=("N", "THREADS"))
    ap.add_argument("--no-workers", action="store_true", help="skip the grammar-worker variant")
    names = ["plain", "main", "gated-thread", "gated-thread-accept", "gated-workers", "main-workers", "gated"]
    ap.add_argument("--variants", nargs="+", choices=names, default=["plain", "main", "gated-thread-accept", "gated-workers"],
                    help="the variants, in the order they alternate (main: PAGEDLLM_GRAMMAR_GATE off, main's path)")
    ap.add_argument("--big-variants", nargs="+", choices=names, default=["plain", "main", "gated-workers"])
    ap.add_argument("--probe", action="store_true", help="first the gate probe (the device wait's correctness, latency)")
    ap.add_argument("--warmup-tokens", type=int, default=64)
    ap.add_argument("--capture-sizes", type=int, nargs="+",
                    help="decode graph sizes to capture (FULL_DECODE_ONLY): a faster start, the same decode steps, "
                         "but the first prefill steps then compile their kernels (round 3 on the H200: no timed run "
                         "within 30 s of the engine's start)")
    ap.add_argument("--mixed-backends", type=int, default=3, help="how many backends the mixed check runs")
    ap.add_argument("--env-worker", action="store_true", help="children with PAGEDLLM_GRAMMAR_WORKER=1")
    ap.add_argument("--mixed-check", action="store_true",
                    help="after the runs: greedy rows beside gated constrained rows equal their tokens alone")
    ap.add_argument("--big-tokens", type=int, default=256, help="tokens per request for the 8B shape")
    ap.add_argument("--big-rounds", type=int, default=1, help="rounds for the 8B shape")
    ap.add_argument("--deadline", type=float, default=95.0, help="seconds for the whole script")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--child", choices=["probe", "engine"], help=argparse.SUPPRESS)
    ap.add_argument("--label", default="qwen3-0.6b shape", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.no_workers:
        args.workers = None
    if args.child == "probe":
        gate_probe()
        return
    if args.child == "engine":
        run_engine(args)
        return
    t0 = time.perf_counter()
    left = lambda: args.deadline - (time.perf_counter() - t0)  # noqa: E731
    results = []
    base = ["--num-requests", str(args.num_requests), "--rounds", str(args.rounds)]
    if args.workers:
        base += ["--workers", *map(str, args.workers)]
    else:
        base.append("--no-workers")
    base += ["--warmup-tokens", str(args.warmup_tokens), "--mixed-backends", str(args.mixed_backends)]
    if args.capture_sizes:
        base += ["--capture-sizes", *map(str, args.capture_sizes)]
    mixed = ["--mixed-check"] if args.mixed_check else []
    if args.device == "cuda" and args.probe:
        results += child(args, ["--child", "probe"], min(20, left()))
    label = "qwen3-0.6b shape" if args.model else f"embedded SmolLM2-135M ({args.device})"
    small = ["--child", "engine", "--max-tokens", str(args.max_tokens), "--label", label, *base, *mixed,
             "--variants", *args.variants]
    results += child(args, small + (["--model", args.model] if args.model else []), left() - 2)
    if args.model and args.device == "cuda" and left() > 40:
        folder = write_llama8b(args.model, os.path.join(args.out, "h42_llama8b_v49152"))
        big = ["--child", "engine", "--max-tokens", str(args.big_tokens), "--label", "llama-3.1-8b shape, V 49152",
               "--model", folder, *base, "--variants", *args.big_variants]
        big[big.index("--rounds") + 1] = str(args.big_rounds)
        results += child(args, big, left() - 2)
        shutil.rmtree(folder, ignore_errors=True)
    table(results)


if __name__ == "__main__":
    main()
