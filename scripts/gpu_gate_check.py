# budget: 120 s
"""Gated sampling's first constrained batch on the H200 (issue 22; h48 round 2 hung there, h52 fixed the
order: the fill job is posted before the device wait is queued), then plain against gated, timed.

    PYTHONPATH=$PWD python3 -u scripts/gpu_gate_check.py --model "$PEER_MODEL"          # the H200, ~90 s
    PYTHONPATH=$PWD python scripts/gpu_gate_check.py --device cpu --num-requests 8 --max-tokens 16 \\
        --first-tokens 16 --rounds 1 --sync-at-launch 20                                 # this CPU
    # the cause's confirmation (a separate call): the pre-h52 order should hang in the first batch
    PYTHONPATH=$PWD python3 -u scripts/gpu_gate_check.py --model "$PEER_MODEL" --old-order --first-timeout 20

One engine in this process at the Qwen3-0.6B shape ($PEER_MODEL: SmolLM2's 49,152-token tokenizer, the
Qwen3-0.6B config, dummy weights), async scheduling, gated sampling with grammar workers and their job
areas (PAGEDLLM_GRAMMAR_GATE=1 PAGEDLLM_GRAMMAR_WORKER=1 PAGEDLLM_GRAMMAR_SPIN=1 unless set already):
  1. a short plain warm-up (the unmasked kernels), as h48's round 2 ran plain first;
  2. the engine's FIRST constrained batch: --num-requests requests of distinct JSON schemas (each its own
     compile, so they join the gated batch step by step) x --first-tokens, gated, as h48's hang;
  3. --rounds rounds of plain, gated (and --variants main: the gate off) on one schema, timed.
Valid: every token of an output accepted by a fresh xgrammar matcher of its schema. Every run has a watchdog: past its limit it prints every thread's stack of this process (faulthandler)
and of the grammar workers (SIGUSR1, grammar_worker.py), the gates' words, then exits 3; a C-level
faulthandler timer a little later is the fallback if the watchdog cannot get the GIL. One JSON line per
run as it ends, a short table last.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import os
import signal
import sys
import threading
import time

import gpu_structured_bench

T0 = time.perf_counter()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_NUM_SEQS = 64
# gpu_structured_bench's schema: an array no 512-token answer completes.
BASE_SCHEMA = gpu_structured_bench.SCHEMA


def say(obj) -> None:
    print(json.dumps(obj) if isinstance(obj, dict) else obj, flush=True)


def schema(i: int | None) -> dict:
    """BASE_SCHEMA, or its i-th variant (distinct bounds and enum: a compile of its own each)."""
    s = copy.deepcopy(BASE_SCHEMA)
    if i is not None:
        props = s["items"]["properties"]
        props["name"]["maxLength"] = 8 + i % 9
        props["age"]["maximum"] = 60 + i
        props["role"]["enum"] = ["admin", "user", "guest", f"role{i}"]
        props["tags"]["maxItems"] = 1 + i % 3
    return s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="the Qwen3-0.6B-shaped folder with SmolLM2's tokenizer ($PEER_MODEL); "
                                    "default: the embedded SmolLM2-135M")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens a request in the timed runs")
    ap.add_argument("--first-tokens", type=int, default=512, help="tokens a request in the first constrained batch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["plain", "gated"], choices=["plain", "gated", "main"],
                    help="the timed runs of each round (main: the gate off, main's path, same workers)")
    ap.add_argument("--capture-sizes", type=int, nargs="+", default=[8, 16, 32, 64],
                    help="decode CUDA graph sizes (fewer: a shorter start)")
    ap.add_argument("--first-timeout", type=float, default=40.0, help="the first constrained batch's limit, s")
    ap.add_argument("--run-timeout", type=float, default=20.0, help="each other run's limit, s")
    ap.add_argument("--deadline", type=float, default=112.0, help="no run starts past this many seconds")
    ap.add_argument("--gate-timeout", type=float,
                    help="gate.GATE_TIMEOUT_S: a gate its fillers leave shut this long is forced open (its rows aborted)")
    ap.add_argument("--sync-at-launch", type=float,
                    help="CPU: gate.SYNC_AT_LAUNCH_S, a gated step waits for its gate at its sampling launch (the "
                         "device's worst case), failing after this many seconds")
    ap.add_argument("--no-workers", action="store_true", help="the bitmask thread instead of grammar workers")
    ap.add_argument("--no-spin", action="store_true", help="the workers' jobs on their sockets, not their job areas")
    ap.add_argument("--old-order", action="store_true",
                    help="the pre-h52 order (the device wait queued with the forward, the job posted after the "
                         "collect): expected to hang in the first constrained batch on a GPU, confirming the cause")
    ap.add_argument("--dry-run", action="store_true", help="parse, print the plan and exit")
    args = ap.parse_args(argv)
    if args.num_requests < 1 or args.num_requests > MAX_NUM_SEQS:
        ap.error(f"--num-requests must be in 1..{MAX_NUM_SEQS}")
    if min(args.max_tokens, args.first_tokens, args.rounds) < 1:
        ap.error("--max-tokens, --first-tokens and --rounds must be >= 1")
    if args.sync_at_launch is not None and args.device != "cpu":
        ap.error("--sync-at-launch is the CPU's stand-in for the device's wait")
    if args.device == "cuda" and not args.model:
        ap.error("--device cuda needs --model (the Qwen3-0.6B shape with dummy weights: $PEER_MODEL)")
    return args


def set_environment(args) -> dict[str, str]:
    """The gate, the workers and their areas on (before pagedllm reads its switches), unless set."""
    want = {"PAGEDLLM_GRAMMAR_GATE": "1", "PAGEDLLM_GRAMMAR_WORKER": "0" if args.no_workers else "1",
            "PAGEDLLM_GRAMMAR_SPIN": "0" if args.no_spin else "1"}
    for k, v in want.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in want}


class Watch:
    """A run's watchdog: past `limit` s it prints the stacks (this process's threads, the grammar
    workers' through SIGUSR1) and the gates' state, then ends the process (a device wait that never
    returns cannot be interrupted from Python). faulthandler's C timer fires 5 s later as a fallback."""

    def __init__(self, state) -> None:
        self.state = state  # a callable: the gates' and workers' state, as a dict
        self.worker_pids: list[int] = []
        self._cv = threading.Condition()
        self._run: tuple[str, float, float] | None = None  # (label, start, limit)
        threading.Thread(target=self._loop, name="gate-check-watch", daemon=True).start()

    def start(self, label: str, limit: float) -> None:
        faulthandler.dump_traceback_later(limit + 5, exit=True)
        with self._cv:
            self._run = (label, time.monotonic(), limit)
            self._cv.notify()

    def stop(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        with self._cv:
            self._run = None
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._run is None:
                    self._cv.wait()
                label, start, limit = self._run
                left = start + limit - time.monotonic()
                if left > 0:
                    self._cv.wait(min(left, 1.0))
                    continue
            say(f"# HANG? {label}: no end after {limit:.0f} s; stacks follow, then the process exits")
            try:
                say({"hang": label, **self.state()})
            except Exception as e:  # noqa: BLE001 - the stacks matter more
                say(f"# state unreadable: {e!r}")
            faulthandler.dump_traceback(all_threads=True)
            for pid in self.worker_pids:
                try:
                    os.kill(pid, signal.SIGUSR1)  # the worker prints its stacks to our stderr
                except ProcessLookupError:
                    say(f"# grammar worker {pid} is gone")
            sys.stderr.flush()
            time.sleep(1.5)
            os._exit(3)


def gate_state(core) -> dict:
    """What a hang's diagnosis needs: the flag words against the newest gate, the workers' state."""
    manager = core.structured_output_manager
    runner = core.model_executor.driver_worker.model_runner
    out = {"gate_waits": dict(runner.gate_waits), "inflight": core.inflight is not None,
           "waiting_for_grammar": len(core.waiting_for_grammar), "constrained": len(manager.requests)}
    flags = manager._flags
    if flags is not None:
        out.update(seq=flags.seq, words=flags.words.tolist(), failure=getattr(flags, "failure", None))
    backend = manager._backend
    if backend is not None and getattr(backend, "remote", False):
        out["workers_alive"] = [p.poll() is None for p in backend._workers.procs]
        out["watch"] = vars(backend._watch)
        out["job_headers"] = [list(lane.area[0][:7]) for lane in backend._lanes if lane.area is not None]
        out["spin_until_minus_now"] = [round(float(lane.area[2][0]) - time.monotonic(), 3)
                                       for lane in backend._lanes if lane.area is not None]
    return out


class Checker:
    """Every token of a schema output allowed by a fresh matcher of its schema, compiled by the engine's
    own backend (its cache: no second compile; the grammar the requests were served under)."""

    def __init__(self, manager, eos_id: int) -> None:
        self.manager, self.eos_id = manager, eos_id

    def valid(self, outs, schemas: list[dict]) -> int:
        from pagedllm.sampling_params import StructuredOutputsParams

        backend = self.manager.backend()
        local = getattr(backend, "local", backend)  # the grammar workers' in-process twin
        n = 0
        for o, s in zip(outs, schemas, strict=True):
            matcher = local.compile_grammar(StructuredOutputsParams(json=s), [self.eos_id]).matcher
            n += all(matcher.accept_token(t) for t in o.outputs[0].token_ids)
        return n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = set_environment(args)
    say(f"# gate check: {env}, device {args.device}, model {args.model or 'embedded SmolLM2-135M'}, "
        f"{args.num_requests} requests, first batch {args.first_tokens} tokens, timed {args.max_tokens} x "
        f"{args.rounds} rounds {args.variants}")
    if args.dry_run:
        return 0
    import torch  # noqa: F401 - before the fork of the compile processes

    if args.device == "cuda":
        try:  # Triton's compile processes forked before CUDA starts (scripts/gpu_h48_bar.py does the same)
            from pagedllm.worker import compile_pool

            if compile_pool.current() is None:
                compile_pool._pool = compile_pool.CompilePool(compile_pool._processes(), fork=True)
        except Exception as e:  # noqa: BLE001 - only slower
            say(f"# compile processes not forked: {e}")
    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams
    from pagedllm.structured_output import gate as gate_mod

    if args.gate_timeout is not None:
        gate_mod.GATE_TIMEOUT_S = args.gate_timeout
    if args.sync_at_launch is not None:
        gate_mod.SYNC_AT_LAUNCH_S = args.sync_at_launch
    if args.old_order:
        from pagedllm.engine.engine_core import EngineCore

        EngineCore._step_gated = gate_mod.step_gated_old_order  # the order before h52 (gate.py keeps it)
        say("# --old-order: the device wait is queued before the job is posted (pre-h52)")
    kwargs = dict(max_model_len=1024, seed=0, async_scheduling=True, max_num_seqs=MAX_NUM_SEQS)
    if args.model:
        kwargs.update(model=args.model, load_format="dummy")
    if args.device == "cpu":
        kwargs.update(num_gpu_blocks_override=64 * args.num_requests)
    else:
        kwargs.update(compilation_config={"cudagraph_capture_sizes": args.capture_sizes})
    t = time.perf_counter()
    llm = LLM(**kwargs)
    core = llm.llm_engine.engine_core
    manager = core.structured_output_manager
    runner = core.model_executor.driver_worker.model_runner
    tok = llm.get_tokenizer()
    if not core.gate_sampling:
        say("# gate_sampling is off in this engine (no async scheduling, or PAGEDLLM_GRAMMAR_GATE=0): nothing to check")
        return 2
    t_engine = time.perf_counter() - t
    backend = manager.backend()  # the grammar workers start here (their imports: seconds)
    watch = Watch(lambda: gate_state(core))
    watch.worker_pids = [p.pid for p in getattr(getattr(backend, "_workers", None), "procs", [])]
    say(f"# engine ready in {t_engine:.1f} s, grammar backend {type(backend).__name__} "
        f"({len(watch.worker_pids) or 'no'} workers, spin {getattr(backend, 'spin', None)}) in "
        f"{time.perf_counter() - t - t_engine:.1f} s; at {time.perf_counter() - T0:.0f} s")
    checker = Checker(manager, tok.eos_token_id)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"List users as JSON, batch {i}."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(args.num_requests)]
    sizes: list[int] = []
    gate_step = manager.gate_step

    def recorded(so):  # the gated steps' row counts: rows joining show as a rising count
        g = gate_step(so)
        if g is not None:
            sizes.append(len(g.request_ids))
        return g

    manager.gate_step = recorded
    results: list[dict] = []

    def run(label: str, variant: str, tokens: int, schemas: list[dict] | None, limit: float) -> dict | None:
        if time.perf_counter() - T0 > args.deadline:
            say(f"# {label}: past the deadline ({args.deadline:.0f} s), not run")
            return None
        manager._wait_gate_job()
        core.gate_sampling = variant != "main"
        params = [SamplingParams(temperature=0.8, max_tokens=tokens, ignore_eos=True,
                                 structured_outputs=None if schemas is None else StructuredOutputsParams(json=s))
                  for s in (schemas or [None] * args.num_requests)]
        runner.gate_waits.clear()
        sizes.clear()
        watch.start(label, limit)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        watch.stop()
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        r = {"run": label, "variant": variant, "tok_per_s": round(toks / dt, 1), "seconds": round(dt, 3),
             "tokens": toks, "gate_waits": dict(runner.gate_waits), "gated_steps": len(sizes),
             "distinct_gate_rows": len(set(sizes)), "aborted": sum(o.outputs[0].finish_reason == "abort" for o in outs)}
        if schemas is not None:
            r["valid"] = f"{checker.valid(outs, schemas)}/{len(outs)}"
        results.append(r)
        say(r)
        return r

    run("warm-up plain", "plain", 32, None, args.run_timeout)
    distinct = [schema(i) for i in range(args.num_requests)]
    first = run("first constrained batch (distinct schemas, gated)", "gated", args.first_tokens, distinct,
                args.first_timeout)
    if first is not None:
        say(f"# first constrained batch ended: {first['gated_steps']} gated steps, {first['distinct_gate_rows']} "
            f"distinct row counts (rows joining), valid {first['valid']}")
        say({"state after the first batch": gate_state(core)})  # what the watchdog prints on a hang
    one = [schema(None)] * args.num_requests
    if "main" in args.variants:
        run("warm-up main", "main", 32, one, args.run_timeout)
    for rnd in range(1, args.rounds + 1):
        for variant in args.variants:
            run(f"round {rnd} {variant}", variant, args.max_tokens, None if variant == "plain" else one, args.run_timeout)
    say("\n| run | tok/s | schema / plain (its round) | s | gated steps | valid | aborted |")
    say("|---|---|---|---|---|---|---|")
    for r in results:
        rnd = r["run"].split()[1] if r["run"].startswith("round") else None
        plain = next((x["tok_per_s"] for x in results if x["run"] == f"round {rnd} plain"), None) if rnd else None
        ratio = f"{r['tok_per_s'] / plain:.3f}" if plain and r["variant"] != "plain" else ""
        say(f"| {r['run']} | {r['tok_per_s']:,.0f} | {ratio} | {r['seconds']:.2f} | {r['gated_steps']} | "
            f"{r.get('valid', '')} | {r['aborted']} |")
    manager._wait_gate_job()
    llm.llm_engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
