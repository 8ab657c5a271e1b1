"""Host cost of structured outputs without a model: the real engine loop (scheduler, engine core,
grammar manager, bitmask thread, output processing) with an executor whose "device" returns at
once, 64 requests with a JSON schema against 64 plain ones, async scheduling on as on a GPU.

    PYTHONPATH=$PWD python scripts/structured_host_cost.py [--num-requests 64 --max-tokens 96 --rounds 3]

Every request, plain or constrained, emits the tokens of one valid document of the schema
(DocumentExecutor below), so both runs carry the same tokens and only the constraint's machinery
differs; each constrained token is checked against its bitmask row (none may be refused). The
executor's own time ("device_sample": the check) is left out of the host figures. Per step
(steady state: the first and last steps of a run are dropped) it reports the engine step's host
time split by phase, wall and the step loop thread's CPU time, and the extra host time of a schema
step over a plain one; the runs alternate so the machine's load hits both alike.
Python function calls per step (sys.setprofile; independent of load) are counted in one more run
of each kind. The table is printed last.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import numpy as np

from pagedllm.benchmarks.null_executor import NullExecutor, _Done
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.structured_output.bitmask import GrammarOutput
from pagedllm.structured_output.gate import host_wait

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from scripts.gpu_structured_bench import SCHEMA  # noqa: E402  (the GPU benchmark's schema)


def schema_document(n_records: int = 200) -> str:
    """A valid prefix of SCHEMA's array, long enough for any run here: the tokens every request emits."""
    roles = ("admin", "user", "guest")
    return "[" + ", ".join(json.dumps({"name": f"user {i:04d}", "age": (i * 37) % 121, "role": roles[i % 3],
                                       "tags": ["t" * (1 + i % 5), "x" + str(i % 97)][: i % 3]})
                           for i in range(n_records))


