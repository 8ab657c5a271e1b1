"""Start to ready of the Llama-3.1-8B shape (dummy weights) on the H200, cold and warm, per phase (issue 16).

    python3 scripts/gpu_cold_start.py [--quick] [--root DIR] [TREE ...]   # default: . and .ab/main (if present)

For each tree (a checkout root; `.ab/main` is main at 23ce52b, carried beside this one), each start is
a fresh Python process that builds `LLM("llama3-8b", load_format="dummy", max_model_len=4096)`:

    cold   an empty Triton cache directory (TRITON_CACHE_DIR): every kernel variant compiles, as on a
           fresh machine (the OS file cache is warm, so imports read faster than on a fresh machine)
    warm   a second process with the same directory: every variant loads from it
    cold, PAGEDLLM_PARALLEL_COMPILE=0   this tree's variants compiled one by one (A/B of the parallel compile)

Printed per start: seconds to `import torch`, to `import pagedllm`, to ready; the phases the engine logs
("start-up: X took Y s", warm-up, graph capture, "engine ready in"); the number of compiled kernel
binaries in the cache directory; and whether a greedy generation gave the same tokens as the first start.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, logging, sys, time
t0 = float(sys.argv[1])
logging.basicConfig(level=logging.INFO, format="LOG %(name)s: %(message)s", stream=sys.stderr)
t_python = time.time() - t0
import torch
t_torch = time.time() - t0
from pagedllm import LLM, SamplingParams
t_import = time.time() - t0
llm = LLM("llama3-8b", load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0)
t_ready = time.time() - t0
prompts = [{"prompt_token_ids": [(7 * i + j) % 5000 + 1 for j in range(20 + 37 * i)]} for i in range(6)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
print("RESULT " + json.dumps({"python": t_python, "torch": t_torch, "import": t_import, "ready": t_ready,
                              "tokens": [o.outputs[0].token_ids for o in outs]}), flush=True)
"""

def phases(log: str) -> list[tuple[str, str]]:
    out = []
    for line in log.splitlines():
        if m := re.search(r"start-up: (.+?) took ([\d.]+) s", line):
            out.append((m.group(1), m.group(2)))
        elif m := re.search(r"kernel warm-up \(eager prefill/decode variants\) took ([\d.]+) s", line):
            out.append(("warm-up steps (log)", m.group(1)))
        elif m := re.search(r"captured (\d+) CUDA graphs .* in ([\d.]+) s", line):
            out.append((f"capture of {m.group(1)} graphs (log)", m.group(2)))
        elif m := re.search(r"Triton variants: (\d+) found in ([\d.]+) s, compiled in parallel in ([\d.]+) s "
                            r"\((\d+) left", line):
            out.append((f"{m.group(1)} variants: collect / compile ({m.group(4)} failed)",
                        f"{m.group(2)} / {m.group(3)}"))
        elif m := re.search(r"Triton compile processes \((\d+)\): (\d+) variants in ([\d.]+) s, (\d+) failed", line):
            out.append((f"{m.group(1)} compile processes: {m.group(2)} variants ({m.group(4)} failed)", m.group(3)))
        elif "Triton compile processes" in line or "parallel Triton compile skipped" in line:
            out.append((line.split(": ", 1)[-1][:120], "-"))
        elif m := re.search(r"engine ready in ([\d.]+) s", line):
            out.append(("engine ready (log)", m.group(1)))
    return out


def count_binaries(cache_dir: str) -> int:
    return sum(name.endswith(".cubin") for _, _, files in os.walk(cache_dir) for name in files)


def start(tree: str, cache_dir: str, extra: dict[str, str]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), TRITON_CACHE_DIR=cache_dir,
               PAGEDLLM_CACHE_ROOT=cache_dir + "-root", **extra)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", CHILD, repr(t0)], cwd=tree, env=env, capture_output=True, text=True,
                       timeout=300)
    wall = time.time() - t0
    result = next((json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result is None:
        print(f"--- start in {tree} failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}", flush=True)
        return {"failed": True, "wall": wall}
    result["phases"] = phases(p.stderr)
    result["wall"] = wall
    result["binaries"] = count_binaries(cache_dir)
    warnings = [line for line in p.stderr.splitlines() if "WARNING" in line or "parallel Triton compile skipped" in line]
    result["warnings"] = warnings[:3]
    return result


def main() -> None:
    args = sys.argv[1:]
    quick = "--quick" in args  # cold and warm only, no A/B start
    root = None
    if "--root" in args:  # where the cache directories go (TREE_INDEX-a is the first tree's)
        root = args[args.index("--root") + 1]
        args = args[:args.index("--root")] + args[args.index("--root") + 2:]
    trees = [a for a in args if a != "--quick"] or [t for t in (".", ".ab/main") if os.path.isdir(t)]
    root = root or tempfile.mkdtemp(prefix="cold-start-")
    os.makedirs(root, exist_ok=True)
    rows, ref_tokens = [], None
    for tree in trees:
        label = "main 23ce52b" if tree.rstrip("/").endswith(".ab/main") else f"tree {tree}"
        runs = [("cold", "a", {}), ("warm", "a", {})]
        if label != "main 23ce52b" and not quick:
            runs.append(("cold, PAGEDLLM_PARALLEL_COMPILE=0", "b", {"PAGEDLLM_PARALLEL_COMPILE": "0"}))
        for kind, cache, extra in runs:
            cache_dir = os.path.join(root, f"{len(rows)}-{cache}" if cache == "b" else f"{trees.index(tree)}-a")
            r = start(tree, cache_dir, extra)
            if r.get("failed"):
                rows.append((label, kind, "FAILED", "", "", "", ""))
                continue
            ref_tokens = ref_tokens or r["tokens"]
            same = "same" if r["tokens"] == ref_tokens else "DIFFERENT"
            detail = "; ".join(f"{name} {sec}" for name, sec in r["phases"])
            print(f"{label} {kind}: ready {r['ready']:.1f} s; {detail}; {r['warnings']}", flush=True)
            rows.append((label, kind, f"{r['ready']:.1f}", f"{r['torch']:.1f} / {r['import']:.1f}",
                         str(r["binaries"]), same, detail))
    print("\n| tree | start | ready s | import torch / pagedllm s | cubins in cache | greedy tokens | phases (s) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
