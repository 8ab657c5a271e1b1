"""Summarize a py-spy raw profile (`py-spy record --format raw [--subprocesses]`) per process.

    python scripts/pyspy_top.py OUT/pyspy_ours.txt [--top 20]

Each line of the raw format is one stack, root first, `;`-separated, then its sample count. With
`--subprocesses` the root frame names the process (`process 1234:"python3 -m pagedllm serve ..."`), so
the frontend and the engine process are reported apart. Printed per process: samples (py-spy leaves
idle threads out unless `--idle`, so samples ~ busy time at the sampling rate), the functions where the
samples were taken (self), and the functions most often on the stack (inclusive, each counted once a
stack).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

_LOCATION = re.compile(r"\s*\((?P<file>[^():]+):\d+\)$")


def short(frame: str) -> str:
    """`step (pagedllm/engine/engine_core.py:171)` -> `step (engine/engine_core.py)`; line numbers
    dropped so a function's samples add up."""
    m = _LOCATION.search(frame)
    if not m:
        return frame.strip()
    path = m.group("file").replace("\\", "/")
    parts = path.split("/")
    if "pagedllm" in parts:
        path = "/".join(parts[parts.index("pagedllm") + 1:])
    elif "site-packages" in parts:
        path = "/".join(parts[parts.index("site-packages") + 1:])
    else:
        path = "/".join(parts[-2:])
    return f"{frame[: m.start()].strip()} ({path})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    self_t: dict[str, Counter] = defaultdict(Counter)
    incl: dict[str, Counter] = defaultdict(Counter)
    total: Counter = Counter()
    with open(args.path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            proc = "all"
            while frames and frames[0].startswith("process "):  # a child process nests under its parent
                proc, frames = frames[0][:90], frames[1:]
            if frames and frames[0].startswith("thread "):
                frames = frames[1:]
            if not frames:
                continue
            total[proc] += n
            names = [short(fr) for fr in frames]
            self_t[proc][names[-1]] += n
            for name in set(names):
                incl[proc][name] += n
    for proc, n in total.most_common():
        print(f"\n## {proc}: {n} samples")
        print("\n| self | % | function |\n|---|---|---|")
        for name, c in self_t[proc].most_common(args.top):
            print(f"| {c} | {100 * c / n:.1f} | `{name}` |")
        print("\n| inclusive | % | function |\n|---|---|---|")
        for name, c in incl[proc].most_common(args.top):
            print(f"| {c} | {100 * c / n:.1f} | `{name}` |")


if __name__ == "__main__":
    main()
