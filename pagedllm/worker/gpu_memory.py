"""How much GPU memory the KV cache may take: measured, not guessed.

A profiling step runs the largest batch the scheduler can form (max_num_batched_tokens tokens
over up to max_num_seqs requests) through the model, the LM head and the sampler, with a small
temporary KV cache. Its peak activation memory, plus the weights and the non-torch memory this
process added since its device was initialised, is subtracted from gpu_memory_utilization x total
memory; the rest is KV cache.

As in vLLM, gpu_memory_utilization is this engine's own share: memory other processes hold (a
second engine on the same GPU, or the cached blocks of an engine this process let go) is not
counted against it; it only has to be free when the engine starts (`startup_baseline`).
Worked example: 140 GiB GPU, another engine holding 70 GiB, gpu_memory_utilization=0.4: 70 GiB
free >= 56 GiB asked, so this engine starts and gets 56 GiB less its weights and activations.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.distributed.pipeline import dummy_forward_stage
from pagedllm.sample.metadata import RowInputs, SamplingMetadata
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.sample.sampler import Sampler
    from pagedllm.worker.kv_cache import KVCache

logger = logging.getLogger(__name__)

GiB = 1 << 30


def dummy_prefill_layout(num_tokens: int, num_reqs: int, block_size: int) -> tuple[list[int], list[list[int]]]:
    """Split num_tokens over num_reqs prefills and give each its own blocks.

    10 tokens, 3 requests, block_size 4 -> query lens [4, 3, 3], tables [[0], [1], [2]]
    """
    base, extra = divmod(num_tokens, num_reqs)
    q_lens = [base + (1 if i < extra else 0) for i in range(num_reqs)]
    tables, next_block = [], 0
    for q in q_lens:
        n = -(-q // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    return q_lens, tables


def startup_baseline(device: torch.device, gpu_memory_utilization: float) -> int:
    """Memory outside this process's torch allocator when its device is initialised (other
    processes, this process's CUDA context), in bytes: what the profile does not count as this
    engine's. Refuses to start when less than gpu_memory_utilization x total memory is free, as
    vLLM does."""
    free, total = torch.cuda.mem_get_info(device)
    asked = total * gpu_memory_utilization
    if free < asked:
        raise ValueError(
            f"Free memory on device {device} ({free / GiB:.2f}/{total / GiB:.2f} GiB) on startup is less than "
            f"desired GPU memory utilization ({gpu_memory_utilization}, {asked / GiB:.2f} GiB). Decrease "
            "gpu_memory_utilization or reduce GPU memory used by other processes.")
    return (total - free) - torch.cuda.memory_reserved(device)


@torch.inference_mode()
def profile_available_kv_bytes(
    model: torch.nn.Module,
    sampler: Sampler,
    kv_cache: KVCache,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    vocab_size: int,
    max_logprobs: int,
    gpu_memory_utilization: float,
    baseline_non_torch: int = 0,
    kept: Path | None = None,
) -> int:
    """Bytes of GPU memory left for the KV cache (see the module docstring). `kv_cache` is bound
    with a few blocks for the profiling step and released again; `baseline_non_torch` is
    `startup_baseline`'s figure (0 counts every byte outside this allocator as this engine's).
    kept: where this configuration's measurement is kept (`kept_profile_path`): read back instead of
    profiling when there, written after profiling when not."""
    from pagedllm.attention.metadata import build_metadata

    device = kv_cache.device
    measured = load_kept_profile(kept) if kept is not None else None
    if measured is not None:
        torch.cuda.empty_cache()
        free_before, total = torch.cuda.mem_get_info(device)
        allocated_before = torch.cuda.memory_allocated(device)
        peak_activations, non_torch = measured
        return _kv_budget(total, gpu_memory_utilization, allocated_before, non_torch, peak_activations, model,
                          f"kept in {kept}")
    block_size = kv_cache.block_size
    num_tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    num_reqs = min(max_num_seqs, num_tokens)
    q_lens, tables = dummy_prefill_layout(num_tokens, num_reqs, block_size)
    num_tmp_blocks = sum(len(t) for t in tables)

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    allocated_before = torch.cuda.memory_allocated(device)

    kv_cache.allocate(num_tmp_blocks)
    tmp_cache_bytes = torch.cuda.memory_allocated(device) - allocated_before
    t0 = time.monotonic()
    md = build_metadata(q_lens, q_lens, tables, block_size, device)
    rng = np.random.default_rng(0)
    input_ids = torch.from_numpy(rng.integers(0, vocab_size, num_tokens)).to(device)
    positions = torch.cat([torch.arange(q) for q in q_lens]).to(device)
    hidden = dummy_forward_stage(model, input_ids, positions, md)  # None before the last pipeline stage
    logits = None
    if hidden is not None:
        logits = model.compute_logits(hidden[md.query_start_loc[1:].long() - 1])
    torch.cuda.synchronize(device)
    t1 = time.monotonic()  # the start-up log's split: the forward, then the sampler
    if logits is not None:
        # The costliest sampling path: temperature, top-k and top-p (a full sort) and logprobs.
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=max_logprobs)
        rows = [RowInputs(params, [], [], None) for _ in range(num_reqs)]
        sampler(logits, SamplingMetadata.build(rows, vocab_size, device))
    torch.cuda.synchronize(device)
    t2 = time.monotonic()

    peak_activations = torch.cuda.max_memory_allocated(device) - allocated_before - tmp_cache_bytes
    del hidden, logits
    kv_cache.release()
    torch.cuda.empty_cache()
    # Memory outside torch's allocator this engine added since its start (cuBLAS workspaces, NCCL,
    # Triton modules, ...): other processes' memory sits in the baseline.
    non_torch = (total - free_before) - torch.cuda.memory_reserved(device) - baseline_non_torch
    if kept is not None:
        save_kept_profile(kept, peak_activations, non_torch)
    return _kv_budget(total, gpu_memory_utilization, allocated_before, non_torch, peak_activations, model,
                      f"forward {t1 - t0:.2f} s, sampler {t2 - t1:.2f} s")


def _kv_budget(total: int, gpu_memory_utilization: float, allocated_before: int, non_torch: int,
               peak_activations: int, model: torch.nn.Module, how: str) -> int:
    """The KV cache's bytes from the measured figures (module docstring), logged; ValueError when none
    are left."""
    budget = int(total * gpu_memory_utilization)
    available = budget - allocated_before - max(non_torch, 0) - peak_activations
    logger.info(
        "memory profile: total %.1f GiB x %.2f = %.1f GiB; weights %.2f GiB, activations peak %.2f GiB, "
        "non-torch %.2f GiB -> KV cache %.2f GiB (%s)",
        total / GiB, gpu_memory_utilization, budget / GiB, allocated_before / GiB, peak_activations / GiB,
        non_torch / GiB, available / GiB, how,
    )
    if available <= 0:
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                      if t.device.type == "cuda")
        raise ValueError(no_room_message(weights, allocated_before, peak_activations, max(non_torch, 0),
                                         gpu_memory_utilization, total))
    return available


# -- a kept measurement (PAGEDLLM_KEEP_MEMORY_PROFILE=1) ----------------------------------------------
#
# The profile's two measured figures (peak activation bytes, non-torch bytes the forward added) depend
# only on the code and the configuration, not on what else holds the GPU: a start whose key matches
# reads them back from $PAGEDLLM_CACHE_ROOT/memory_profiles/<key>.json and skips the forward and the
# sampler (the warm-up meets their kernels instead). The key names the GPU, torch / CUDA / Triton, every
# source file of pagedllm (path, size, mtime), the model's parameter shapes and dtypes, the KV layout
# and the batch limits (Worker._memory_profile_key).


def source_fingerprint() -> str:
    """A digest of pagedllm's own source files (path, size, mtime): any edit changes it."""
    import hashlib
    import os

    import pagedllm

    root = os.path.dirname(os.path.abspath(pagedllm.__file__))
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".c", ".h", ".json")):
                st = os.stat(os.path.join(folder, name))
                h.update(f"{os.path.relpath(os.path.join(folder, name), root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def kept_profile_path(key_parts: list[object]) -> Path:
    import hashlib
    import json

    from pagedllm import envs

    digest = hashlib.sha256(json.dumps([str(p) for p in key_parts]).encode()).hexdigest()[:24]
    return envs.PAGEDLLM_CACHE_ROOT / "memory_profiles" / f"{digest}.json"


def load_kept_profile(path: Path) -> tuple[int, int] | None:
    """(peak activation bytes, non-torch bytes) kept at `path`, or None (none kept, unreadable)."""
    import json

    try:
        data = json.loads(path.read_text())
        peak, non_torch = int(data["peak_activations"]), int(data["non_torch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (peak, non_torch) if peak >= 0 else None


def save_kept_profile(path: Path, peak_activations: int, non_torch: int) -> None:
    """Written atomically; a cache that cannot be written costs the next start its forward only."""
    import json
    import os
    import tempfile

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"peak_activations": int(peak_activations), "non_torch": int(non_torch)}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def no_room_message(weights: int, allocated: int, activations: int, non_torch: int, utilization: float,
                    total: int) -> str:
    """Why the KV cache got no memory, naming what holds it. `allocated` is everything this
    process held in torch's allocator before profiling: the weights, and anything else still alive
    (another engine's KV cache, the caller's tensors). Sizes in bytes."""
    other = max(allocated - weights, 0)
    parts = [f"weights {weights / GiB:.2f} GiB"]
    if other >= GiB:
        parts.append(f"other tensors already allocated in this process {other / GiB:.2f} GiB (is an earlier "
                     "engine still referenced? `del llm; gc.collect()` frees one)")
    parts.append(f"activations {activations / GiB:.2f} GiB")
    if non_torch >= GiB:
        parts.append(f"memory this engine holds outside torch's allocator {non_torch / GiB:.2f} GiB (cuBLAS "
                     "workspaces, NCCL, libraries)")
    return (f"No GPU memory is left for the KV cache: {', '.join(parts)} already exceed gpu_memory_utilization="
            f"{utilization} of {total / GiB:.1f} GiB. Raise gpu_memory_utilization or lower "
            "max_num_batched_tokens.")
