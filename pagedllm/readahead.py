"""Page-cache read-ahead for a start on a fresh machine.

On a machine that has not run Python's ML stack since it booted, nothing of torch, Triton or transformers
is in the page cache. `import torch` then faults its shared libraries in a few pages at a time, and
`import transformers` opens and reads every source file under `transformers/models` (its lazy module table
is built from their `__all__` lists: ~2,600 files, ~110 MB), one after another. Where storage answers each
read slowly but serves many at once (network block devices, cloud disks), that serial faulting is most of a
cold start's import time.

`start()` asks the kernel, from a background thread, to read those packages' files ahead
(`posix_fadvise(POSIX_FADV_WILLNEED)`: the kernel queues the reads and returns; nothing is loaded into
this process and nothing is imported), in the order a start needs them. The imports that follow find
their pages already read or in flight. On a machine whose page cache already holds them it costs the
directory walk (tens of milliseconds in the thread). Linux only (elsewhere, or without posix_fadvise,
it does nothing).

Worked example: `pagedllm serve` calls `start()` first thing, so the walk runs while the fork server
and the frontend import torch (engine/fork_server.py).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

# What a GPU start imports, in the order it imports them ("nvidia": the CUDA libraries torch loads as it
# imports, a namespace package of wheels such as nvidia-cublas).
PACKAGES = ("torch", "nvidia", "triton", "transformers", "tokenizers", "safetensors", "numpy", "jinja2")
SUFFIXES = (".py", ".pyc", ".so")
THREADS = 4  # the kernel does the reading; threads only overlap the opens of ~10,000 files


def package_dir(name: str) -> str | None:
    """A top-level package's directory, found without importing it (None: not installed)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations), None)


def package_files(root: str, suffixes: tuple[str, ...] = SUFFIXES) -> Iterator[str]:
    """Files under `root` whose names end in one of `suffixes` (shared libraries' versioned names, e.g.
    libfoo.so.12, count as .so), directories in scandir order, depth first."""
    stack = [root]
    while stack:
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.name.endswith(suffixes) or ".so." in e.name:
                    yield e.path
            except OSError:
                continue


def advise(path: str) -> int:
    """Ask the kernel to read `path` into the page cache; the bytes asked for (0 where it could not)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return size
    except OSError:
        return 0
    finally:
        os.close(fd)


def read_ahead(packages: Iterable[str] = PACKAGES, suffixes: tuple[str, ...] = SUFFIXES) -> tuple[int, int]:
    """Advise every file of `packages` (in order); (files, bytes) asked for. Blocks until all are asked."""
    files = nbytes = 0
    with ThreadPoolExecutor(THREADS, thread_name_prefix="pagedllm-readahead") as pool:
        for name in packages:
            root = package_dir(name)
            if root is None:
                continue
            for size in pool.map(advise, package_files(root, suffixes), chunksize=64):
                files += 1
                nbytes += size
    return files, nbytes


def start(packages: Iterable[str] = PACKAGES) -> threading.Thread | None:
    """`read_ahead` in a daemon thread (None where the OS has no posix_fadvise)."""
    if not hasattr(os, "posix_fadvise"):
        return None
    t = threading.Thread(target=read_ahead, args=(tuple(packages),), name="pagedllm-readahead", daemon=True)
    t.start()
    return t
