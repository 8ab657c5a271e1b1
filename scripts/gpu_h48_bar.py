"""Issue 22's cost bar in one call: decode of N concurrent requests x M tokens, every request under a JSON
schema, against the same requests unconstrained (schema / plain >= 0.90 is the bar), at the Qwen3-0.6B and
the Llama-3.1-8B shapes (SmolLM2's 49,152-token tokenizer, dummy weights), and vLLM 0.21's xgrammar path on
the same workload and shapes in processes of their own (--vllm).

    # the H200 ($PEER_MODEL: SmolLM2's tokenizer + the Qwen3-0.6B config cut to 49,152 tokens)
    PYTHONPATH=$PWD python3 -u scripts/gpu_h48_bar.py --model "$PEER_MODEL" --deadline 85 [--vllm]
    # this CPU: the embedded SmolLM2-135M, async scheduling
    PYTHONPATH=$PWD python scripts/gpu_h48_bar.py --device cpu --num-requests 16 --max-tokens 32

Each engine runs in a child process of its own, one per shape; pagedllm's variants alternate in it (the
same engine, the same grammar workers), `--rounds` times:
    plain         unconstrained
    main          schema, PAGEDLLM_GRAMMAR_GATE=0's path: sampling in a call of its own once the fill is done
    gated         schema, gated sampling, the gated jobs on the workers' sockets (h42's)
    gated-spin    schema, gated sampling, the gated jobs through the workers' job areas (PAGEDLLM_GRAMMAR_SPIN)
    gated-thread  schema, gated sampling, the bitmask thread instead of grammar workers
    default       schema, whatever the engine's defaults pick (no switch touched)
Children run with PAGEDLLM_GRAMMAR_WORKER=1 and PAGEDLLM_GRAMMAR_SPIN=1 (so both gated channels exist)
unless --defaults (the engine's own defaults, for the final measurement). Every schema output is checked
(every token allowed by a fresh xgrammar matcher, every complete record valid: gpu_structured_bench.py).
One JSON line per run as it ends, a line per round with its pairs, a table last. A run that takes longer
than --run-timeout ends its child (a hang costs that child, not the call).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from _child_runs import run_child, write_llama8b

T0 = time.perf_counter()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_SITE = "/tmp/site"  # where the GPU machine keeps vLLM 0.21 (PYTHONPATH of its child only)
MAX_NUM_SEQS = 64  # both engines: the workload's concurrency (fewer graphs to capture at the start)
HUNG: set[str] = set()  # variants whose run never ended in an earlier child
VARIANTS = ("plain", "main", "gated", "gated-spin", "gated-thread", "default")


def say(obj) -> None:
    print(json.dumps(obj) if isinstance(obj, dict) else obj, flush=True)


def run_timeout_guard(seconds: float, label: list[str]) -> threading.Event:
    """A thread that ends this process if a run takes longer than `seconds` (a device wait that never
    returns cannot be interrupted from Python); set the returned event at each run's end."""
    done = threading.Event()
    done.limit = seconds  # the caller may change it between runs (warm-ups compile: longer)

    def guard() -> None:
        while True:
            done.clear()
            limit = done.limit
            if not done.wait(limit):
                say(f"# {label[0]}: no end after {limit:.0f} s; the child exits")
                os._exit(3)

    threading.Thread(target=guard, daemon=True).start()
    return done


def fork_compile_processes() -> None:
    """Triton's compile processes forked now, before CUDA starts (the prestart of `pagedllm serve` does the
    same; an offline LLM otherwise compiles a cold start's variants one after another)."""
    try:
        from pagedllm.worker import compile_pool

        if compile_pool.current() is None:
            compile_pool._pool = compile_pool.CompilePool(compile_pool._processes(), fork=True)
    except Exception as e:  # noqa: BLE001 - only slower
        say(f"# compile processes not forked: {e}")


