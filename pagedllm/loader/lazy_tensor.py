"""A checkpoint tensor that is read only where it is used: tensor-parallel ranks read their slices.

`safetensors_weights_iterator(..., lazy=True)` yields `LazySlice`s over `safe_open(...).get_slice`.
A weight loader narrows it to this rank's rows or columns (`narrow` composes, reads nothing) and
copies it into the parameter: only then are the bytes of that region read from the file. Example,
rank 1 of 2 loading a (1024, 4096) o_proj.weight (RowParallelLinear, input dim 1):

    LazySlice(1024, 4096).narrow(1, 2048, 2048) -> reads [0:1024, 2048:4096], half the tensor

`to(device=, dtype=)` is recorded and applied after the read. Torch functions and Tensor methods that
meet a LazySlice (`param.data.copy_(lazy)`) read it first (`__torch_function__`); any other tensor
attribute (`lazy.t()`) reads the current view whole, so code that does not know about laziness
still gets the right values.
"""

from __future__ import annotations

from typing import Any

import torch

# safetensors dtype names -> torch
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class LazySlice:
    def __init__(self, source: Any, full_shape: tuple[int, ...], dtype: torch.dtype,
                 ranges: tuple[tuple[int, int], ...] | None = None,
                 to_kwargs: dict[str, Any] | None = None) -> None:
        self._source = source  # safetensors PySafeSlice: source[a:b, c:d] reads that region
        self._full_shape = full_shape
        self._src_dtype = dtype
        self._ranges = ranges if ranges is not None else tuple((0, n) for n in full_shape)
        self._to = to_kwargs or {}

    @classmethod
    def from_safetensors(cls, safe_slice: Any) -> LazySlice:
        return cls(safe_slice, tuple(safe_slice.get_shape()), _ST_DTYPES[safe_slice.get_dtype()])

    # -- what loaders read without touching the data -------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(e - s for s, e in self._ranges)

    @property
    def dtype(self) -> torch.dtype:
        return self._to.get("dtype") or self._src_dtype

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self._ranges)

    def numel(self) -> int:
        return self.shape.numel()

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def narrow(self, dim: int, start: int, length: int) -> LazySlice:
        dim = dim % self.dim()
        s, e = self._ranges[dim]
        if start < 0 or length < 0 or s + start + length > e:
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for shape {tuple(self.shape)}")
        ranges = list(self._ranges)
        ranges[dim] = (s + start, s + start + length)
        return LazySlice(self._source, self._full_shape, self._src_dtype, tuple(ranges), self._to)

    def to(self, *args: Any, **kwargs: Any) -> LazySlice:
        for a in args:  # .to(device), .to(dtype), .to(device, dtype)
            kwargs["dtype" if isinstance(a, torch.dtype) else "device"] = a
        return LazySlice(self._source, self._full_shape, self._src_dtype, self._ranges, {**self._to, **kwargs})

    # -- reading -----------------------------------------------------------------------------------
    def materialize(self) -> torch.Tensor:
        """Read this view's region from the file (and apply `to`)."""
        if self.dim() == 0:
            t = self._source[...]  # a scalar: nothing to slice
        else:
            t = self._source[tuple(slice(s, e) for s, e in self._ranges)]
        return t.to(**self._to) if self._to else t

    def item(self) -> Any:
        return self.materialize().item()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def read(a: Any) -> Any:
            if isinstance(a, LazySlice):
                return a.materialize()
            if isinstance(a, (list, tuple)):
                return type(a)(read(x) for x in a)
            return a

        return func(*read(args), **{k: read(v) for k, v in (kwargs or {}).items()})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        return f"LazySlice(shape={tuple(self.shape)}, dtype={self.dtype}, of {self._full_shape})"
