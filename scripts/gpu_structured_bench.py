"""Cost of constrained decoding: decode throughput of N concurrent requests that all follow a JSON
schema, against the same requests unconstrained, in one process (and vLLM's xgrammar path the same
way with --vllm, when vLLM is importable).

    # here (needs gguf): a model folder with Qwen3-0.6B's shape and SmolLM2's real tokenizer
    python scripts/gpu_structured_bench.py --prepare bench_model
    # on the GPU machine (carry bench_model/ and the xgrammar wheel; see BENCHMARKS.md)
    python3 scripts/gpu_structured_bench.py --model bench_model [--vllm]
    # on this CPU: the embedded SmolLM2 at 16 requests
    python scripts/gpu_structured_bench.py --device cpu --num-requests 16 --max-tokens 48

Every request generates exactly --max-tokens tokens (ignore_eos, and a schema that cannot end
sooner: an array with minItems far beyond max_tokens), so both runs decode the same batch sizes.
Each engine runs in its own child process (the parent touches no device), plain and schema runs
alternating, the best of each kept. Every schema output is checked: its tokens are accepted by a
fresh xgrammar matcher of the schema (no whitespace bound, so vLLM's outputs are held to the same
language), and its complete records parse and validate. pagedllm's runs also report the bitmask
job's mean time a step and how long the step loop waited for it. One JSON line per run; a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run as scripts/gpu_structured_bench.py: pagedllm from this tree
VLLM_SITE = "/tmp/site"  # where the GPU machine keeps vLLM 0.21 (PYTHONPATH for its child only)
CHILD_TIMEOUT_S = {"pagedllm": 120, "vllm": 140}  # this branch's round: 39 s for 3 variants x 2 rounds
# An array of records: objects with a string, an integer, an enum and a list, as API outputs look.
SCHEMA = {
    "type": "array",
    "minItems": 10000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": False,
    },
}


def prepare(folder: str) -> None:
    """Qwen3-0.6B's config (vocabulary cut to the tokenizer's 49,152) + SmolLM2's tokenizer from the GGUF."""
    from transformers import AutoTokenizer

    from pagedllm.loader import default_model_path

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(folder)
    here = os.path.dirname(os.path.abspath(__file__))
    cfg_path = os.path.join(here, "..", "pagedllm", "model_configs", "qwen3-0.6b", "config.json")
    cfg = json.load(open(cfg_path))
    cfg.update(vocab_size=49152, bos_token_id=1, eos_token_id=2)
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"), indent=1)
    print(f"wrote {folder}: tokenizer + config (carry it to the GPU machine)")


def prompts(tokenizer, n: int) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"List users as JSON, batch {i}."}],
                                          tokenize=False, add_generation_prompt=True) for i in range(n)]


def text_length(text: str) -> int:
    """A string's length as the grammar counts it: code points of its bytes. Bytes that strict UTF-8
    decoding refuses (xgrammar's byte-level matcher accepts some of them) arrive as U+FFFD, one per
    byte, so they are not counted (a lower bound; the token check above is the exact one): round 2 on
    the H200 had a tag Python counts as 10 characters, 3 of them U+FFFD ('},Cam值 ' + 3), in an output
    whose every token a fresh matcher accepted."""
    return len(text.replace("\ufffd", ""))


def check_record(rec) -> str | None:
    """What is wrong with one record of SCHEMA's array, or None."""
    if not isinstance(rec, dict) or set(rec) != {"name", "age", "role", "tags"}:
        return f"keys {sorted(rec) if isinstance(rec, dict) else type(rec).__name__}"
    if not isinstance(rec["name"], str) or text_length(rec["name"]) > 16:
        return f"name {rec['name']!r}"
    if type(rec["age"]) is not int or not 0 <= rec["age"] <= 120:
        return f"age {rec['age']!r}"
    if rec["role"] not in ("admin", "user", "guest"):
        return f"role {rec['role']!r}"
    tags = rec["tags"]
    if not isinstance(tags, list) or len(tags) > 3 or any(not isinstance(t, str) or text_length(t) > 8 for t in tags):
        return f"tags {tags!r}"
    return None


