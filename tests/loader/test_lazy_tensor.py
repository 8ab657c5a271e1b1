"""LazySlice: a tensor-parallel rank reads only its slice of a safetensors tensor, with the values
and dtype the whole tensor would give."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from pagedllm.loader.lazy_tensor import LazySlice
from pagedllm.loader.weights import safetensors_weights_iterator


def test_narrowed_lazy_slice_reads_only_its_region(tmp_path):
    w = torch.randn(8, 6)
    save_file({"w": w, "s": torch.tensor(3.0)}, tmp_path / "m.safetensors")
    for name, lazy in safetensors_weights_iterator([tmp_path / "m.safetensors"], use_tqdm=False, lazy=True):
        assert isinstance(lazy, LazySlice)
        if name == "s":
            assert lazy.numel() == 1 and lazy.item() == 3.0
            continue
        # Rank 1 of 2 of a row-parallel layer: input columns [3, 6), then a column-parallel row slice.
        view = lazy.to(dtype=torch.float64).narrow(1, 3, 3).narrow(0, 4, 4)
        assert tuple(view.shape) == (4, 3) and view.dtype == torch.float64 and view.dim() == 2
        read = view.materialize()
        assert read.numel() == 12  # the region only, not the 48 values of the tensor
        torch.testing.assert_close(read, w[4:8, 3:6].double())
        dst = torch.zeros(4, 3, dtype=torch.float64)
        dst.copy_(view)  # what weight loaders do: the read happens here
        torch.testing.assert_close(dst, w[4:8, 3:6].double())
        torch.testing.assert_close(lazy.t(), w.t())  # an attribute it does not know reads the view whole
