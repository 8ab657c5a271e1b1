"""Compile the start-up's Triton kernel variants all at once, in parallel (a cold start's JIT).

On a machine whose Triton cache is empty, every kernel variant the warm-up and the CUDA-graph
capture meet is compiled when it is first launched, one after another (Triton's front end, MLIR
passes, LLVM, ptxas: a fraction of a second to over a second each). Here the variants are found
first and compiled together:

    1. collect   run the forward passes the memory profile, the warm-up and the graph capture will
                 run, with Triton's `jit_cache_hook` answering "handled" for every variant not
                 compiled yet: Triton then neither compiles nor launches it, and the hook keeps the
                 variant's specialization data (Triton's own serialised form of one variant).
    2. compile   the variants in compile processes (worker/compile_child.py, started at
                 Worker.init_device so their imports overlap the model load): Triton holds the GIL
                 for most of a compile, so threads of one process barely overlap (measured on
                 the CPU here: 4 threads took 1.8x the serial time). Each process compiles its
                 share into the shared TRITON_CACHE_DIR through `JITFunction.preload` (Triton's
                 entry point for compiling a serialised variant).
    3. load      this process preloads every variant in a thread pool: each is found on disk and
                 loaded onto the device. What a process failed to compile is compiled here.
    4. The real profile, warm-up and capture follow and find the variants compiled.

The collect pass computes garbage: a kernel that is skipped leaves its output tensor unwritten.
That is safe only where no value computed in the pass is used as an index: in a dense model the
indices (token ids, positions, slots, block tables) are the dummy inputs, so garbage only flows
into arithmetic; the sampler (which gathers by sampled ids) is not run whole, its Triton kernel is
called on its own, and a model with routed experts (expert ids come from the router's output) is not
precompiled at all.

Anything Triton does not support here (another version's hook arguments, a variant that fails in
`preload`) falls back to the old way: that variant compiles when it is first launched.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedllm.worker import compile_pool
from pagedllm.worker.compile_pool import close_compile_pool
from pagedllm.worker.gpu_memory import dummy_prefill_layout
from pagedllm.worker.warmup import WarmupShape, _dummy_step, warmup_kernels

if TYPE_CHECKING:
    from pagedllm.worker.cuda_graphs import CudaGraphRunner
    from pagedllm.worker.kv_cache import KVCache

logger = logging.getLogger(__name__)

_MAX_THREADS = 16


def can_precompile(model: torch.nn.Module, device: torch.device) -> bool:
    """A CUDA model without routed experts (see the module doc)."""
    if device.type != "cuda":
        return False
    from pagedllm.layers.fused_moe.layer import FusedMoE

    return not any(isinstance(m, FusedMoE) for m in model.modules())


def collect_variants(run_forwards: Callable[[], None]) -> dict[str, object]:
    """Run `run_forwards` with every not-yet-compiled Triton launch recorded instead of compiled and
    run: specialization data -> its JITFunction. Empty when this Triton has no such hook."""
    from triton import knobs

    found: dict[str, object] = {}
    previous = knobs.runtime.jit_cache_hook

    def hook(**kwargs):
        try:
            spec = kwargs["compile"]["specialization_data"]
            found.setdefault(spec, kwargs["fn"].jit_function)
        except (KeyError, AttributeError, TypeError):
            return None  # an unknown hook shape: let Triton compile and launch as usual
        return True  # "handled": Triton skips the compile and the launch

    knobs.runtime.jit_cache_hook = hook
    try:
        run_forwards()
    finally:
        knobs.runtime.jit_cache_hook = previous
    return found


def _compile_in_processes(found: dict[str, object]) -> None:
    """Compile what the pool can import into the disk cache (the parent's preload then reads it)."""
    pool = compile_pool.current()
    if pool is None:
        return
    items = [(fn.fn.__module__, fn.fn.__qualname__, spec) for spec, fn in found.items()
             if "<locals>" not in fn.fn.__qualname__]
    t0 = time.monotonic()
    try:
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        failed = pool.compile(items, index, major * 10 + minor)
        logger.info("Triton compile processes (%d): %d variants in %.1f s, %d failed (compiled here instead)",
                    len(pool.children), len(items), time.monotonic() - t0, failed)
    except Exception as e:  # noqa: BLE001 - the parent compiles whatever is missing
        logger.info("Triton compile processes failed (%s); compiling in this process", e)
    finally:
        close_compile_pool()


def compile_variants(found: dict[str, object], device: torch.device, threads: int | None = None) -> int:
    """Compile every collected variant (in the compile processes when started, then load them here
    in a thread pool); -> how many failed (they compile later, when first launched)."""
    if not found:
        close_compile_pool()
        return 0
    _compile_in_processes(found)

    index = device.index if device.index is not None else torch.cuda.current_device()

    def one(spec: str, jit_function) -> None:
        torch.cuda.set_device(index)  # a new thread starts on device 0
        kernel = jit_function.preload(spec)
        # Load it onto the device and build its launcher here too (Triton versions that build a C
        # launcher per signature run a C compiler for it), not at its first launch.
        init = getattr(kernel, "_init_handles", None)
        if init is not None:
            init()

    threads = threads or min(_MAX_THREADS, os.cpu_count() or 1, len(found))
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool:
        futures = [pool.submit(one, spec, fn) for spec, fn in found.items()]
        for future in futures:
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 - any failure only means "compile it later"
                failed += 1
                logger.debug("parallel compile of a Triton variant failed (compiled later instead): %s", e)
    return failed


@torch.inference_mode()
def precompile(run_forwards: Callable[[], None], device: torch.device) -> None:
    """Collect the variants `run_forwards` launches, then compile them in parallel (module doc)."""
    t0 = time.monotonic()
    try:
        found = collect_variants(run_forwards)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - e.g. a Triton whose run() does not honour the hook
        logger.warning("parallel Triton compile skipped (%s: %s); kernels compile when first launched",
                       type(e).__name__, e)
        close_compile_pool()
        return
    t1 = time.monotonic()
    failed = compile_variants(found, device)
    logger.info("Triton variants: %d found in %.1f s, compiled in parallel in %.1f s (%d left to compile on "
                "first launch)", len(found), t1 - t0, time.monotonic() - t1, failed)


def precompile_startup(model: torch.nn.Module, kv_cache: KVCache, graphs: CudaGraphRunner | None,
                       shape: WarmupShape, max_num_seqs: int, dtype: torch.dtype) -> None:
    """Every variant of the start-up, compiled in parallel before any of it runs: the memory
    profile's step (max_num_batched_tokens over max_num_seqs prefills), the warm-up's steps and one
    forward pass per CUDA-graph size. Run before the memory profile, when the KV cache is not bound
    yet, a temporary cache of 16 blocks is bound for the pass (every dummy table reads block 0, and
    the kernels do not specialise on the cache's size) and released."""
    device = kv_cache.device
    num_tokens = min(shape.max_num_batched_tokens, max_num_seqs * shape.max_model_len)
    q_lens, _ = dummy_prefill_layout(num_tokens, min(max_num_seqs, num_tokens), shape.block_size)

    def forwards() -> None:
        _dummy_step(model, None, device, shape, q_lens, q_lens, sample=False)  # the memory profile's step
        warmup_kernels(model, None, device, dtype, shape, sample=False)
        if graphs is not None:
            graphs.dry_run()
        # The sampler's kernel as the warm-up's steps call it (1 and 2 rows, logits in the model's
        # dtype and in float32), called directly: its output is never used as an index here.
        from pagedllm.kernels.sampling import gumbel_argmax

        for rows in (1, 2):
            for logits_dtype in {dtype, torch.float32}:
                logits = torch.zeros((rows, shape.vocab_size), dtype=logits_dtype, device=device)
                gumbel_argmax(logits, torch.ones(rows, device=device), 0)

    temporary = not kv_cache.tensors
    if temporary:
        kv_cache.allocate(16)
    try:
        precompile(forwards, device)
    finally:
        if temporary:
            kv_cache.release()
            torch.cuda.empty_cache()


def warm_marker(key_parts: list[object]) -> Path:
    """A file in the Triton cache directory that says "every variant of this start-up is in this
    cache" (written after a start completes): with it the next start skips the collect pass and
    the compile processes, and loads each variant from disk when first launched. Inside the cache
    directory, so clearing the cache clears the marker. key_parts name what the variants depend
    on (worker.py: versions, the kernels' source, the model's parameters, the batch shapes)."""
    from pagedllm import envs

    kernels = Path(__file__).resolve().parent.parent / "kernels"
    source = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(kernels.glob("*.py")))).hexdigest()
    digest = hashlib.sha256(json.dumps([source, *map(str, key_parts)]).encode()).hexdigest()[:24]
    return Path(envs.use_triton_cache_dir()) / "pagedllm-warm" / digest
