"""On-disk cache of what transformers derives from a GGUF file (its config, its tokenizer).

Why: transformers re-reads every metadata value of the GGUF (the ~100k tokenizer strings included)
each time it builds a config or a tokenizer from it, seconds each for SmolLM2, most of the start-up
time of `pagedllm serve` with the default model. Saved with `save_pretrained` and read back from a
plain directory, the same objects load in a fraction of that (figures: BENCHMARKS.md).

Layout: `$PAGEDLLM_CACHE_ROOT/gguf/<key>/<what>/`, with `key` a hash of the file's absolute path, size,
mtime and the transformers version, so an edited file or a transformers upgrade gets a fresh entry.
`PAGEDLLM_CACHE_ROOT` defaults to `$XDG_CACHE_HOME/pagedllm` (or `~/.cache/pagedllm`), as vLLM's
`VLLM_CACHE_ROOT`. A cache that cannot be written is skipped with a warning, never an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pagedllm.envs as envs

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Bump when the content written under a key changes shape (e.g. a new file in it).
_CACHE_FORMAT = 1


def _transformers_version() -> str:
    """transformers' version without importing it (a warm engine start imports none of it)."""
    import importlib.metadata

    return importlib.metadata.version("transformers")


def cache_root() -> Path:
    """The root of pagedllm's caches, `PAGEDLLM_CACHE_ROOT` or the XDG default."""
    return envs.PAGEDLLM_CACHE_ROOT


def gguf_cache_dir(gguf_path: Path, what: str) -> Path:
    """Where `what` ("config", "tokenizer", ...) derived from `gguf_path` lives; may not exist yet."""
    path = gguf_path.resolve()
    stat = path.stat()
    ident = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{_transformers_version()}\0{_CACHE_FORMAT}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    return cache_root() / "gguf" / key / what


def load_or_create(
    gguf_path: Path,
    what: str,
    load: Callable[[Path], T],
    create: Callable[[], T],
    save: Callable[[T, Path], None],
) -> T:
    """`load(cached_dir)` if the cache has `what` for this file, else `create()` and `save` it there.

    The entry is written into a temporary sibling directory and renamed into place, so a reader never
    sees half an entry, and two processes filling the same entry at once both succeed.
    """
    entry = gguf_cache_dir(gguf_path, what)
    if entry.is_dir():
        try:
            return load(entry)
        except Exception as e:  # a damaged entry (disk full while writing, manual edits): rebuild it
            logger.warning("Ignoring unreadable cache entry %s (%s); rebuilding it.", entry, e)
            shutil.rmtree(entry, ignore_errors=True)

    value = create()
    tmp: str | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=entry.parent, prefix=f".{what}-")
        save(value, Path(tmp))
        os.rename(tmp, entry)
        tmp = None
    except OSError as e:
        # rename onto an existing non-empty dir fails when another process won the race: that is fine
        if not entry.is_dir():
            logger.warning("Could not cache %s of %s under %s: %s", what, gguf_path, entry, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return value
