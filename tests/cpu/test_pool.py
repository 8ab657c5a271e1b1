"""The kernels' thread pool (capped at the usable CPUs): resizing keeps results identical, and two
Python threads calling kernels at once (the second caller runs its job inline) both get correct results."""

import os
import threading

import gguf
import numpy as np
import torch
from gguf import quants

from pagedllm.cpu.build import configure_cpu_threads, load_cpu_kernels
from pagedllm.cpu.gguf_gemm import gguf_matmul, pack_gguf_rows


def weight(n=256, k=128):
    w = np.random.default_rng(3).standard_normal((n, k)).astype(np.float32)
    raw = quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    return pack_gguf_rows(raw, "Q4_1", k)


def test_resize_gives_identical_results(cpu_kernels):
    packed, x = weight(), torch.randn(9, 128)
    results = []
    usable = len(os.sched_getaffinity(0))
    for n in (1, usable + 1, 2):
        assert configure_cpu_threads(n) == min(n, usable) == load_cpu_kernels().cpu_pool_size()
        assert torch.get_num_threads() == 1  # the kernels own the parallelism
        results.append(gguf_matmul(x, packed))
    # each output is one sequential sum whoever computes it: bitwise equal across pool sizes
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_concurrent_callers(cpu_kernels):
    packed = weight()
    xs = [torch.randn(4, 128, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    expected = [gguf_matmul(x, packed) for x in xs]
    errors = []

    def worker(i):
        for _ in range(200):
            if not torch.equal(gguf_matmul(xs[i], packed), expected[i]):
                errors.append(i)
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_second_engine_keeps_the_pool(cpu_kernels):
    """torch at the 1 thread the first configuration set is not a request for one worker."""
    first = configure_cpu_threads(2)
    assert torch.get_num_threads() == 1
    assert configure_cpu_threads() == first == load_cpu_kernels().cpu_pool_size()
