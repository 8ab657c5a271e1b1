"""The AVX2-only kernels (gguf_gemm_avx2.h, attention_avx2.h: x86 with AVX2 and no AVX-512, e.g. AMD Zen 3)
against the torch reference, also where the CPU has AVX-512: there the default build takes the 16-lane
kernels, so a second library is built with `-mno-avx512f` and loaded through ctypes. On an AVX2-only CPU
the default build already is that path (the other tests in tests/cpu cover it) and this module skips."""

import pytest
import torch

from pagedllm.cpu import attention as cpu_attention
from pagedllm.cpu import build
from pagedllm.cpu import gguf_gemm as cpu_gemm
from pagedllm.cpu.gguf_gemm import gguf_matmul, pack_gguf_rows
from tests.cpu.test_cpu_attention import batch
from tests.cpu.test_gguf_gemm import quantized


def _avx2_flags() -> tuple[str, ...] | None:
    flags = set(build._cpu_flags().split())
    if "avx512f" in flags and {"avx2", "fma", "f16c"} <= flags:
        return ("-mno-avx512f",)
    return None


@pytest.fixture(scope="module")
def avx2_kernels(cpu_kernels):
    flags = _avx2_flags()
    if flags is None:
        pytest.skip("no AVX-512 here: the default build already runs the AVX2 kernels")
    cc = build._find_compiler()
    cflags = (*build.CFLAGS, *flags)
    sources = [build.SOURCE.read_text(), *(build.SOURCE.with_name(h).read_text() for h in build.HEADERS)]
    path = build._build(cc, cflags, build.SOURCE, "libpagedllm_cpu.so", ["test_avx2", *sources, " ".join(cflags)])
    assert path is not None
    import ctypes

    lib = ctypes.CDLL(str(path))
    build._declare(lib)
    lib.cpu_pool_init(2)  # the job splitting too (no sgemm handed in: every row count takes the block kernel)
    return lib


@pytest.fixture
def use_avx2(avx2_kernels, monkeypatch):
    for module in (cpu_gemm, cpu_attention):
        monkeypatch.setattr(module, "load_cpu_kernels", lambda: avx2_kernels)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gemm_matches_dense_float32(use_avx2, qtype):
    # 1 row: the Q4 full-tile register kernel; 2-4: the half-tile ones; 5+: the L1-buffered block (passes
    # of 6; past 48 rows several groups); 50 outputs: a partial last tile.
    k, n = 160, 50
    raw, dense = quantized(qtype, n, k)
    packed = pack_gguf_rows(raw, qtype, k)
    for m in (1, 2, 3, 4, 5, 7, 16, 49, 100):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        ref = x.double() @ dense.double().T
        y = gguf_matmul(x, packed)
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-5 * ref.abs().max().item())


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (40, 2, 48)])
def test_attention_matches_reference(use_avx2, heads, kv_heads, head_dim, kv_dtype):
    # groups of 3 (SmolLM2), 1 (two position sets in P.V) and 20 (two qk passes of <= 16 heads);
    # head_dim 48: a last P.V column pass narrower than the others.
    seq_lens = [1, 7, 17, 33, 100]
    q, k, v, cache, md = batch([1] * len(seq_lens), seq_lens, heads, kv_heads, head_dim, 16, kv_dtype=kv_dtype)
    ref_cache, cache_out = cache.clone(), cache.clone()
    ref = cpu_attention.paged_attention(q, k, v, ref_cache, md, head_dim**-0.5)
    out = cpu_attention.CpuAttentionBackend().forward(q, k, v, cache_out, md, head_dim**-0.5)
    assert torch.equal(cache_out, ref_cache)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
