"""Compile `kernels.c` once per machine and load it with ctypes.

The library is built with the system C compiler (`$CC`, else cc / gcc / clang) for this CPU
(`-march=native`) and cached under `$PAGEDLLM_CACHE_DIR` (default `~/.cache/pagedllm`)/cpu-kernels,
keyed by a hash of the source, the flags, the compiler and the CPU's flags, so a second start
loads it in milliseconds. A build takes about a second (no torch headers are involved).

`load_cpu_kernels()` returns None (and says why, once, in the log) when there is no compiler or
the build fails; callers then keep the plain torch path. `PAGEDLLM_CPU_KERNELS=0` turns the
kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=fast", "-std=gnu11")
DISABLE_ENV = "PAGEDLLM_CPU_KERNELS"


def _cache_root() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm"
    )
    return Path(root) / "cpu-kernels"


def _find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
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


@functools.cache
def load_cpu_kernels() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built here (logged once)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        logger.info("CPU kernels off (%s=0)", DISABLE_ENV)
        return None
    cc = _find_compiler()
    if cc is None:
        logger.warning("no C compiler found (set CC); GGUF weights are dequantized to dense float32")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(
            "\0".join([SOURCE.read_text(), " ".join(CFLAGS), version, _cpu_flags()]).encode()
        ).hexdigest()[:16]
        lib_path = _cache_root() / key / "libpagedllm_cpu.so"
        if not lib_path.is_file():
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            # Build beside the target and rename: concurrent starts never load a half-written file.
            with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
                out = Path(tmp) / lib_path.name
                proc = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", str(out), "-lm"],
                                      capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:
                    logger.warning("building the CPU kernels failed (%s); using dense float32 weights:\n%s",
                                   cc, proc.stderr[-2000:])
                    return None
                os.replace(out, lib_path)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernels unavailable (%s); using dense float32 weights", e)
        return None
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    # gguf_gemm(kind, x, ldx, w, y, ldy, M, N, K, num_threads)
    lib.gguf_gemm.argtypes = [i32, p, i64, p, p, i64, i64, i64, i64, i32]
    lib.gguf_gemm.restype = None
    # gguf_dequantize(kind, w, out, N, K, num_threads)
    lib.gguf_dequantize.argtypes = [i32, p, p, i64, i64, i32]
    lib.gguf_dequantize.restype = None
    # write_kv_cache(key, key_stride, value, value_stride, kv_cache, num_slots, slot_mapping, num_tokens, row)
    lib.write_kv_cache.argtypes = [p, i64, p, i64, p, i64, p, i64, i64]
    lib.write_kv_cache.restype = None
    # paged_decode_attention(query, q_stride, out, out_stride, kv_cache, num_slots, block_size, num_heads,
    #     num_kv_heads, head_dim, block_table, block_table_stride, seq_lens, query_start_loc, reqs, n_reqs,
    #     scale, scratch, scratch_per_thread, num_threads)
    lib.paged_decode_attention.argtypes = [p, i64, p, i64, p, i64, i32, i32, i32, i32, p, i64, p, p, p, i64,
                                           ctypes.c_float, p, i64, i32]
    lib.paged_decode_attention.restype = None
    # rms_norm(x, x_stride, residual, res_stride, residual_out, weight, out, num_tokens, hidden, eps, num_threads)
    lib.rms_norm.argtypes = [p, i64, p, i64, p, p, p, i64, i64, ctypes.c_float, i32]
    lib.rms_norm.restype = None
    # rotary_embedding(positions, q, q_stride, k, k_stride, q_out, k_out, num_tokens, num_q_heads, num_k_heads,
    #     head_size, rotary_dim, cos_sin_cache, neox, num_threads)
    lib.rotary_embedding.argtypes = [p, p, i64, p, i64, p, p, i64, i64, i64, i64, i64, p, i32, i32]
    lib.rotary_embedding.restype = None