def ours(args) -> None:
    import torch  # noqa: F401 - before the fork of the compile processes

    if args.device == "cuda":
        fork_compile_processes()
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from gpu_structured_bench import SCHEMA, OutputChecker, check_outputs, prompts

    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams
    from pagedllm.structured_output.manager import make_backend

    pre: dict = {}
    if args.model:
        # The grammar backend (two worker processes: their imports take seconds) built beside the
        # engine's start, as the manager would build it at the first constrained request.
        def prebuild() -> None:
            from pathlib import Path

            from pagedllm.loader.tokenizer import load_tokenizer
            from pagedllm.structured_output.manager import use_grammar_worker

            try:
                vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
                pre["backend"] = make_backend(load_tokenizer(Path(args.model), False, True), vocab,
                                              worker=use_grammar_worker(), rows=MAX_NUM_SEQS,
                                              pin_memory=args.device == "cuda")
            except Exception as e:  # noqa: BLE001 - the manager builds its own then
                pre["error"] = repr(e)

        builder = threading.Thread(target=prebuild, daemon=True)
        builder.start()
    kwargs = dict(max_model_len=1024, seed=0, async_scheduling=not args.sync, max_num_seqs=MAX_NUM_SEQS)
    if args.max_batched_tokens:
        kwargs.update(max_num_batched_tokens=args.max_batched_tokens)
    if args.model:
        kwargs.update(model=args.model, load_format="dummy")
    if args.device == "cpu":
        kwargs.update(num_gpu_blocks_override=64 * args.num_requests)
    if args.capture_sizes:
        kwargs.update(compilation_config={"cudagraph_capture_sizes": args.capture_sizes})
    t = time.perf_counter()
    llm = LLM(**kwargs)
    core = llm.llm_engine.engine_core
    manager = core.structured_output_manager
    runner = core.model_executor.driver_worker.model_runner
    cfg = llm.llm_engine.config
    tok = llm.get_tokenizer()
    ps = prompts(tok, args.num_requests)
    default_gate = core.gate_sampling
    t_backend = time.perf_counter()
    if args.model:
        from pagedllm.structured_output.manager import use_grammar_worker

        builder.join()
        want_remote = use_grammar_worker()
        if "backend" in pre and getattr(pre["backend"], "remote", False) == want_remote:
            manager._backend, manager._remote = pre["backend"], want_remote
        else:
            say(f"# the grammar backend built beside the start is not the engine's: {pre.get('error', 'another kind')}")
            if "backend" in pre:
                pre["backend"].shutdown()
    default_backend = manager.backend()  # the grammar workers, or the thread, as the environment says
    remote = getattr(default_backend, "remote", False)
    backends = {"default": default_backend}
    if "gated-thread" in args.variants:
        backends["thread"] = default_backend if not remote else make_backend(tok, cfg.model_config.vocab_size)
    checker = OutputChecker(tok, cfg.model_config.vocab_size)
    say(f"# {args.label}: engine ready in {t_backend - t:.1f} s, grammar backend "
        f"{type(default_backend).__name__} ({len(getattr(default_backend, '_lanes', [])) or 'no'} workers) in "
        f"{time.perf_counter() - t_backend:.1f} s; gate_sampling default {default_gate}; "
        f"child at {time.perf_counter() - T0:.0f} s")
    # One wrapper only (core.step: the step count and mean), so that timing costs the loop ~1 us a step.
    steps = {"n": 0, "s": 0.0}
    step = core.step

    def timed_step():
        t = time.perf_counter()
        try:
            return step()
        finally:
            steps["n"] += 1
            steps["s"] += time.perf_counter() - t

    core.step = timed_step

    def use(variant: str) -> None:
        manager._wait_gate_job()
        backend = backends["thread" if variant == "gated-thread" else "default"]
        if manager._backend is not backend:
            manager._backend, manager._remote = backend, getattr(backend, "remote", False)
            manager._bitmasks, manager._bitmask_views, manager._flags, manager._gate_layout = [], [], None, None
        if hasattr(backend, "spin"):
            backend.spin = variant == "gated-spin" if variant != "default" else backend.default_spin
        core.gate_sampling = default_gate if variant == "default" else variant != "main"

    if hasattr(default_backend, "spin"):
        default_backend.default_spin = default_backend.spin
    so = StructuredOutputsParams(json=SCHEMA)
    label = ["warm-up"]
    guard = run_timeout_guard(args.warmup_timeout, label)
    warm: set[str] = set()

    def warm_up(variant: str) -> None:
        """A short run of `variant` before its first timed one (the first compiles what the start did not;
        done just before, so that a variant that hangs costs only itself and those after it)."""
        guard.limit = args.warmup_timeout
        label[0] = f"{args.label} warm-up {variant}"
        t = time.perf_counter()
        llm.generate(ps, SamplingParams(temperature=0.8, max_tokens=args.warmup_tokens, ignore_eos=True,
                                        structured_outputs=None if variant == "plain" else so), use_tqdm=False)
        guard.set()
        guard.limit = args.run_timeout
        warm.add(variant)
        say(f"# {args.label}: warm-up {variant} {time.perf_counter() - t:.1f} s")

    results = []
    deadline = T0 + args.child_deadline
    for rnd in range(1, args.rounds + 1):
        for variant in args.variants:
            if time.perf_counter() > deadline:
                say(f"# {args.label}: child deadline; round {rnd} {variant} not run")
                break
            use(variant)
            if variant not in warm:
                warm_up(variant)
            label[0] = f"{args.label} round {rnd} {variant}"
            constrained = variant != "plain"
            sp = SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True,
                                structured_outputs=so if constrained else None)
            backend = manager.backend()
            if constrained and hasattr(backend, "gated_stats"):
                backend.gated_stats()  # read and reset
            runner.gate_waits.clear()
            steps.update(n=0, s=0.0)
            t = time.perf_counter()
            outs = llm.generate(ps, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            guard.set()
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            r = {"model": args.label, "engine": "pagedllm", "round": rnd, "variant": variant,
                 "constrained": constrained, "tok_per_s": round(toks / dt, 1), "seconds": round(dt, 3),
                 "tokens": toks, "step_ms": round(1e3 * steps["s"] / max(steps["n"], 1), 3), "steps": steps["n"],
                 "gate_waits": dict(runner.gate_waits)}
            if toks != args.num_requests * args.max_tokens:
                r["error"] = f"{toks} tokens, not {args.num_requests * args.max_tokens}"
            if constrained:
                try:
                    r["valid_outputs"] = check_outputs(checker, outs)
                except AssertionError as e:
                    r["valid_outputs"] = 0
                    r["error"] = str(e)[:300]
                if hasattr(backend, "gated_stats") and core.gate_sampling:
                    manager._wait_gate_job()
                    st = backend.gated_stats()
                    if st["jobs"]:
                        r.update(worker_jobs=st["jobs"], area_jobs=st["area_jobs"],
                                 worker_accept_ms=round(1e3 * st["accept_s"] / st["jobs"], 3),
                                 worker_fill_ms=round(1e3 * st["fill_s"] / st["jobs"], 3))
            results.append(r)
            say(r)
        plain = [x["tok_per_s"] for x in results if x["round"] == rnd and not x["constrained"]]
        if plain:
            say(f"# {args.label} round {rnd}: plain {plain[0]:,.0f} tok/s; " + "; ".join(
                f"{x['variant']} {x['tok_per_s']:,.0f} ({x['tok_per_s'] / plain[0]:.3f})"
                for x in results if x["round"] == rnd and x["constrained"]))
    if args.mixed_check and time.perf_counter() < deadline:
        # Gated steps mixing constrained rows with greedy unconstrained ones: the greedy rows' tokens equal
        # those of the same batch with the constrained rows unconstrained (same batch sizes, same kernels).
        use("gated-spin" if "gated-spin" in args.variants else "default")
        label[0] = f"{args.label} mixed check"
        h = min(8, len(ps) // 2)
        greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        free = SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True)
        alone = llm.generate(ps[:2 * h], [greedy] * h + [free] * h, use_tqdm=False)
        runner.gate_waits.clear()
        mixed = llm.generate(ps[:2 * h], [greedy] * h + [SamplingParams(
            temperature=0.8, max_tokens=64, ignore_eos=True, structured_outputs=so)] * h, use_tqdm=False)
        guard.set()
        same = all(a.outputs[0].token_ids == m.outputs[0].token_ids for a, m in zip(alone[:h], mixed[:h]))
        try:
            valid = check_outputs(checker, mixed[h:])
        except AssertionError as e:
            valid = str(e)[:200]
        say({"model": args.label, "check": "mixed batch, gated", "greedy_rows_equal": same,
             "valid_schema_outputs": valid, "gate_waits": dict(runner.gate_waits)})
    manager._wait_gate_job()
    use("default")
    for b in {id(b): b for b in backends.values() if b is not default_backend}.values():
        b.shutdown()
    llm.llm_engine.shutdown()


def theirs(args) -> None:
    """vLLM 0.21, xgrammar: the same prompts, schema, sampling and checks; plain and schema alternating."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from gpu_structured_bench import SCHEMA, OutputChecker, check_outputs, prompts
    from vllm import LLM, SamplingParams

    try:
        from vllm.sampling_params import StructuredOutputsParams
        so_kw = lambda: {"structured_outputs": StructuredOutputsParams(json=SCHEMA)}  # noqa: E731
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams
        so_kw = lambda: {"guided_decoding": GuidedDecodingParams(json=SCHEMA)}  # noqa: E731
    kwargs = {}
    try:
        from vllm.config import StructuredOutputsConfig

        kwargs["structured_outputs_config"] = StructuredOutputsConfig(backend="xgrammar")
    except ImportError:
        pass
    t = time.perf_counter()
    llm = LLM(model=args.model, load_format="dummy", max_model_len=1024, seed=0, gpu_memory_utilization=0.8,
              max_num_seqs=MAX_NUM_SEQS, **kwargs)
    ps = prompts(llm.get_tokenizer(), args.num_requests)
    checker = OutputChecker(llm.get_tokenizer(), json.load(open(os.path.join(args.model, "config.json")))["vocab_size"])
    say(f"# {args.label}: vLLM ready in {time.perf_counter() - t:.1f} s, child at {time.perf_counter() - T0:.0f} s")
    label = ["vllm warm-up"]
    guard = run_timeout_guard(args.warmup_timeout, label)
    for extra in ({}, so_kw()):
        label[0] = f"vllm {args.label} warm-up {'schema' if extra else 'plain'}"
        t = time.perf_counter()
        llm.generate(ps, SamplingParams(temperature=0.8, max_tokens=args.warmup_tokens, ignore_eos=True, **extra),
                     use_tqdm=False)
        guard.set()
        say(f"# vllm {args.label}: warm-up {'schema' if extra else 'plain'} {time.perf_counter() - t:.1f} s")
    guard.limit = args.run_timeout
    results = []
    deadline = T0 + args.child_deadline
    for rnd in range(1, args.rounds + 1):
        for constrained in (False, True):
            if time.perf_counter() > deadline:
                say(f"# {args.label}: child deadline; vLLM round {rnd} not run")
                break
            label[0] = f"vllm {args.label} round {rnd}"
            extra = so_kw() if constrained else {}
            sp = SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True, **extra)
            t = time.perf_counter()
            outs = llm.generate(ps, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            guard.set()
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            r = {"model": args.label, "engine": "vllm", "round": rnd, "variant": "schema" if constrained else "plain",
                 "constrained": constrained, "tok_per_s": round(toks / dt, 1), "seconds": round(dt, 3), "tokens": toks}
            if constrained:
                try:
                    r["valid_outputs"] = check_outputs(checker, outs)
                except AssertionError as e:
                    r["valid_outputs"] = 0
                    r["error"] = str(e)[:300]
            results.append(r)
            say(r)


def child(args, engine: str, model: str | None, label: str, max_tokens: int, variants: list[str],
          timeout: float) -> list[dict]:
    """One engine in its own process, its lines printed as they come; killed at `timeout`."""
    cmd = [sys.executable, "-u", os.path.abspath(__file__), "--child", engine, "--device", args.device,
           "--label", label, "--num-requests", str(args.num_requests), "--max-tokens", str(max_tokens),
           "--rounds", str(args.rounds), "--warmup-tokens", str(args.warmup_tokens),
           "--run-timeout", str(args.run_timeout), "--warmup-timeout", str(args.warmup_timeout),
           "--child-deadline", str(max(timeout - 8, 5))]
    if engine == "pagedllm":
        cmd += ["--variants", *variants]  # vLLM's child runs plain and schema
    if model:
        cmd += ["--model", model]
    if args.capture_sizes:
        cmd += ["--capture-sizes", *map(str, args.capture_sizes)]
    if args.mixed_check and engine == "pagedllm":
        cmd.append("--mixed-check")
    if args.sync:
        cmd.append("--sync")
    if engine == "pagedllm" and "8b" in label and args.big_max_batched_tokens:
        cmd += ["--max-batched-tokens", str(args.big_max_batched_tokens)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    paths = [REPO] + ([VLLM_SITE] if engine == "vllm" and os.path.isdir(VLLM_SITE) else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if engine == "vllm":
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    elif not args.defaults:
        env.update(PAGEDLLM_GRAMMAR_WORKER="1", PAGEDLLM_GRAMMAR_SPIN="1")
    t = time.perf_counter()
    rc, lines = run_child(cmd, env, timeout, merge_stderr=True, show=lambda line: line.startswith(("{", "#"))
                          or args.verbose or "Error" in line or "Traceback" in line)
    if rc != 0:  # the child's last words (those not printed above)
        print("".join([ln for ln in lines if not ln.startswith(("{", "#"))][-15:]), end="", flush=True)
    say(f"# child {engine} {label}: exit {rc}, {time.perf_counter() - t:.0f} s")
    for line in lines:  # a variant that hung here is left out of the later children
        if "no end after" in line and line.split(":")[0].split()[-1] in VARIANTS:
            HUNG.add(line.split(":")[0].split()[-1])
    return [json.loads(line) for line in lines if line.startswith("{")]


def table(results: list[dict]) -> None:
    say("\n| shape | engine | variant | tok/s (rounds) | best / best plain | pairs (each over its round's plain) | "
        "step ms | valid | worker accept / fill ms | area jobs |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    runs = [r for r in results if "variant" in r]
    for model, engine in dict.fromkeys((r["model"], r["engine"]) for r in runs):
        rs_all = [r for r in runs if r["model"] == model and r["engine"] == engine]
        plain = {r["round"]: r["tok_per_s"] for r in rs_all if not r["constrained"]}
        best_plain = max(plain.values(), default=0)
        for variant in dict.fromkeys(r["variant"] for r in rs_all):
            rs = [r for r in rs_all if r["variant"] == variant]
            best = max(r["tok_per_s"] for r in rs)
            pairs = [f"{r['tok_per_s'] / plain[r['round']]:.3f}" for r in rs if r["round"] in plain and r["constrained"]]
            ratio = f"{best / best_plain:.3f}" if rs[0]["constrained"] and best_plain else ""
            toks = " / ".join(f"{r['tok_per_s']:,.0f}" for r in rs)
            step = " / ".join(f"{r.get('step_ms', 0):.2f}" for r in rs) if engine == "pagedllm" else ""
            valid = "/".join(str(r.get("valid_outputs", "-")) for r in rs)
            wk = " ; ".join(f"{r['worker_accept_ms']:.2f} / {r['worker_fill_ms']:.2f}" for r in rs if "worker_fill_ms" in r)
            area = " ; ".join(f"{r['area_jobs']} of {r['worker_jobs']}" for r in rs if "area_jobs" in r)
            say(f"| {model} | {engine} | {variant} | {toks} | {ratio} | {', '.join(pairs)} | {step} | {valid} | "
                f"{wk} | {area} |")
    for r in results:
        if "check" in r:
            say(f"{r['model']}, {r['check']}: greedy rows equal {r['greedy_rows_equal']}, schema outputs valid "
                f"{r['valid_schema_outputs']}, gate waits {r['gate_waits']}")
        if "error" in r:
            say(f"ERROR {r['model']} {r['engine']} {r.get('variant')} round {r.get('round')}: {r['error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="the Qwen3-0.6B-shaped folder with SmolLM2's tokenizer ($PEER_MODEL)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shapes", nargs="+", default=["0.6b", "8b"], choices=["0.6b", "8b"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--big-tokens", type=int, help="tokens per request at the 8B shape (default --max-tokens)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=["plain", "gated", "gated-spin"])
    ap.add_argument("--big-variants", nargs="+", choices=VARIANTS, help="variants at the 8B shape (default --variants)")
    ap.add_argument("--defaults", action="store_true",
                    help="children with the engine's own defaults (no PAGEDLLM_GRAMMAR_WORKER/SPIN set)")
    ap.add_argument("--sync", action="store_true",
                    help="ours without async scheduling (the CPU's default; no gated steps then)")
    ap.add_argument("--vllm", action="store_true", help="also vLLM (xgrammar) per shape, after ours")
    ap.add_argument("--warmup-tokens", type=int, default=32)
    ap.add_argument("--big-max-batched-tokens", type=int,
                    help="ours at the 8B shape: max_num_batched_tokens (1536: every prefill chunk within the mixed-step "
                         "graphs captured at the start, none run eagerly; round 1's 8B warm-up compiled past 20 s)")
    ap.add_argument("--max-batched-tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--capture-sizes", type=int, nargs="+", help="decode CUDA graph sizes (a shorter start)")
    ap.add_argument("--mixed-check", action="store_true", help="ours, after the runs: greedy rows beside gated rows")
    ap.add_argument("--deadline", type=float, default=85.0, help="seconds for the whole script")
    ap.add_argument("--reserve", type=float, default=25.0,
                    help="seconds each later child needs at least (one is skipped when less is left)")
    ap.add_argument("--weights", type=float, nargs="+",
                    help="each child's share of the time, by weight, in their order (ours then vLLM, per shape)")
    ap.add_argument("--run-timeout", type=float, default=30.0, help="a run longer than this ends its child")
    ap.add_argument("--warmup-timeout", type=float, default=60.0,
                    help="the same for each warm-up (the first one may compile kernels the start did not)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--verbose", action="store_true", help="print every line the children write")
    ap.add_argument("--child", choices=["pagedllm", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--label", default="", help=argparse.SUPPRESS)
    ap.add_argument("--child-deadline", type=float, default=1e9, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "pagedllm":
        ours(args)
        return
    if args.child == "vllm":
        theirs(args)
        return
    left = lambda: args.deadline - (time.perf_counter() - T0)  # noqa: E731
    if args.vllm:
        probe = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                   [VLLM_SITE, os.environ.get("PYTHONPATH", "")])))
        say(f"# import vllm: {'ok, ' + probe.stdout.strip() if probe.returncode == 0 else 'FAILED'}"
            + ("" if probe.returncode == 0 else ": " + probe.stderr.strip().splitlines()[-1:][0]))
        if probe.returncode != 0:
            args.vllm = False
    jobs = []  # (engine, model folder, label, tokens, variants)
    for shape in args.shapes:
        if args.device == "cpu":
            label = f"{os.path.basename(args.model)} (cpu)" if args.model else "embedded SmolLM2-135M (cpu)"
            jobs.append(("pagedllm", args.model, label, args.max_tokens, args.variants))
            break
        if shape == "0.6b":
            model, label, toks, variants = args.model, "qwen3-0.6b shape", args.max_tokens, args.variants
        else:
            model = write_llama8b(args.model, os.path.join(args.out, "h48_llama8b_v49152"), bos_eos=(1, 2))
            label, toks = "llama-3.1-8b shape", args.big_tokens or args.max_tokens
            variants = args.big_variants or args.variants
        jobs.append(("pagedllm", model, label, toks, variants))
        if args.vllm:
            jobs.append(("vllm", model, label, toks, ["plain", "schema"]))
    results: list[dict] = []
    # Each child gets a share of what is left, by weight (vLLM starts slower; the 8B runs are longer);
    # what a child leaves unused goes to the later ones.
    weights = [(1.6 if engine == "vllm" else 1.0) * (1.2 if "8b" in label else 1.0) for engine, _, label, _, _ in jobs]
    if args.weights and len(args.weights) == len(jobs):
        weights = args.weights
    elif args.weights:  # e.g. vLLM not importable: its children dropped
        say(f"# --weights: {len(args.weights)} given for {len(jobs)} children; the default weights instead")
    for i, (engine, model, label, toks, variants) in enumerate(jobs):
        share = (left() - 2) * weights[i] / sum(weights[i:])
        if share < args.reserve:
            share = left() - 2 - args.reserve * (len(jobs) - i - 1)  # the later children keep their minimum
        if share < args.reserve:
            say(f"# {engine} {label}: skipped, {left():.0f} s left")
            continue
        if HUNG & set(variants):
            say(f"# {label}: {sorted(HUNG & set(variants))} left out (hung in an earlier child)")
            variants = [v for v in variants if v not in HUNG]
        results += child(args, engine, model, label, toks, variants, share)
    shutil.rmtree(os.path.join(args.out, "h48_llama8b_v49152"), ignore_errors=True)
    table(results)


if __name__ == "__main__":
    main()
