"""Compile `kernels.c` (and the headers it includes) once per machine and load it.

The kernels are built with the system C compiler (`$CC`, else cc / gcc / clang) for this CPU
(`-march=native`) and cached under `$PAGEDLLM_CACHE_ROOT` (default `~/.cache/pagedllm`)/cpu-kernels,
keyed by a hash of the source, the flags, the compiler and the CPU's flags, so a second start
loads them in milliseconds. A build takes a few seconds (no torch headers are involved). Where
Python's headers exist they are wrapped as a CPython extension module (pymodule.c: ~0.2 us per call),
else loaded with ctypes (~1.5-3 us per call); both expose the same functions.

`load_cpu_kernels()` returns None (and says why, once, in the log) when there is no compiler or
the build fails; callers then keep the plain torch path. `PAGEDLLM_CPU_KERNELS=0` turns the
kernels off; `PAGEDLLM_CPU_CFLAGS` adds compiler flags (e.g. `-march=x86-64-v3` for a cache shared
by different machines).

`configure_cpu_threads(n)` sizes the kernels' thread pool (pool.h) and hands them torch's BLAS
sgemm for long prefills. The kernels then own the parallelism: torch's intra-op pool drops to one
thread, so two pools never spin against each other on a machine with few cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import pagedllm.envs as envs

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
EXTENSION_SOURCE = Path(__file__).with_name("pymodule.c")  # includes kernels.c
EXTENSION_NAME = "pagedllm_cpu_kernels"
HEADERS = ("vec.h", "pool.h", "gguf_gemm.h", "gguf_gemm_avx2.h", "attention.h", "attention_avx2.h", "rows.h", "decoder.h")
CFLAGS = ("-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-ffp-contract=fast", "-std=gnu11", "-Wno-psabi")


def _cache_root() -> Path:
    from pagedllm.loader.gguf_cache import cache_root

    return cache_root() / "cpu-kernels"


def _find_compiler() -> str | None:
    for name in (envs.CC, "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    # -march=native depends on the CPU: a cache shared between machines must not mix them.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_isa() -> str:
    """The widest x86 vector ISA the CPU reports, for the start-up log line."""
    flags = set(_cpu_flags().split())
    for name in ("avx512f", "avx2", "avx", "sse4_2"):
        if name in flags:
            return name
    return platform.machine()


def _build(cc: str, cflags: tuple[str, ...], source: Path, name: str, key_parts: list[str]) -> Path | None:
    """Compile `source` into the cache (once per key) and return the shared object; None on failure."""
    key = hashlib.sha256("\0".join(key_parts).encode()).hexdigest()[:16]
    lib_path = _cache_root() / key / name
    if not lib_path.is_file():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent starts never load a half-written file.
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
            out = Path(tmp) / lib_path.name
            proc = subprocess.run([cc, *cflags, str(source), "-o", str(out), "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                logger.warning("building the CPU kernels (%s) failed (%s):\n%s", source.name, cc, proc.stderr[-2000:])
                return None
            os.replace(out, lib_path)
    return lib_path


def _python_include() -> str | None:
    include = sysconfig.get_paths().get("include")
    return include if include and (Path(include) / "Python.h").is_file() else None


def _load_extension(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load_cpu_kernels() -> Any:
    """The compiled kernels, or None when they cannot be built here (logged once).

    A CPython extension module (pymodule.c) where Python's headers are installed, else a plain shared
    library through ctypes (PAGEDLLM_CPU_FFI=ctypes forces it): the same functions either way."""
    if not envs.PAGEDLLM_CPU_KERNELS:
        logger.info("CPU kernels off (PAGEDLLM_CPU_KERNELS=0)")
        return None
    cc = _find_compiler()
    if cc is None:
        logger.warning("no C compiler found (set CC); GGUF weights are dequantized to dense float32")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        cflags = (*CFLAGS, *envs.PAGEDLLM_CPU_CFLAGS.split())
        sources = [SOURCE.read_text()] + [SOURCE.with_name(h).read_text() for h in HEADERS]
        key_parts = [*sources, " ".join(cflags), version, _cpu_flags()]
        include = _python_include() if envs.PAGEDLLM_CPU_FFI != "ctypes" else None
        if include is not None:
            ext_flags = (*cflags, f"-I{include}")
            path = _build(cc, ext_flags, EXTENSION_SOURCE, EXTENSION_NAME + ".so",
                          [*key_parts, EXTENSION_SOURCE.read_text(), include, sys.version])
            if path is not None:
                return _load_extension(path)  # releases the GIL in every kernel call, like ctypes.CDLL
            logger.warning("the CPU kernels' Python module did not build; calling them through ctypes")
        path = _build(cc, cflags, SOURCE, "libpagedllm_cpu.so", key_parts)
        if path is None:
            logger.warning("no CPU kernels: GGUF weights are dequantized to dense float32")
            return None
        lib = ctypes.CDLL(str(path))  # releases the GIL during each call: the event loop runs meanwhile
    except (OSError, ImportError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernels unavailable (%s); using dense float32 weights", e)
        return None
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "cpu_pool_init": ([i32], i32),
        "cpu_pool_size": ([], i32),
        "cpu_set_sgemm": ([p, p], None),
        # gguf_gemm(kind, x, ldx, w, y, ldy, M, N, K) -> 0 when out of memory
        "gguf_gemm": ([i32, p, i64, p, p, i64, i64, i64, i64], i32),
        # gguf_gemm_dense(kind, x, ldx, w, y, ldy, M, N, K) -> 0 when no sgemm was set
        "gguf_gemm_dense": ([i32, p, i64, p, p, i64, i64, i64, i64], i32),
        # gguf_dequantize(kind, w, out, N, K)
        "gguf_dequantize": ([i32, p, p, i64, i64], None),
        # write_kv_cache(key, key_stride, value, value_stride, kv_cache, num_slots, slot_mapping, num_tokens, row,
        #     kv_type)
        "write_kv_cache": ([p, i64, p, i64, p, i64, p, i64, i64, i32], None),
        # paged_attention_rows(query, q_stride, key, key_stride, value, value_stride, slot_mapping, num_tokens,
        #     out, out_stride, kv_cache, kv_type, num_slots, block_size, num_heads, num_kv_heads, head_dim,
        #     block_table, block_table_stride, row_token, row_req, row_seq, n_rows, scale, scratch,
        #     scratch_per_worker)
        "paged_attention_rows": ([p, i64, p, i64, p, i64, p, i64, p, i64, p, i32, i64, i32, i32, i32, i32, p, i64,
                                  p, p, p, i64, f32, p, i64], None),
        # rms_norm(x, x_stride, residual, res_stride, residual_out, weight, out, num_tokens, hidden, eps)
        "rms_norm": ([p, i64, p, i64, p, p, p, i64, i64, f32], None),
        # rotary_embedding(positions, q, q_stride, k, k_stride, q_out, k_out, num_tokens, num_q_heads,
        #     num_k_heads, head_size, rotary_dim, cos_sin_cache, neox)
        "rotary_embedding": ([p, p, i64, p, i64, p, p, i64, i64, i64, i64, i64, p, i32], None),
        # silu_and_mul(x, x_stride, out, num_tokens, d)
        "silu_and_mul": ([p, i64, p, i64, i64], None),
        # argmax_rows(x, ld, rows, n, out)
        "argmax_rows": ([p, i64, i64, i64, p], None),
        # llama_decoder_stack(model, layers, n_layers, step, eps, scale) -> 0 when out of memory (decoder.h)
        "llama_decoder_stack": ([p, p, i64, p, f32, f32], i32),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


def _torch_blas() -> tuple[int | None, int | None]:
    """Addresses of the Fortran `sgemm_` inside torch's CPU library (MKL in the x86 wheels) and of
    MKL's Fortran `mkl_set_num_threads_local_`, where exported."""
    import torch

    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = Path(torch.__file__).parent / "lib" / name
        if path.is_file():
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:
                return None, None
            addrs = []
            for sym in ("sgemm_", "mkl_set_num_threads_local_"):
                fn = getattr(lib, sym, None)
                addrs.append(ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else None)
            return addrs[0], addrs[1]
    return None, None


