"""Every environment variable pagedllm reads, declared once with its meaning and default (vLLM's
envs.py). Nothing else in the package reads the environment (tests/test_envs.py checks).

    import pagedllm.envs as envs
    envs.PAGEDLLM_CACHE_ROOT          # read now, from the environment as it is now

An attribute reads the environment when it is accessed, so a process that sets a variable (a test,
the engine process taking the frontend's environment) sees it. Hot paths never do: what a step
needs is read once at start into a frozen object (`kernel_switches()`: the attention backend, gemv
and graph capture).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _flag(name: str, default: bool) -> Callable[[], bool]:
    """"0" is off, anything else set is on; unset is `default`."""
    return lambda: os.environ.get(name, "1" if default else "0") != "0"


def _str(name: str, default: str | None = None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or default


def _int(name: str, default: int) -> Callable[[], int]:
    """An integer; unset or empty is `default`, anything else not an integer a ValueError naming it."""
    def read() -> int:
        v = os.environ.get(name) or str(default)
        try:
            return int(v)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {v!r}") from None

    return read


def _names(name: str, default: str) -> Callable[[], frozenset[str]]:
    """A comma list drawn from `default`'s names: unset is all of them, empty none; any other name is refused
    by name."""
    allowed = default.split(",")

    def read() -> frozenset[str]:
        names = frozenset(n.strip() for n in os.environ.get(name, default).split(",") if n.strip())
        bad = sorted(names - set(allowed))
        if bad:
            raise ValueError(f"{name}: {', '.join(map(repr, bad))} not among {', '.join(allowed)}")
        return names

    return read


def _fail_at_step() -> int | None:
    v = os.environ.get("PAGEDLLM_TEST_FAIL_AT_STEP")
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"PAGEDLLM_TEST_FAIL_AT_STEP must be an integer step, got {v!r}.") from None


def _multiprocessing() -> bool | None:
    v = os.environ.get("PAGEDLLM_ENABLE_MULTIPROCESSING")
    if v in (None, ""):
        return None
    if v not in ("0", "1"):
        raise ValueError(f"PAGEDLLM_ENABLE_MULTIPROCESSING must be 0 or 1, got {v!r}.")
    return v == "1"


def _optional_flag(name: str) -> bool | None:
    """"1" on, "0" off, unset or empty None (the caller's default); anything else is refused by name."""
    v = os.environ.get(name)
    if v in (None, ""):
        return None
    if v not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {v!r}.")
    return v == "1"


def _positive_int(name: str) -> int | None:
    """An optional count: unset or empty -> None; anything but a positive integer is refused by name."""
    value = os.environ.get(name)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)


def _cache_root() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_ROOT")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "pagedllm"


