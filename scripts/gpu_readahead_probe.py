"""Does page-cache read-ahead (pagedllm/readahead.py) shorten a cold start's imports on this host? (issue 16)

Each row a fresh `python3 -c IMPORT` (torch, transformers and a LlamaConfig: what a cold start's config
costs), timed from the parent. "evicted": every file of readahead.PACKAGES dropped from the page cache
first (`posix_fadvise(POSIX_FADV_DONTNEED)`, what a fresh machine's page cache holds of them: nothing); "+ ra":
the read-ahead thread started in this process just before the child (as `pagedllm serve` starts it before
its imports). Run it first thing on a fresh machine: its first row is then a real cold start.

    python3 scripts/gpu_readahead_probe.py [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedllm import readahead  # noqa: E402

IMPORT = "import torch, transformers; from transformers import LlamaConfig; LlamaConfig()"
TORCH = "import torch"


def evict() -> tuple[int, int]:
    files = nbytes = 0
    for name in readahead.PACKAGES:
        root = readahead.package_dir(name)
        for path in readahead.package_files(root) if root else ():
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                nbytes += os.fstat(fd).st_size
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                files += 1
            finally:
                os.close(fd)
    return files, nbytes


def child(code: str) -> float:
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.monotonic() - t


def row(label: str, code: str, do_evict: bool, ra: tuple[str, ...] | None) -> str:
    if do_evict:
        evict()
    t0 = time.monotonic()
    th = None
    if ra is not None:
        th = readahead.start(ra)
    wall = child(code)
    ra_s = ""
    if th is not None:
        th.join()
        ra_s = f"{time.monotonic() - t0:.2f}"
    return f"| {label} | {'torch' if code == TORCH else 'torch + transformers + LlamaConfig'} | {wall:.2f} | {ra_s} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cold-ra", action="store_true", help="the first (cold) row with the read-ahead thread")
    args = ap.parse_args()
    files, nbytes = 0, 0
    for name in readahead.PACKAGES:
        root = readahead.package_dir(name)
        for p in readahead.package_files(root) if root else ():
            files += 1
            nbytes += os.path.getsize(p)
    print(f"packages {readahead.PACKAGES}: {files} files, {nbytes / 1e9:.2f} GB", flush=True)
    first = "as found (first thing on a fresh machine: cold)" + (" + ra" if args.cold_ra else "")
    rows = [row(first, IMPORT, False, readahead.PACKAGES if args.cold_ra else None),
            row("again (warm)", IMPORT, False, None),
            row("warm + ra (its cost where nothing is to read)", IMPORT, False, readahead.PACKAGES)]
    for r in rows:
        print(r, flush=True)
    for _ in range(args.repeat):
        rows += [row("evicted", IMPORT, True, None),
                 row("evicted + ra", IMPORT, True, readahead.PACKAGES),
                 _py_only_row(),
                 row("evicted", TORCH, True, None),
                 row("evicted + ra", TORCH, True, readahead.PACKAGES)]
        for r in rows[-5:]:
            print(r, flush=True)
    print("\n| start | imports | child s | read-ahead thread done at s |\n|---|---|---|---|")
    print("\n".join(rows))
    return 0


def _py_only_row() -> str:
    evict()
    t0 = time.monotonic()
    import threading

    th = threading.Thread(target=readahead.read_ahead, args=(readahead.PACKAGES, (".py", ".pyc")), daemon=True)
    th.start()
    wall = child(IMPORT)
    th.join()
    return f"| evicted + ra of .py / .pyc only | torch + transformers + LlamaConfig | {wall:.2f} | " \
           f"{time.monotonic() - t0:.2f} |"


if __name__ == "__main__":
    raise SystemExit(main())
