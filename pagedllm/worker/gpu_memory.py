"""How much GPU memory the KV cache may take: measured, not guessed.

A profiling step runs the largest batch the scheduler can form (max_num_batched_tokens tokens
over up to max_num_seqs requests) through the model, the LM head and the sampler, with a small
temporary KV cache. Its peak activation memory, plus the weights and whatever non-torch memory
the process holds, is subtracted from gpu_memory_utilization x total memory; the rest is KV cache.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

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
) -> int:
    """Bytes of GPU memory left for the KV cache (see the module docstring). `kv_cache` is bound
    with a few blocks for the profiling step and released again."""
    from pagedllm.attention.metadata import build_metadata

    device = kv_cache.device
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
    md = build_metadata(q_lens, q_lens, tables, block_size, device)
    rng = np.random.default_rng(0)
    input_ids = torch.from_numpy(rng.integers(0, vocab_size, num_tokens)).to(device)
    positions = torch.cat([torch.arange(q) for q in q_lens]).to(device)
    hidden = model(input_ids, positions, md)
    logits = model.compute_logits(hidden[md.query_start_loc[1:].long() - 1])
    # The costliest sampling path: temperature, top-k and top-p (a full sort) and logprobs.
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=max_logprobs)
    rows = [RowInputs(params, [], [], None) for _ in range(num_reqs)]
    sampler(logits, SamplingMetadata.build(rows, vocab_size, device))
    torch.cuda.synchronize(device)

    peak_activations = torch.cuda.max_memory_allocated(device) - allocated_before - tmp_cache_bytes
    del hidden, logits
    kv_cache.release()
    torch.cuda.empty_cache()
    # Memory outside torch's allocator (CUDA context, cuBLAS workspaces, NCCL, ...).
    non_torch = (total - free_before) - torch.cuda.memory_reserved(device)
    budget = int(total * gpu_memory_utilization)
    available = budget - allocated_before - max(non_torch, 0) - peak_activations
    logger.info(
        "memory profile: total %.1f GiB x %.2f = %.1f GiB; weights %.2f GiB, activations peak %.2f GiB, "
        "non-torch %.2f GiB -> KV cache %.2f GiB",
        total / GiB, gpu_memory_utilization, budget / GiB, allocated_before / GiB, peak_activations / GiB,
        non_torch / GiB, available / GiB,
    )
    if available <= 0:
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                      if t.device.type == "cuda")
        raise ValueError(no_room_message(weights, allocated_before, peak_activations, max(non_torch, 0),
                                         gpu_memory_utilization, total))
    return available


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
        parts.append(f"memory outside this process's torch allocator {non_torch / GiB:.2f} GiB (CUDA context, "
                     "libraries, other processes)")
    return (f"No GPU memory is left for the KV cache: {', '.join(parts)} already exceed gpu_memory_utilization="
            f"{utilization} of {total / GiB:.1f} GiB. Raise gpu_memory_utilization or lower "
            "max_num_batched_tokens.")