# name -> how to read it. Keep each entry's comment: it is the variable's documentation.
environment_variables: dict[str, Callable[[], Any]] = {
    # -- kernels and the GPU fast path (read once at engine start: kernel_switches()) --
    # 0: the attention layer writes K/V and applies q/k norm + rotary with separate kernels instead
    # of the fused prep kernel (kernels/qkv_prep.py); for A/B timings.
    "PAGEDLLM_FUSED_QKV": _flag("PAGEDLLM_FUSED_QKV", True),
    # 0: decode-only steps run prep and attention as two kernels instead of one
    # (kernels/decode_attention.py).
    "PAGEDLLM_FUSED_DECODE": _flag("PAGEDLLM_FUSED_DECODE", True),
    # 0: every linear layer goes to F.linear (cuBLAS), never the few-row gemv kernel (kernels/gemv.py).
    "PAGEDLLM_SKINNY_GEMV": _flag("PAGEDLLM_SKINNY_GEMV", True),
    # 0: int4 decode batches go to the FMA GEMV / tile kernel instead of the tensor-core kernel
    # (kernels/wna16_tc.py), the path before it; for comparisons.
    "PAGEDLLM_WNA16_TC": _flag("PAGEDLLM_WNA16_TC", True),
    # 0: one-row int4 linears go to the tensor-core kernel instead of the short-program streaming GEMV
    # (kernels/wna16_stream.py); for comparisons.
    "PAGEDLLM_WNA16_STREAM": _flag("PAGEDLLM_WNA16_STREAM", True),
    # 0: int4 batches of 2 or more rows go to the tensor-core kernel (kernels/wna16_tc.py, to 64 / 128
    # rows) and the dequantized scratch + cuBLAS instead of the one-dot-a-step GEMM (kernels/wna16_mma.py),
    # the path before it; for comparisons.
    "PAGEDLLM_WNA16_MMA": _flag("PAGEDLLM_WNA16_MMA", True),
    # A JSON file of measured wna16_mma launch configurations, {"N,K": [[max_rows, [BLOCK_M, BLOCK_N,
    # SPLIT_K, num_warps, num_stages] or null], ...]} (null: the path before it), read at import in
    # place of the built-in table (scripts/gpu_wna16_mma.py writes one); for tuning runs.
    "PAGEDLLM_WNA16_MMA_TABLE": _str("PAGEDLLM_WNA16_MMA_TABLE"),
    # 0: int4 batches on sm_90 go to the Triton kernels above instead of the Gluon GEMM whose weights
    # are dequantized in wgmma's register layout (kernels/wna16_wgmma.py); for comparisons.
    "PAGEDLLM_WNA16_WGMMA": _flag("PAGEDLLM_WNA16_WGMMA", True),
    # A JSON file of measured wna16_wgmma launches, {"N,K": [[max_rows, [BLOCK_M, BLOCK_N, SPLIT_K,
    # num_warps, STAGES(, BLOCK_KW)] or null], ...]} (null: the kernels above), read at import in place of
    # the built-in table (scripts/gpu_wna16_wgmma.py writes one); for tuning runs.
    "PAGEDLLM_WNA16_WGMMA_TABLE": _str("PAGEDLLM_WNA16_WGMMA_TABLE"),
    # 0: decode-sized MoE steps sort their (token, expert) pairs with the one-program align kernel
    # before the expert GEMMs, instead of per-expert row lists (kernels/fused_moe.py,
    # `_moe_expert_rows_kernel` / `_fused_moe_rows_kernel`); for comparisons.
    "PAGEDLLM_MOE_SCAN": _flag("PAGEDLLM_MOE_SCAN", True),
    # 0: MoE steps of >= 1024 (token, expert) pairs sort their pairs with the one-program align kernel (up
    # to 8192 pairs) or the torch version's ~20 launches (past it) instead of two parallel launches
    # (kernels/fused_moe.py `moe_align_block_size_rows`: per-expert lists, then their padded runs; the
    # same sorted list, in less than half the time on the H200: BENCHMARKS.md, issue 24, h49).
    "PAGEDLLM_MOE_ALIGN_ROWS": _flag("PAGEDLLM_MOE_ALIGN_ROWS", True),
    # MLA decode batches (DeepSeek) run kernels/mla_decode.py's `_mla_decode_rc_kernel` with the latent's
    # 512 columns in this many chunks (4, 2 or 1), the query reloaded per key tile instead of held in
    # registers (more programs an SM: faster on the H200 at DeepSeek-V2-Lite's shape, BENCHMARKS.md, h49);
    # 0: the one-piece kernel.
    "PAGEDLLM_MLA_DECODE_CHUNKS": _int("PAGEDLLM_MLA_DECODE_CHUNKS", 4),
    # 0: MoE blocks with shared experts (DeepSeek's, stacked after the routed ones) keep the align path at
    # decode sizes instead of the row lists with the shared experts as token chunks (kernels/fused_moe.py
    # `_fused_moe_rows_kernel`; faster on the H200 at DeepSeek-V2-Lite's shape: BENCHMARKS.md, h49).
    "PAGEDLLM_MOE_SCAN_SHARED": _flag("PAGEDLLM_MOE_SCAN_SHARED", True),
    # 0: MoE blocks sum their top-k expert outputs with a kernel of their own instead of leaving them
    # to the next residual add + RMSNorm (FusedMoE.can_leave_topk_unsummed, kernels/rmsnorm.py).
    "PAGEDLLM_MOE_SUM_IN_NORM": _flag("PAGEDLLM_MOE_SUM_IN_NORM", True),
    # 0: a dynamic W8A8 linear's input is quantized by its own launch, not by the RMSNorm / SiLU-and-mul
    # kernel that produces it (layers/quant_fusion.py); for A/B timings.
    "PAGEDLLM_FUSED_ACT_QUANT": _flag("PAGEDLLM_FUSED_ACT_QUANT", True),
    # 0: decode attention over an fp8 KV cache runs both dots in fp16 with the query heads as the MMA's rows
    # (decode_attention.py variant 0) instead of rounding q to e4m3 per row and running QK on fp8 tensor cores
    # with the keys as the rows (variant 3, the default: W1 with an fp8 cache 12,609 -> 12,960 tok/s on the
    # H200 with h51's form of it, 13,638 -> 13,922 summing the softmax denominators after the loop; SmolLM2
    # perplexity 81.28 vs 81.34 on the same fp8 cache: BENCHMARKS.md, h51 and the twentieth session).
    "PAGEDLLM_FP8_KV_DOTS": _flag("PAGEDLLM_FP8_KV_DOTS", True),
    # An fp8 cache's decode loop and tiles, "VARIANT,BLOCK_M,TILE_N,warps,stages" (kernels/decode_attention.py
    # DECODE_VARIANTS), for A/B runs; empty (default): FP8_KV_VARIANT with FP8_KV_CONFIG there.
    "PAGEDLLM_FP8_KV_DECODE": _str("PAGEDLLM_FP8_KV_DECODE", ""),
    # The standard KV cache's memory order (vLLM's VLLM_KV_CACHE_LAYOUT): "NHD" keeps a block's tokens outermost,
    # (block, slot, kv head, dim), "HND" its kv heads, (block, kv head, slot, dim), so one attention program's
    # keys of a block are one contiguous run; "auto" (default): HND on a GPU (decode attention 1-3% faster on the
    # H200, the same outputs bit for bit: BENCHMARKS.md, issue 19, nineteenth session), NHD on the CPU (whose
    # fused decoder reads NHD). Either way the tensor's shape is (2, num_blocks, block_size, num_kv_heads,
    # head_dim) and the kernels address it by its strides.
    "PAGEDLLM_KV_CACHE_LAYOUT": _str("PAGEDLLM_KV_CACHE_LAYOUT", "auto"),
    # 0: block-wise FP8 linears (128 x 128 weight blocks, Qwen3-FP8 / DeepSeek-V3) on sm_90 with CUDA >= 12.9 run the
    # Triton kernel instead of cuBLASLt's block-scaled GEMM (torch._scaled_mm with 1 x 128 and 128 x 128 scale grids,
    # kernels/fp8_block_gemm.py `cublas_block_ok`: 1.5-2.5x faster from 64 rows at Llama-3.1-8B's shapes on an H100,
    # BENCHMARKS.md, twenty-third session); for comparisons.
    "PAGEDLLM_FP8_BLOCK_CUBLAS": _flag("PAGEDLLM_FP8_BLOCK_CUBLAS", True),
    # 0: FP8 linears of the measured shapes (kernels/w8a8_gemm.py DECODE_TABLE: the Llama-3.1-8B linears) at
    # 17-256 rows keep the M thresholds of kernels/scaled_mm.py instead of the table's measured pick (a Triton
    # tile with K split in one launch, or cuBLAS); for A/B timings (BENCHMARKS.md h51).
    "PAGEDLLM_W8A8_SPLIT_K": _flag("PAGEDLLM_W8A8_SPLIT_K", True),
    # 1 (default): the FP8 linears PAGEDLLM_FP8_DEFER_LINEARS names (plain Llama layers, TP 1, no bias) at 17-256
    # rows run cuBLASLt's per-tensor FP8 GEMM with unit scales, and the kernel that consumes the output applies
    # the per-token and per-channel scales (kernels/scaled_mm.py DEFER_SCALES): the residual add + RMSNorm after
    # o_proj / down_proj, SwiGLU's activation after gate_up_proj, the fused rotary + K/V write (+ decode
    # attention) after qkv_proj. W1 on the H200: fp8 12,439 -> 12,938 tok/s, with an fp8 cache 12,968 -> 13,363;
    # a model's log-probabilities as far from its bf16 run's as without (BENCHMARKS.md, seventeenth session).
    "PAGEDLLM_FP8_DEFER_SCALES": _flag("PAGEDLLM_FP8_DEFER_SCALES", True),
    # The linears that defer their scales under PAGEDLLM_FP8_DEFER_SCALES=1 (read only then), for A/B runs: a
    # comma list of qkv, o, gate_up, down (empty: none); another name is refused by name (models/llama.py
    # mark_deferred_scales). Per call on the H200 at 32 / 64 / 128 / 192 / 256 rows (Llama-3.1-8B shapes), the
    # unit-scale GEMM against the scaled pick: qkv 9.9 / 10.0 / 9.4 / 11.2 / 12.1 us vs 13.0 / 10.5 / 12.9 / 14.6 /
    # 14.6, gate_up 31.0 / 33.0 / 36.9 / 42.1 / 49.3 vs 32.7 / 33.2 / 34.8 / 48.7 / 50.6 (slower at 128).
    "PAGEDLLM_FP8_DEFER_LINEARS": _names("PAGEDLLM_FP8_DEFER_LINEARS", "qkv,o,gate_up,down"),
    # 0: capture decode graphs with the default BLAS library only and run each batch on the smallest
    # captured size that fits (worker/graph_plan.py: the plan before measurement).
    "PAGEDLLM_GRAPH_TUNING": _flag("PAGEDLLM_GRAPH_TUNING", True),
    # 1: capture each CUDA graph through torch.cuda.graph, which empties torch's device and pinned-host
    # caches before every capture (worker/cuda_graphs.py, capture_forward); 0 (default since h50's H200
    # round 1: the same greedy tokens): they are emptied once, before a runner's first capture, and the
    # next eager pass reuses the cached blocks.
    "PAGEDLLM_CAPTURE_EMPTY_CACHE": _flag("PAGEDLLM_CAPTURE_EMPTY_CACHE", False),
    # 1: the start-up's Triton variants are compiled at once in compile processes before the warm-up
    # (worker/precompile.py) instead of one after another as each is first launched, for every CUDA
    # engine; unset (default): only for `pagedllm serve`'s prestarted engine process on a Triton cache
    # no start has completed on (a fresh machine), whose compile processes are forked from it
    # (worker/compile_pool.py fork_compile_pool); 0: never. The old form (new interpreters as compile
    # processes) started slower than without on the H200; the forked form is faster (BENCHMARKS.md,
    # issue 16, h47).
    "PAGEDLLM_PARALLEL_COMPILE": lambda: _optional_flag("PAGEDLLM_PARALLEL_COMPILE"),
    # Triton's own switch, read here too: "1" runs kernels in Triton's interpreter (CPU tensors).
    # Triton reads it when a kernel module is imported; set it before importing pagedllm.kernels.
    "TRITON_INTERPRET": _flag("TRITON_INTERPRET", False),
    # -- the CPU path --
    # 0: do not build or use the C kernels (cpu/build.py); GGUF weights are dequantized to float32.
    "PAGEDLLM_CPU_KERNELS": _flag("PAGEDLLM_CPU_KERNELS", True),
    # Extra compiler flags for the C kernels, e.g. "-march=x86-64-v3" for a cache shared by machines.
    "PAGEDLLM_CPU_CFLAGS": _str("PAGEDLLM_CPU_CFLAGS", ""),
    # "ctypes" loads the C kernels as a plain shared library even where Python.h exists; "auto"
    # (default) builds a CPython extension module there.
    "PAGEDLLM_CPU_FFI": _str("PAGEDLLM_CPU_FFI", "auto"),
    # 0: run a CPU decode step of a Llama-family GGUF model through the nn.Modules instead of one C
    # call for the whole decoder stack (cpu/decoder.py; the same kernels, bit-identical results).
    "PAGEDLLM_CPU_FUSED_DECODER": _flag("PAGEDLLM_CPU_FUSED_DECODER", True),
    # The C compiler for the C kernels (default: the first of cc, gcc, clang on PATH).
    "CC": _str("CC"),
    # -- caches --
    # 1: modules of the pagedllm package without a valid __pycache__ file (PYTHONDONTWRITEBYTECODE=1, a
    # read-only checkout) keep their compiled code under $PAGEDLLM_CACHE_ROOT/bytecode, read back by the next
    # start (pagedllm/bytecode_cache.py; the command line and the engine's fork server install it; without
    # it the H200 host's engine process compiled every module at every start: BENCHMARKS.md, h50); 0: Python's
    # own behaviour.
    "PAGEDLLM_BYTECODE_CACHE": _flag("PAGEDLLM_BYTECODE_CACHE", True),
    # Root of pagedllm's caches (GGUF-derived configs and tokenizers, built C kernels); default
    # $XDG_CACHE_HOME/pagedllm, else ~/.cache/pagedllm.
    "PAGEDLLM_CACHE_ROOT": _cache_root,
    # Triton's own variable: where compiled kernels are kept. Unset, the engine sets it to
    # $PAGEDLLM_CACHE_ROOT/triton at start (`use_triton_cache_dir`), so the second start of a
    # machine loads every kernel variant instead of compiling it again.
    "TRITON_CACHE_DIR": _str("TRITON_CACHE_DIR"),
    # -- engine --
    # vLLM's VLLM_ENABLE_V1_MULTIPROCESSING: 1 runs AsyncLLM's engine core in its own process, 0 in a
    # thread; unset (None): a process, as vLLM's default (engine/core_client.py).
    "PAGEDLLM_ENABLE_MULTIPROCESSING": _multiprocessing,
    # 1 (default): `pagedllm serve` on one CUDA device starts its engine process before its config is
    # built, with its imports, CUDA initialisation, config and model load overlapping the frontend's
    # (engine/core_proc.py, prestart_engine_process); 0: the engine process starts once the frontend's
    # config is built. On the CPU the server keeps the second order (BENCHMARKS.md, issue 16, h29, h47).
    "PAGEDLLM_PRESTART_ENGINE": _flag("PAGEDLLM_PRESTART_ENGINE", True),
    # 1 (default): a transformers config class imports without `transformers.activations`, `video_utils`
    # or `image_utils` (its type validators get stand-ins for the one name each takes from them:
    # loader/light_validators.py), for a first start's config in both processes (the same
    # config of every preset; about half the import time: BENCHMARKS.md, h50; with torchvision installed
    # 3.5 s more on the H200 host, h64); 0: transformers' own imports.
    "PAGEDLLM_LIGHT_CONFIG_IMPORT": _flag("PAGEDLLM_LIGHT_CONFIG_IMPORT", True),
    # 1 (default): a CUDA engine keeps its memory profile's two measured figures (peak activations, non-torch
    # bytes) under $PAGEDLLM_CACHE_ROOT/memory_profiles, keyed by the GPU, the libraries, pagedllm's source
    # files and the configuration, and a later start with the same key skips the profile's forward
    # (worker/gpu_memory.py; the same KV cache size as a profiled start: BENCHMARKS.md, h50); 0: profile at
    # every start.
    "PAGEDLLM_KEEP_MEMORY_PROFILE": _flag("PAGEDLLM_KEEP_MEMORY_PROFILE", True),
    # N: the engine process profiles its start (cProfile, from its first line to Ready) and logs the N
    # functions of most cumulative and of most own time (engine/core_proc.py); unset: no profile. For
    # start-up timelines only: the profile slows Python-heavy phases.
    "PAGEDLLM_STARTUP_PROFILE": lambda: _positive_int("PAGEDLLM_STARTUP_PROFILE") or 0,
    # Seconds a step's output may be late before the mp / Ray executor counts a rank as hung, kills
    # every rank and fails the engine (executor/multiproc.py). Default 300.
    "PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S": lambda: float(os.environ.get("PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S") or 300),
    # 1: check the block pool's invariants at every schedule() (slow; the test suite sets it).
    "PAGEDLLM_DEBUG_BLOCKS": lambda: os.environ.get("PAGEDLLM_DEBUG_BLOCKS") == "1",
    # Threads of xgrammar's grammar compiler and batch bitmask fill (structured_output/manager.py);
    # unset: half the host's cores, 2 to 8.
    "PAGEDLLM_XGRAMMAR_THREADS": lambda: _positive_int("PAGEDLLM_XGRAMMAR_THREADS"),
    # Where xgrammar advances the grammars and fills the bitmasks: 1 grammar worker processes
    # (structured_output/backend_process.py), 0 or unset a thread of the engine core (fill_thread.py).
    "PAGEDLLM_GRAMMAR_WORKER": lambda: _optional_flag("PAGEDLLM_GRAMMAR_WORKER"),
    # How many grammar worker processes share the constrained rows (a request's grammar lives in
    # one); unset: 2 on a host of 12 or more cores (6 xgrammar threads each unless
    # PAGEDLLM_XGRAMMAR_THREADS says), else 1.
    "PAGEDLLM_GRAMMAR_WORKERS": lambda: _positive_int("PAGEDLLM_GRAMMAR_WORKERS"),
    # Gated sampling under async scheduling (structured_output/gate.py): a constrained step samples
    # with its launch and waits on the device for its bitmask. 1 on; 0 off (the step samples in a call
    # of its own once its bitmask is filled); unset: on when the device is CUDA, off on the CPU
    # (the fillers would take the model's cores).
    "PAGEDLLM_GRAMMAR_GATE": lambda: _optional_flag("PAGEDLLM_GRAMMAR_GATE"),
    # Grammar workers, gated jobs: 1 the engine writes each job into the worker's shared-memory area,
    # which the worker polls (one core each while constrained requests decode, then idle), instead of
    # a pickled message on its socket; 0 or unset the socket (opt-in, with PAGEDLLM_GRAMMAR_GATE=1).
    "PAGEDLLM_GRAMMAR_SPIN": lambda: _optional_flag("PAGEDLLM_GRAMMAR_SPIN"),
    # -- server --
    # An API key the server accepts besides --api-key (vLLM's VLLM_API_KEY).
    "PAGEDLLM_API_KEY": _str("PAGEDLLM_API_KEY"),
    # vLLM's variable for the same: a server started the vLLM way keeps its authentication.
    "VLLM_API_KEY": _str("VLLM_API_KEY"),
    # vLLM's CPU backend variable: GiB of KV cache on the CPU when --cpu-kvcache-space is not
    # given (0 or unset: the default, 4 GiB).
    "VLLM_CPU_KVCACHE_SPACE": _str("VLLM_CPU_KVCACHE_SPACE"),
    # Hugging Face's cache locations, searched for hub ids (loader/hf_cache.py): HF_HUB_CACHE, else
    # $HF_HOME/hub, else ~/.cache/huggingface/hub. Nothing is downloaded.
    "HF_HUB_CACHE": _str("HF_HUB_CACHE"),
    # Hugging Face's home directory; its hub/ subdirectory is the cache when HF_HUB_CACHE is unset.
    "HF_HOME": _str("HF_HOME"),
    # The key `pagedllm bench serve` sends when --api-key is not given (the openai client's variable).
    "OPENAI_API_KEY": _str("OPENAI_API_KEY"),
    # -- tests only --
    # Raise inside the N-th engine step (1-based) of AsyncLLM's engine loop: tests check that a dying
    # engine fails in-flight requests, turns /health to 503 and ends the server. Never set it in use.
    "PAGEDLLM_TEST_FAIL_AT_STEP": _fail_at_step,
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)