class DocumentExecutor(NullExecutor):
    """NullExecutor whose requests all emit the tokens of `schema_document` (plain and schema runs
    alike: the same tokens, so only the constraint's machinery differs). A constrained row's token
    is checked against its bitmask row (`refused` counts the ones it forbids: must stay 0)."""

    doc: list[int] = []
    refused = 0
    checked = 0
    check = True
    spent: dict[str, float] = {}  # instrument()'s: a gated step's wait for its gate counts as "wait"
    shares_scheduler_output = True  # the engine core may gate its constrained steps (--gate)

    def _init_executor(self) -> None:
        super()._init_executor()
        self._prompt_len: dict[str, int] = {}

    def execute_model(self, scheduler_output):
        so = scheduler_output
        computed = {}
        for r in so.scheduled_new_reqs:
            self._prompt_len[r.req_id] = r.num_prompt_tokens
            computed[r.req_id] = r.num_computed_tokens
        computed.update((r.req_id, r.num_computed_tokens) for r in so.scheduled_cached_reqs)
        req_ids = list(so.num_scheduled_tokens)
        doc, plen = self.doc, self._prompt_len
        sampled = [doc[(computed[r] + so.num_scheduled_tokens[r] - plen[r]) % len(doc)] for r in req_ids]
        output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
        if so.grammar_gate is not None:  # gated sampling: "sampled" once the gate is open
            return _Gated(self, output, so.grammar_gate)
        if so.has_structured_output_requests:
            self._deferred = output
            return None
        return _Done(output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> _Done:
        output, self._deferred = self._deferred, None
        assert output is not None
        if grammar_output is not None:
            self.check_rows(output, grammar_output.structured_output_request_ids, grammar_output.grammar_bitmask)
        return _Done(output)

    def check_rows(self, output: ModelRunnerOutput, ids: list[str], bitmask) -> None:
        if not self.check:
            return
        row_of = {rid: i for i, rid in enumerate(output.req_ids)}
        toks = np.array([output.sampled_token_ids[row_of[r]] for r in ids])
        mask = bitmask.numpy().view(np.uint32)  # (k, W)
        ok = (mask[np.arange(len(ids)), toks >> 5] >> (toks & 31).astype(np.uint32)) & 1
        type(self).refused += int(len(ids) - ok.sum())
        type(self).checked += len(ids)


class _Gated:
    """A gated step's handle (structured_output/gate.py): get() waits for the gate, as the device
    would, then checks the rows against the bitmask the filler wrote. The wait counts as the
    executor's own time (device_sample), not the host's."""

    def __init__(self, executor: DocumentExecutor, output: ModelRunnerOutput, gate) -> None:
        self.executor, self.output, self.gate, self.done = executor, output, gate, False

    def get(self) -> ModelRunnerOutput:
        if not self.done:
            self.done = True
            t = time.perf_counter()
            host_wait(self.gate)
            self.executor.spent["wait"] += time.perf_counter() - t
            self.executor.check_rows(self.output, self.gate.request_ids, self.gate.bitmask)
        return self.output


PHASES = ("schedule", "execute_model", "device_sample", "collect", "advance", "prepare", "submit", "wait",
          "process_outputs")


def instrument(llm) -> dict[str, float]:
    """Wrap the loop's parts; returns the dict they add their seconds to (reset per step)."""
    engine = llm.llm_engine
    core = engine.engine_core
    manager = core.structured_output_manager
    spent: dict[str, float] = defaultdict(float)

    def timed(obj, name, key):
        fn = getattr(obj, name, None)
        if fn is None:
            return

        def run(*a, **kw):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t
                spent[key + "_cpu"] += time.thread_time() - c
        setattr(obj, name, run)

    ex = core.model_executor
    ex.spent = spent
    timed(core.scheduler, "schedule", "schedule")
    timed(ex, "execute_model", "execute_model")
    timed(ex, "sample_tokens", "device_sample")
    timed(core, "_collect_inflight", "collect")
    timed(manager, "advance", "advance")
    timed(manager, "_prepare", "prepare")
    timed(manager, "submit_grammar_bitmask", "submit")
    timed(manager, "gate_step", "prepare")  # gated sampling: its rows and bitmask, before the launch
    timed(manager, "submit_gate", "submit")  # and its job, after the collect (accept + hand-off)
    timed(engine.output_processor, "process_outputs", "process_outputs")
    sample = core._sample_deferred

    def timed_sample():  # the wait for the bitmask job, apart from the sampling call itself
        t = time.perf_counter()
        job = core.deferred_sample[1]
        job.result()
        spent["wait"] += time.perf_counter() - t
        sample()
    core._sample_deferred = timed_sample
    return spent


def run_once(llm, prompts, params, spent) -> dict[str, list[float]]:
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    rows: dict[str, list[float]] = defaultdict(list)
    n = 0
    while engine.has_unfinished_requests():
        spent.clear()
        c = time.thread_time()
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        cpu = time.thread_time() - c
        n += 1
        rows["step"].append(total)
        rows["loop_cpu"].append(cpu - spent.get("device_sample_cpu", 0.0))
        for k in PHASES:
            rows[k].append(spent.get(k, 0.0))
            rows[k + "_cpu"].append(spent.get(k + "_cpu", 0.0))
    # Steady state: drop the prefill and ramp (first 4 steps) and the drain (last 2).
    return {k: v[4:-2] for k, v in rows.items()}


def count_calls(llm, prompts, params) -> float:
    """Python function calls per engine step (C calls not counted), one run."""
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"c{time.monotonic_ns()}-{i}", p, params)
    calls = 0
    steps = 0
    device = DocumentExecutor.sample_tokens.__code__
    inside = False

    def prof(frame, event, arg):  # the "device"'s own calls are not the host's
        nonlocal calls, inside
        if frame.f_code is device:
            inside = event == "call"
        elif event == "call" and not inside:
            calls += 1
    while engine.has_unfinished_requests():
        sys.setprofile(prof)
        engine.step()
        sys.setprofile(None)
        steps += 1
    return calls / max(steps, 1)


