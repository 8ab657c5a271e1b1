"""Opening a GGUF file with `gguf.GGUFReader`, faster (about 3x for SmolLM2: BENCHMARKS.md).

`GGUFReader.__init__` walks every metadata value through `self.data`, a `np.memmap`. Each slice of a
memmap builds a new memmap object (`__array_finalize__`), and the tokenizer arrays alone hold ~100k
strings. Handing the reader a plain ndarray view of the same mapping (zero copy) skips those
objects; every tensor's `.data` is then a plain view into the file too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader


class _PlainViewGGUFReader(GGUFReader):
    """`GGUFReader` whose `data` is the same mmap seen as a plain ndarray (see module docstring)."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        # `GGUFReader.__init__` assigns `self.data = np.memmap(path)`; keep the mapping alive via the
        # view's `.base`, drop the memmap subclass.
        self._plain_data = value.view(np.ndarray)


def open_gguf(path: str | Path) -> GGUFReader:
    """A `GGUFReader` over `path` (read-only); ValueError if the file is not GGUF."""
    try:
        return _PlainViewGGUFReader(path, "r")
    except ValueError as e:  # the reader raises ValueError('GGUF magic invalid') and friends
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def read_field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The Python value of metadata `key` (str, int, float, list), or `default` if absent."""
    field = reader.get_field(key)
    if field is None:
        return default
    return field.contents()  # already Python values (via .tolist() / utf-8 decode)