@dataclass(frozen=True)
class KernelSwitches:
    """The fast path's switches, read once at start (the worker builds one and hands it to the
    attention backend and the graph capture; gemv keeps one from its import): a step never reads
    the environment."""

    fused_qkv: bool
    fused_decode: bool
    skinny_gemv: bool
    graph_tuning: bool
    parallel_compile: bool = False
    moe_scan: bool = True
    moe_scan_shared: bool = True
    moe_align_rows: bool = True
    moe_sum_in_norm: bool = True


def kernel_switches() -> KernelSwitches:
    get = environment_variables
    return KernelSwitches(
        fused_qkv=get["PAGEDLLM_FUSED_QKV"](),
        fused_decode=get["PAGEDLLM_FUSED_DECODE"](),
        skinny_gemv=get["PAGEDLLM_SKINNY_GEMV"](),
        graph_tuning=get["PAGEDLLM_GRAPH_TUNING"](),
        parallel_compile=bool(get["PAGEDLLM_PARALLEL_COMPILE"]()),  # unset: the prestart's forked pool only
        moe_scan=get["PAGEDLLM_MOE_SCAN"](),
        moe_scan_shared=get["PAGEDLLM_MOE_SCAN_SHARED"](),
        moe_align_rows=get["PAGEDLLM_MOE_ALIGN_ROWS"](),
        moe_sum_in_norm=get["PAGEDLLM_MOE_SUM_IN_NORM"](),
    )


def triton_cache_dir() -> Path:
    """Where Triton's kernel cache is or will be (`use_triton_cache_dir`), changing nothing."""
    user = environment_variables["TRITON_CACHE_DIR"]()
    return Path(user).expanduser() if user else _cache_root() / "triton"


def use_triton_cache_dir() -> Path:
    """Triton's kernel cache directory: the user's TRITON_CACHE_DIR if set, else
    $PAGEDLLM_CACHE_ROOT/triton, which is then written to the environment (Triton reads it at each
    compile; worker processes inherit it). Created if missing. Called once at engine start, before
    any kernel compiles."""
    user = environment_variables["TRITON_CACHE_DIR"]()
    path = triton_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    if not user:
        os.environ["TRITON_CACHE_DIR"] = str(path)
    return path


def child_environment(python_path: str) -> dict[str, str]:
    """This process's environment for a helper process (worker/compile_child.py), handed over
    whole, with `python_path` first on PYTHONPATH so the child imports this same pagedllm."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (python_path, env.get("PYTHONPATH")) if p)
    return env
