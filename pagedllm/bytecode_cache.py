"""pagedllm's own modules' byte code, kept under $PAGEDLLM_CACHE_ROOT/bytecode where Python keeps none.

Why. Where Python may not write `__pycache__` (PYTHONDONTWRITEBYTECODE=1, a read-only checkout or
image: both common in containers), every start compiles every pagedllm module it imports from source.
On the H200 host that was 278 `compile()` calls, 0.67 s of the engine process's start after its fork
(the start-up profile, BENCHMARKS.md, issue 16, h50), and the frontend pays the same for its modules.
With PAGEDLLM_BYTECODE_CACHE=1 a module of the `pagedllm` package that has no valid `__pycache__` file
is compiled once and its code object kept (marshal) in pagedllm's cache directory, as Triton keeps
its kernels there; the next start reads it back. Nothing is written next to the sources, so
PYTHONDONTWRITEBYTECODE's promise holds; other packages are left alone.

    key = sha256(source path, size, mtime_ns, Python's bytecode magic)  ->  bytecode/<key>.code

A changed source (size or mtime, as Python's own pyc check) gets another key, so a stale entry is
never read (nor removed: deleting the folder only costs the next start its compiles). Installed first thing by the command line (`install`, entrypoints/cli.py) and by the
engine's fork server before its torch import (pagedllm/_bytecode_preload.py), so the engine process's
imports use it too. On by default (PAGEDLLM_BYTECODE_CACHE=0: Python's own behaviour only).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import marshal
import os
import sys
import tempfile
from pathlib import Path
from types import CodeType
from typing import Any

_PACKAGE = "pagedllm"


def _entry(directory: Path, source_path: str) -> Path | None:
    """This source file's entry (None when the file cannot be read)."""
    try:
        st = os.stat(source_path)
    except OSError:
        return None
    ident = f"{source_path}\0{st.st_size}\0{st.st_mtime_ns}\0{importlib.util.MAGIC_NUMBER.hex()}"
    return directory / (hashlib.sha256(ident.encode()).hexdigest()[:32] + ".code")


class _KeptBytecodeLoader(importlib.machinery.SourceFileLoader):
    """SourceFileLoader that, where no valid `__pycache__` file exists, reads and writes the module's
    code object in `directory`."""

    directory: Path

    def get_code(self, fullname: str) -> CodeType | None:
        source_path = self.get_filename(fullname)
        if os.path.exists(importlib.util.cache_from_source(source_path)):
            return super().get_code(fullname)  # Python's own (it checks it and falls back to the source)
        entry = _entry(self.directory, source_path)
        if entry is not None:
            try:
                code = marshal.loads(entry.read_bytes())
                if isinstance(code, CodeType):
                    return code
            except (OSError, ValueError, EOFError, TypeError):
                pass
        code = super().get_code(fullname)  # compiled from the source (Python writes nothing here)
        if entry is not None and code is not None:
            _write(entry, marshal.dumps(code))
        return code


def _write(entry: Path, data: bytes) -> None:
    """Atomically (a concurrent start reads the old entry or the new one); a cache that cannot be
    written only costs the next start its compile."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, entry)
    except OSError:
        pass


class KeptBytecodeFinder:
    """A sys.meta_path finder for the `pagedllm` package's submodules: the path finder's spec, with
    `_KeptBytecodeLoader` for source files."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not name.startswith(_PACKAGE + "."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or type(spec.loader) is not importlib.machinery.SourceFileLoader:
            return spec
        loader = _KeptBytecodeLoader(spec.loader.name, spec.loader.path)
        loader.directory = self.directory
        spec.loader = loader
        return spec


def install() -> bool:
    """With PAGEDLLM_BYTECODE_CACHE=1, put the finder first on sys.meta_path (once per process); ->
    whether it is installed. The cache directory is taken now: $PAGEDLLM_CACHE_ROOT/bytecode/<tag>."""
    from pagedllm import envs

    if any(isinstance(f, KeptBytecodeFinder) for f in sys.meta_path):
        return True
    if not envs.PAGEDLLM_BYTECODE_CACHE:
        return False
    tag = sys.implementation.cache_tag or "python"
    sys.meta_path.insert(0, KeptBytecodeFinder(envs.PAGEDLLM_CACHE_ROOT / "bytecode" / tag))
    return True
