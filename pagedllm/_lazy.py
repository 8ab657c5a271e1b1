"""Names a package imports on first use (PEP 562 module `__getattr__`), for `pagedllm` and `pagedllm.loader`.

    _MODULES = {"LLM": "pagedllm.entrypoints.llm", ...}     # public name -> the module that defines it
    __getattr__, __dir__ = lazy_exports(__name__, _MODULES, globals())

The first lookup imports the module and stores the value in the package's namespace, so later lookups
are plain attribute reads. This module imports nothing heavy: it is what keeps `import pagedllm` cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, modules: dict[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's `__getattr__` and `__dir__` over `modules` (name -> defining module)."""

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(namespace.get("__all__", modules))

    return __getattr__, __dir__
