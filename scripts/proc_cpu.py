"""CPU seconds (user + system) a process and its descendants have used so far, from /proc (Linux; no psutil).

    python3 scripts/proc_cpu.py PID   ->   "<PID's own seconds> <its descendants' seconds>"

scripts/gpu_serve_bench.sh reads it before and after a load for the server (the frontend process, and
the fork server + engine process below it), to report each side's CPU per output token.
"""

from __future__ import annotations

import os
import sys

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def cpu_seconds(root: int) -> tuple[float, float]:
    children: dict[int, list[int]] = {}
    own = 0.0
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = _stat(int(name))
            if s is not None:
                stats[int(name)] = s
                children.setdefault(s[0], []).append(int(name))
    if root in stats:
        own = stats[root][1]
    below, todo = 0.0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        below += stats[pid][1]
        todo.extend(children.get(pid, []))
    return own, below


if __name__ == "__main__":
    own, below = cpu_seconds(int(sys.argv[1]))
    print(f"{own:.2f} {below:.2f}")