_configured_threads: int | None = None


def configure_cpu_threads(num_threads: int | None = None) -> int:
    """Size the kernels' pool, set torch's intra-op threads to 1, and log the decision once per change.

    Default size: torch's thread count (EngineCore sets it from `cpu_threads`; torch's own default is
    the physical cores), at most the CPUs this process may use. A second engine in the same process
    finds torch at the 1 thread set here and keeps the pool as it is. Returns the pool size."""
    global _configured_threads
    import torch

    lib = load_cpu_kernels()
    if lib is None:
        return torch.get_num_threads()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    wanted = num_threads
    if wanted is None:
        # torch at 1 thread after we configured: our own setting, not a request for one worker.
        ours = _configured_threads is not None and torch.get_num_threads() == 1
        wanted = _configured_threads if ours else torch.get_num_threads()
    n = max(1, min(wanted, usable))
    if n == _configured_threads and lib.cpu_pool_size() == n:
        torch.set_num_threads(1)
        return n
    size = lib.cpu_pool_init(n)
    torch.set_num_threads(1)
    sgemm, set_threads_local = _torch_blas()
    lib.cpu_set_sgemm(sgemm, set_threads_local)
    _configured_threads = size
    logger.info("CPU threads: %d kernel workers (%d CPUs usable, %s), torch intra-op 1; long prefills: %s",
                size, usable, cpu_isa(), "torch BLAS sgemm per worker" if sgemm else "block kernel (no sgemm)")
    return size
