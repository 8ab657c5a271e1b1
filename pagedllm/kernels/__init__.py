"""Triton kernels of the GPU fast path, each beside the plain PyTorch reference it must match.

Each module's docstring says what it computes and names its reference (`*_ref`).

Without CUDA, Triton runs a kernel only in its interpreter (`TRITON_INTERPRET=1`, CPU tensors), and
it reads that flag when `@triton.jit` decorates a function, i.e. when a kernel module is first
imported: set it in the environment before importing these modules to run them on a CPU (the test
suite's conftest.py does). The engine never launches them on a CPU (its CPU path is the torch
references and pagedllm/cpu), so importing them there without the flag is harmless.
"""