class OutputChecker:
    """Schema outputs cut at max_tokens: every token must be allowed by the schema's grammar, and
    the complete records (the text up to the last '}' that closes one) must validate (a short
    output may hold none yet)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)

    def problem(self, text: str, token_ids: list[int]) -> str | None:
        matcher = self.xgr.GrammarMatcher(self.grammar)
        for i, t in enumerate(token_ids):
            if not matcher.accept_token(t):
                return f"token {i} ({t}) not allowed by the schema"
        end = len(text)
        while (end := text.rfind("}", 0, end)) > 0:
            try:
                records = json.loads(text[: end + 1] + "]")
            except json.JSONDecodeError:
                continue
            bad = [p for p in map(check_record, records) if p]
            return f"record {bad[0]}" if bad else None
        return None


def model_vocab_size(args) -> int | None:
    """The logits' width from the model folder's config (the same for both engines)."""
    return json.load(open(os.path.join(args.model, "config.json")))["vocab_size"] if args.model else None


def check_outputs(checker: OutputChecker, outs) -> int:
    problems = [(i, p) for i, o in enumerate(outs)
                if (p := checker.problem(o.outputs[0].text, list(o.outputs[0].token_ids)))]
    assert not problems, f"{len(problems)} of {len(outs)} outputs invalid, first: {problems[0]}"
    return len(outs)


def time_bitmask_job(llm) -> dict:
    """Time the structured-output manager's parts (this script's instrumentation only): prepare
    (advance + rows, in the step loop), fill (on the bitmask thread under async scheduling) and how
    long the step loop then waited for the fill."""
    core = llm.llm_engine.engine_core
    manager = core.structured_output_manager
    stats = {"prepare_s": 0.0, "fill_s": 0.0, "wait_s": 0.0, "submit_s": 0.0, "accept_s": 0.0, "steps": 0, "jobs": 0}
    prepare, sample = manager._prepare, core._sample_deferred

    def timed(fn, key):
        def run(*a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                stats[key] += time.perf_counter() - t
                stats["steps"] += key == "prepare_s"
                stats["loop_steps"] = stats.get("loop_steps", 0) + (key == "step_s")
        return run

    def timed_prepare(so):  # (fill, output) | None; the fill (a call with no arguments) timed too
        job = timed(prepare, "prepare_s")(so)
        if job is None or hasattr(job[0], "send"):  # the grammar worker times its own job (worker_stats)
            return job
        return timed(job[0], "fill_s"), job[1]

    def timed_sample():
        fut = core.deferred_sample[1]
        t = time.perf_counter()
        fut.result()
        stats["wait_s"] += time.perf_counter() - t
        stats["jobs"] += 1
        sample()

    manager._prepare = timed_prepare
    backend = manager.backend()  # the batch accept inside prepare (xgrammar's C++ and its list of handles)
    backend.accept_tokens_batch = timed(backend.accept_tokens_batch, "accept_s")
    stats["_time_accept"] = lambda fn: timed(fn, "accept_s")  # for the backends of the A/B variants
    core._sample_deferred = timed_sample
    # The step loop's parts, every run (plain too): where the host time of a step goes.
    ex, out = core.model_executor, llm.llm_engine.output_processor
    for obj, name in ((core.scheduler, "schedule"), (ex, "execute_model"), (ex, "sample_tokens"),
                      (core, "_collect_inflight"), (out, "process_outputs"), (core, "step")):
        stats[name + "_s"] = 0.0
        setattr(obj, name, timed(getattr(obj, name), name + "_s"))
    return stats


LOOP_PARTS = ("step", "schedule", "execute_model", "sample_tokens", "_collect_inflight", "process_outputs")


def run_pagedllm(args) -> list[dict]:
    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams

    kwargs = dict(max_model_len=1024, seed=0)
    if args.model:
        kwargs.update(model=args.model, load_format="dummy")
    if args.device == "cpu":
        kwargs.update(num_gpu_blocks_override=64 * args.num_requests)
    if args.async_scheduling:
        kwargs.update(async_scheduling=True)  # the CPU's default is off
    llm = LLM(**kwargs)
    ps = prompts(llm.get_tokenizer(), args.num_requests)
    checker = OutputChecker(llm.get_tokenizer(), model_vocab_size(args) or llm.llm_engine.config.model_config.vocab_size)
    stats = time_bitmask_job(llm)
    manager = llm.llm_engine.engine_core.structured_output_manager
    submit = manager.submit_grammar_bitmask

    def threaded(so):  # prepare + the hand-off to the bitmask thread (until it is inside the fill)
        t = time.perf_counter()
        try:
            return submit(so)
        finally:
            stats["submit_s"] += time.perf_counter() - t

    def inline(so):  # the A/B variant: the fill in the step loop, as before the bitmask thread
        from concurrent.futures import Future

        done = Future()
        done.set_result(manager.grammar_bitmask(so))
        return done

    results = []
    variants = ("plain", "schema", "schema, job before the launch")
    if args.ab_inline:  # round 2 on the H200: 0.718 / 0.801 against the thread's 0.744 / 0.830
        variants += ("schema, fill in the step loop",)
    # Other backends in the same engine (swapped between runs, when no request is in flight).
    default_backend = manager.backend()
    cfg = llm.llm_engine.config
    others = {}
    if args.ab_thread and getattr(default_backend, "remote", False):
        others["schema, bitmask thread"] = dict(worker=False)
    if args.worker_threads:
        others[f"schema, grammar worker with {args.worker_threads} xgrammar threads"] = dict(
            worker=True, threads=args.worker_threads)
    if args.workers:
        n, t = args.workers
        others[f"schema, {n} grammar workers x {t} xgrammar threads"] = dict(worker=True, num_workers=n, threads=t)
    built = {}
    built_failed: set[str] = set()

    def use_backend(variant):
        from pagedllm.structured_output.manager import make_backend

        if variant in others and variant not in built:
            backend = make_backend(llm.get_tokenizer(), cfg.model_config.vocab_size,
                                   rows=cfg.scheduler_config.max_num_seqs,
                                   pin_memory=cfg.device_config.device == "cuda", **others[variant])
            if others[variant]["worker"] and not getattr(backend, "remote", False):
                print(f"# {variant}: the grammar worker did not start (the warning above); variant skipped", flush=True)
                others.pop(variant)
                return False
            backend.accept_tokens_batch = time_accept(backend.accept_tokens_batch)
            built[variant] = backend
        backend = built.get(variant, default_backend)
        if manager._backend is not backend:
            manager._backend, manager._remote = backend, getattr(backend, "remote", False)
            manager._bitmasks, manager._bitmask_views = [], []
        return True
    time_accept = stats.pop("_time_accept")
    threads = os.environ.get("PAGEDLLM_XGRAMMAR_THREADS")
    engine = f"pagedllm, {threads} xgrammar threads" if threads else "pagedllm"
    if getattr(manager.backend(), "remote", False):
        engine += " (grammar worker process)"
    elif llm.llm_engine.engine_core.async_scheduling:
        engine += " (bitmask thread)"
    if threads or os.environ.get("PAGEDLLM_GRAMMAR_WORKER") == "0" or not llm.llm_engine.engine_core.async_scheduling:
        variants = variants[:2]  # the A/B once; without async scheduling the fill is in the loop anyway
    variants += tuple(others)
    # One full-size run of each first: the first plain run after start was 25% slower on the H200.
    for so in (None, StructuredOutputsParams(json=SCHEMA)):
        llm.generate(ps, SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True,
                                        structured_outputs=so), use_tqdm=False)

    def run_variant(variant):
        if variant in built_failed:  # a worker that did not start: not measured again
            return
        if not use_backend(variant):
            built_failed.add(variant)
            return
        constrained = variant != "plain"
        manager.submit_grammar_bitmask = inline if variant.endswith("loop") else threaded
        # The A/B of engine_core's order: the bitmask job submitted before this step's launch.
        llm.llm_engine.engine_core.submit_before_launch = variant.endswith("launch")
        so = StructuredOutputsParams(json=SCHEMA) if constrained else None
        sp = SamplingParams(temperature=0.8, seed=None, max_tokens=args.max_tokens, ignore_eos=True,
                            structured_outputs=so)
        llm.generate(ps[:2], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)  # compile, warm
        stats.update(prepare_s=0.0, fill_s=0.0, wait_s=0.0, submit_s=0.0, accept_s=0.0, steps=0, jobs=0, loop_steps=0,
                     **{p + "_s": 0.0 for p in LOOP_PARTS})
        worker = getattr(manager.backend(), "stats", None)  # the grammar worker process's own times
        if worker is not None:
            worker.update(steps=0, jobs=0, accept_s=0.0, fill_s=0.0, wake_s=0.0, back_s=0.0)
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        assert toks == args.num_requests * args.max_tokens, toks
        results.append({"engine": engine, "variant": variant, "constrained": constrained,
                        "requests": args.num_requests,
                        "output_tokens": toks, "seconds": round(dt, 3), "tok_per_s": round(toks / dt, 1)})
        loop_steps = max(stats["loop_steps"], 1)  # core.step calls (each part's ms below is per call)
        results[-1]["loop_ms"] = {p: round(1e3 * stats[p + "_s"] / loop_steps, 3) for p in LOOP_PARTS}
        if constrained:
            results[-1]["valid_outputs"] = check_outputs(checker, outs)
            steps = max(stats["steps"], 1)  # constrained steps; deferred ones only under async scheduling
            results[-1].update({k.replace("_s", "_ms"): round(1e3 * stats[k] / steps, 3)
                                for k in ("prepare_s", "accept_s", "submit_s", "fill_s", "wait_s")}, steps=stats["steps"],
                               deferred_steps=stats["jobs"], step_ms=round(1e3 * dt / steps, 3))
            if manager._bitmasks:
                results[-1]["bitmask_pinned"] = manager._bitmasks[0].is_pinned()
            if worker is not None and worker["jobs"]:  # accept + fill inside the grammar worker(s), a job each
                results[-1].update({f"worker_{k[:-2]}_ms": round(1e3 * worker[k] / worker["jobs"], 3)
                                    for k in ("wake_s", "accept_s", "fill_s", "back_s")})
        print(json.dumps(results[-1]), flush=True)

    try:
        for variant in variants * args.rounds:
            run_variant(variant)
    finally:
        use_backend("plain")  # the engine's own backend again, which its shutdown ends
        for backend in built.values():
            backend.shutdown()
    return results


def run_vllm(args) -> list[dict]:
    from vllm import LLM, SamplingParams

    try:
        from vllm.sampling_params import StructuredOutputsParams
        so_kw = lambda: {"structured_outputs": StructuredOutputsParams(json=SCHEMA)}  # noqa: E731
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams
        so_kw = lambda: {"guided_decoding": GuidedDecodingParams(json=SCHEMA)}  # noqa: E731
    kwargs = {}
    try:  # xgrammar, as ours (vLLM's "auto" picks it too, but says so only in its logs)
        from vllm.config import StructuredOutputsConfig

        kwargs["structured_outputs_config"] = StructuredOutputsConfig(backend="xgrammar")
    except ImportError:
        pass
    llm = LLM(model=args.model, load_format="dummy", max_model_len=1024, seed=0, gpu_memory_utilization=0.8,
              **kwargs)
    ps = prompts(llm.get_tokenizer(), args.num_requests)
    checker = OutputChecker(llm.get_tokenizer(), model_vocab_size(args))
    for extra in ({}, so_kw()):  # one full-size run of each first, as for ours
        llm.generate(ps, SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True, **extra),
                     use_tqdm=False)
    results = []
    for constrained in (False, True) * args.rounds:
        extra = so_kw() if constrained else {}
        sp = SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True, **extra)
        llm.generate(ps[:2], SamplingParams(max_tokens=4, **extra), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        results.append({"engine": "vllm", "constrained": constrained, "requests": args.num_requests,
                        "output_tokens": toks, "seconds": round(dt, 3), "tok_per_s": round(toks / dt, 1)})
        if constrained:
            results[-1]["valid_outputs"] = check_outputs(checker, outs)
        print(json.dumps(results[-1]), flush=True)
    return results


def table(results: list[dict]) -> None:
    print("\n| engine | variant | requests | unconstrained tok/s | JSON schema tok/s | schema / plain (best) | "
          "median of pairs | valid schema outputs |")
    print("|---|---|---|---|---|---|---|---|")
    for engine in dict.fromkeys(r["engine"] for r in results):
        runs = [r for r in results if r["engine"] == engine]
        plain = max((r["tok_per_s"] for r in runs if not r["constrained"]), default=0)
        for variant in dict.fromkeys(r.get("variant", "schema") for r in runs if r["constrained"]):
            ratios, last_plain, schema = [], None, []
            for r in runs:  # each schema run over the plain run before it
                if not r["constrained"]:
                    last_plain = r["tok_per_s"]
                elif r.get("variant", "schema") == variant:
                    schema.append(r)
                    if last_plain:
                        ratios.append(r["tok_per_s"] / last_plain)
            if not schema or not plain:
                continue
            best = max(r["tok_per_s"] for r in schema)
            valid = "/".join(str(r.get("valid_outputs", "-")) for r in schema)
            median = sorted(ratios)[len(ratios) // 2] if ratios else float("nan")
            print(f"| {engine} | {variant} | {schema[0]['requests']} | {plain:,.0f} | {best:,.0f} | {best / plain:.3f} "
                  f"| {median:.3f} | {valid} |")


def run_child(engine: str, args, xgrammar_threads: int | None = None) -> list[dict]:
    """One engine in its own process: each starts on a free device and gives all of it back.
    xgrammar_threads: pagedllm with PAGEDLLM_XGRAMMAR_THREADS set (a row of its own in the table)."""
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--child", engine, "--device", args.device,
           "--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens), "--rounds", str(args.rounds)]
    if args.async_scheduling:
        cmd.append("--async-scheduling")
    if args.ab_inline:
        cmd.append("--ab-inline")
    if args.ab_thread:
        cmd.append("--ab-thread")
    if args.worker_threads:
        cmd += ["--worker-threads", str(args.worker_threads)]
    if args.workers:
        cmd += ["--workers", *map(str, args.workers)]
    if args.model:
        cmd += ["--model", args.model]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    paths = [REPO] + ([VLLM_SITE] if engine == "vllm" and os.path.isdir(VLLM_SITE) else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if engine == "vllm":
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"  # as scripts/gpu_bench.sh runs vLLM there
    if xgrammar_threads:
        env["PAGEDLLM_XGRAMMAR_THREADS"] = str(xgrammar_threads)
    limit = CHILD_TIMEOUT_S[engine] if args.device == "cuda" else None  # a loaded CPU takes what it takes
    if args.child_timeout:
        limit = args.child_timeout
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False, env=env, timeout=limit)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        proc = subprocess.CompletedProcess(cmd, f"timeout after {limit} s", out)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for line in proc.stdout.splitlines():
        print(line, flush=True)
    print(f"# {engine}: exit {proc.returncode}, {time.perf_counter() - t:.0f} s", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", metavar="DIR", help="write the model folder and exit")
    ap.add_argument("--model", help="a folder from --prepare (dummy weights); default: the embedded SmolLM2")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="plain/schema pairs per engine (default 2)")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM (in a second process, after ours)")
    ap.add_argument("--xgrammar-threads", type=int, help="also run pagedllm with this many xgrammar threads")
    ap.add_argument("--async-scheduling", action="store_true", help="pagedllm: async scheduling on the CPU too")
    ap.add_argument("--ab-inline", action="store_true", help="pagedllm: also the fill in the step loop (an A/B)")
    ap.add_argument("--ab-thread", action="store_true",
                    help="pagedllm: also the bitmask thread instead of the grammar worker process (same engine)")
    ap.add_argument("--worker-threads", type=int,
                    help="pagedllm: also a grammar worker with this many xgrammar threads (same engine)")
    ap.add_argument("--workers", type=int, nargs=2, metavar=("N", "THREADS"),
                    help="pagedllm: also N grammar workers of THREADS xgrammar threads each (same engine)")
    ap.add_argument("--child-timeout", type=int, help="seconds each child may run (default: per engine)")
    ap.add_argument("--child", choices=["pagedllm", "vllm"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    if args.child:
        (run_vllm if args.child == "vllm" else run_pagedllm)(args)
        return
    results = run_child("pagedllm", args)
    if args.xgrammar_threads:
        results += run_child("pagedllm", args, args.xgrammar_threads)
    if args.vllm:
        results += run_child("vllm", args)
    if results:
        table(results)
    sys.exit(0 if results else 1)


if __name__ == "__main__":
    main()
