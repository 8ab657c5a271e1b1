"""How the kernels are loaded: a CPython extension module where Python's headers exist (cheap calls),
else the same kernels through ctypes; both compute the same results, and bad calls raise."""

import ctypes
import types

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from pagedllm.cpu import build
from pagedllm.cpu.gguf_gemm import pack_gguf_rows


def test_extension_module_where_python_headers_exist(cpu_kernels):
    if build._python_include() is None:
        pytest.skip("no Python.h here: the kernels load through ctypes")
    assert isinstance(cpu_kernels, types.ModuleType)
    with pytest.raises(TypeError, match="takes 5 arguments"):
        cpu_kernels.silu_and_mul(0, 0)
    with pytest.raises(TypeError):
        cpu_kernels.silu_and_mul("x", 0, 0, 0, 0)


def test_ctypes_library_computes_the_same(cpu_kernels):
    if not isinstance(cpu_kernels, types.ModuleType):
        pytest.skip("the kernels already load through ctypes")
    cc = build._find_compiler()
    path = build._build(cc, build.CFLAGS, build.SOURCE, "libpagedllm_cpu.so",
                        ["test_build", build.SOURCE.read_text(), *(build.SOURCE.with_name(h).read_text()
                                                                   for h in build.HEADERS)])
    lib = ctypes.CDLL(str(path))
    build._declare(lib)
    w = np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32)
    packed = pack_gguf_rows(quants.quantize(w, gguf.GGMLQuantizationType.Q4_1), "Q4_1", 64)
    x = torch.randn(5, 64)
    outs = []
    for kernels in (cpu_kernels, lib):
        y = torch.empty(5, 48)
        assert kernels.gguf_gemm(packed.kind, x.data_ptr(), 64, packed.data_ptr, y.data_ptr(), 48, 5, 48, 64) == 1
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