def manager_only(args) -> None:
    """The grammar manager alone, 64 requests of SCHEMA fed the document's tokens one step at a time:
    advance, prepare (the batch accept and the row pick) and the bitmask job's round trip with
    xgrammar's fill made a no-op (the hand-off to the thread and back alone) or real; min and median
    per step, so a loaded machine still gives a floor."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from pagedllm.core.sched_output import EngineCoreOutput
    from pagedllm.loader import default_model_path
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
    from pagedllm.structured_output.manager import StructuredOutputManager, make_backend

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    doc = tok.encode(schema_document(), add_special_tokens=False)
    rids = [f"r{i}" for i in range(args.num_requests)]
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=len(rids)),
                             device_config=SimpleNamespace(device="cpu"))
    backend = make_backend(tok, 49152)
    results = {}
    for fill in ("no-op fill", "xgrammar fill"):
        manager = StructuredOutputManager(config)
        manager._backend = backend
        if fill == "no-op fill":  # the same backend, its fill (both spellings: older trees) doing nothing
            manager._backend = copy.copy(backend)
            manager._backend.fill_job = lambda grammars, bitmask: (lambda: None)
            manager._backend.fill_bitmasks = lambda grammars, bitmask, rows: None
        params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
        for r in rids:
            manager.add_request(SimpleNamespace(request_id=r, sampling_params=params)).future.result()
        so = SimpleNamespace(num_scheduled_tokens=dict.fromkeys(rids, 1), sampling_req_ids=set(rids))
        times: dict[str, list[float]] = defaultdict(list)
        prepare = manager._prepare

        def timed_prepare(step_so, prepare=prepare, times=times):
            t = time.perf_counter()
            try:
                return prepare(step_so)
            finally:
                times["prepare"].append(time.perf_counter() - t)
        manager._prepare = timed_prepare
        manager.submit_grammar_bitmask(so).result()  # the first (prefill) step's rows
        for j in range(min(args.max_tokens * 4, len(doc))):
            outs = [EngineCoreOutput(r, [doc[j]]) for r in rids]
            t0 = time.perf_counter()
            manager.advance(outs)
            t1 = time.perf_counter()
            job = manager.submit_grammar_bitmask(so)
            t2 = time.perf_counter()
            job.result()
            t3 = time.perf_counter()
            times["advance"].append(t1 - t0)
            times["submit"].append(t2 - t1)
            times["result"].append(t3 - t2)
        manager.shutdown()
        results[fill] = {k: (min(v) * 1e3, statistics.median(v) * 1e3) for k, v in times.items()}
    print(f"\nthe grammar manager alone, {len(rids)} requests, ms a step: min / median")
    print("| part | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for part in ("advance", "prepare", "submit", "result"):
        print(f"| {part} | " + " | ".join(f"{r[part][0]:.3f} / {r[part][1]:.3f}" for r in results.values()) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--detokenize", action="store_true",
                    help="detokenize too (off: the two runs' different tokens would cost differently)")
    ap.add_argument("--inline", action="store_true", help="also run the schema with its fill in the step loop")
    ap.add_argument("--before-launch", action="store_true",
                    help="also run the schema with its bitmask job submitted before the step's launch")
    ap.add_argument("--no-fill", action="store_true",
                    help="diagnostic: skip xgrammar's fill (all tokens allowed), to see what else a schema step costs")
    ap.add_argument("--manager", action="store_true", help="time the grammar manager alone (no engine)")
    ap.add_argument("--no-calls", action="store_true", help="skip the sys.setprofile call count")
    ap.add_argument("--gate", action="store_true", help="also the schema with gated sampling (gate.py)")
    ap.add_argument("--accept-on-thread", action="store_true",
                    help="with --gate: also the gated schema with the batch accept on the bitmask thread")
    args = ap.parse_args()
    if args.manager:
        manager_only(args)
        return

    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams

    llm = LLM(device="cpu", max_model_len=1024, num_gpu_blocks_override=64 * args.num_requests,
              async_scheduling=True, distributed_executor_backend="__main__.DocumentExecutor")
    tok = llm.get_tokenizer()
    DocumentExecutor.doc = tok.encode(schema_document(), add_special_tokens=False)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"List users as JSON, batch {i}."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(args.num_requests)]
    spent = instrument(llm)
    kinds = {
        "plain": SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True,
                                detokenize=args.detokenize),
        "schema": SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True,
                                 detokenize=args.detokenize, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    }
    manager = llm.llm_engine.engine_core.structured_output_manager
    threaded = manager.submit_grammar_bitmask

    class Inline:  # the control: the fill in the step loop, nothing beside it
        def __init__(self, so):
            self.output = manager.grammar_bitmask(so)

        def result(self):
            return self.output
    if args.inline:
        kinds["schema, fill in the loop"] = kinds["schema"]
    if args.before_launch:
        kinds["schema, job before the launch"] = kinds["schema"]
    if args.gate:
        kinds["schema, gated"] = kinds["schema"]
        if args.accept_on_thread:
            kinds["schema, gated, accept on the thread"] = kinds["schema"]
    if args.no_fill:  # a diagnostic: everything but xgrammar's fill (the bitmask stays all ones)
        backend = manager.backend()
        backend.fill_job = lambda grammars, bitmask: (lambda: None)
        backend.fill_bitmasks = lambda grammars, bitmask, rows: None  # older trees call this one
        DocumentExecutor.check = False
    def configure(kind: str) -> None:
        manager.submit_grammar_bitmask = Inline if kind.endswith("loop") else threaded
        llm.llm_engine.engine_core.submit_before_launch = kind.endswith("launch")
        llm.llm_engine.engine_core.gate_sampling = "gated" in kind
        manager.accept_on_thread = kind.endswith("thread")

    for kind, params in kinds.items():  # warm-up: compile the grammar, touch every path
        configure(kind)
        run_once(llm, prompts, params, spent)
    per_run: dict[str, list[dict[str, float]]] = defaultdict(list)
    for r in range(args.rounds):
        for kind, params in kinds.items():
            configure(kind)
            rows = run_once(llm, prompts, params, spent)
            med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
            med["host"] = statistics.median([s - d for s, d in zip(rows["step"], rows["device_sample"], strict=True)]) * 1e3
            per_run[kind].append(med)
            print(f"round {r} {kind}: " + " ".join(f"{k}={v:.3f}" for k, v in med.items()), flush=True)
    calls = {}
    for kind in ([] if args.no_calls else kinds):
        configure(kind)
        calls[kind] = count_calls(llm, prompts, kinds[kind])
    configure("plain")

    def mid(kind, key):
        return statistics.median(m[key] for m in per_run[kind])
    extra = [s["host"] - p["host"] for s, p in zip(per_run["schema"], per_run["plain"], strict=True)]
    ratio = [s["host"] / p["host"] for s, p in zip(per_run["schema"], per_run["plain"], strict=True)]
    print(f"\n{args.num_requests} requests x {args.max_tokens} tokens, async scheduling, null device, "
          f"PAGEDLLM_XGRAMMAR_THREADS={os.environ.get('PAGEDLLM_XGRAMMAR_THREADS', 'default')}; "
          f"per step, medians over {args.rounds} rounds of each run's median (ms)")
    others = [k for k in kinds if k != "plain"]
    print("| phase (wall; CPU: the step loop's thread) | plain | " + " | ".join(others) + " | plain CPU | "
          + " | ".join(f"{k} CPU" for k in others) + " |")
    print("|---" * (2 + 2 * len(others)) + "|---|")
    for key in ("host", "loop_cpu", "step", *PHASES):
        p = mid("plain", key)
        cells = f"| {key} | {p:.3f} | " + " | ".join(f"{mid(k, key):.3f} ({mid(k, key) - p:+.3f})" for k in others)
        if key in PHASES:
            pc = mid("plain", key + "_cpu")
            cells += f" | {pc:.3f} | " + " | ".join(f"{mid(k, key + '_cpu'):.3f} ({mid(k, key + '_cpu') - pc:+.3f})"
                                                    for k in others)
        print(cells + " |")
    cpu_extra = [s["loop_cpu"] - p["loop_cpu"] for s, p in zip(per_run["schema"], per_run["plain"], strict=True)]
    print(f"| extra step-loop CPU time a step, per round | | | {', '.join(f'{e:+.3f}' for e in cpu_extra)} |")
    print(f"| extra host time a step, per round | | | {', '.join(f'{e:+.3f}' for e in extra)} |")
    print(f"| host time schema / plain, per round | | | {', '.join(f'{x:.3f}' for x in ratio)} |")
    print(f"| constrained tokens checked against their bitmask row | | {DocumentExecutor.checked} "
          f"({DocumentExecutor.refused} refused) |")
    assert DocumentExecutor.refused == 0, "a token the grammar allows was refused by its bitmask"
    stats = getattr(manager.backend(), "stats", None)  # the grammar worker's own times, all runs
    if stats and stats["jobs"]:
        print("| grammar worker, ms a job: hand-over there / accept / fill / reply back | | "
              + " / ".join(f"{1e3 * stats[k] / stats['jobs']:.3f}" for k in ("wake_s", "accept_s", "fill_s", "back_s"))
              + " |")
    if calls:
        print(f"| Python calls a step | {calls['plain']:.0f} | "
              + " | ".join(f"{calls[k]:.0f} ({calls[k] - calls['plain']:+.0f})" for k in others) + " |")


if __name__ == "__main__":
    main()
