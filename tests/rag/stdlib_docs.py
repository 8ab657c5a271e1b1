"""Distractor documents for the RAG evaluation: the docstrings of standard-library modules (documentation
that ships with every Python), one text file per module, written to a directory."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

MODULES = ("json", "collections", "functools", "itertools", "pathlib", "shutil", "textwrap", "statistics", "csv",
           "heapq", "bisect", "string", "fractions", "random")


def write_stdlib_docs(out: Path, modules: tuple[str, ...] = MODULES) -> list[Path]:
    files = []
    for name in modules:
        mod = importlib.import_module(name)
        parts = [inspect.getdoc(mod) or ""]
        for attr in sorted(dir(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            doc = inspect.getdoc(obj)
            if doc and (inspect.isfunction(obj) or inspect.isclass(obj)):
                parts.append(f"{name}.{attr}: {doc}")
        path = out / f"stdlib_{name}.txt"
        path.write_text("\n\n".join(p for p in parts if p), encoding="utf-8")
        files.append(path)
    return files
