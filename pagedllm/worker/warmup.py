"""Compile the GPU kernels of the eager path at start-up, before the first request (vLLM's
warm-up dummy runs).

Triton compiles a kernel variant the first time it meets a new combination of compile-time
constants, so the first mixed prefill + decode step of a run used to stop for ~1 s of JIT (and a
long-context decode outside the CUDA graphs for another). `warmup_kernels` runs three dummy steps
that reach every variant the engine launches outside CUDA graphs for this model:

    mixed   request 0 prefills 2 * block_size + 3 tokens (then the whole token budget), request 1
            decodes beside it
    decode  two requests of one token each (the decode-only variant, as eager decode uses it)
    split   one request with a long context (the split-K decode variant and its merge kernel)

and samples a random and a greedy row, from the model-dtype logits and from a float32 copy
(a batch with logprobs). Every K/V write is skipped (slot -1) and reads go to
block 0 of the (zero-initialised) cache, so no request's state is touched. Arguments that change
from step to step (token and request counts, the block table's width, seeds) are excluded from
Triton's value specialisation in the kernels, so these shapes stand for all others.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagedllm.attention.metadata import build_metadata
from pagedllm.distributed.pipeline import dummy_forward_stage
from pagedllm.models.utils import PPMissingLayer
from pagedllm.sample.metadata import RowInputs, SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupShape:
    """The sizes the dummy steps are cut to."""

    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    vocab_size: int
    hidden_size: int
    max_num_seqs: int = 1


def _dummy_step(model: torch.nn.Module, sampler: Sampler | None, device: torch.device, shape: WarmupShape,
                query_lens: list[int], seq_lens: list[int], sample: bool = True) -> None:
    bs = shape.block_size
    tables = [[0] * -(-s // bs) for s in seq_lens]  # every position reads block 0
    md = build_metadata(query_lens, seq_lens, tables, bs, device=device)
    md.slot_mapping.fill_(-1)  # write nothing
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]).to(device)
    input_ids = torch.zeros_like(positions)
    hidden = dummy_forward_stage(model, input_ids, positions, md)
    if hidden is None:  # a pipeline stage before the last: no LM head, no sampling here
        return
    last = md.query_start_loc[1:].long() - 1
    logits = model.compute_logits(hidden[last])
    if not sample or sampler is None:
        return
    rows = [
        RowInputs(params=SamplingParams(temperature=1.0 if r % 2 == 0 else 0.0), prompt_token_ids=[0],
                  output_token_ids=[])
        for r in range(len(query_lens))
    ]
    sampler(logits, SamplingMetadata.build(rows, shape.vocab_size, device))
    # A batch asking for logprobs samples from a float32 copy: that variant too.
    rows[0] = RowInputs(params=SamplingParams(temperature=1.0, logprobs=1), prompt_token_ids=[0], output_token_ids=[])
    sampler(logits, SamplingMetadata.build(rows, shape.vocab_size, device))
    # And top-k / top-p (a full sort): the memory profile runs that path too, but a kept profile does not
    # run at all (worker/gpu_memory.py).
    rows[0] = RowInputs(params=SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=1), prompt_token_ids=[0],
                        output_token_ids=[])
    sampler(logits, SamplingMetadata.build(rows, shape.vocab_size, device))
    # And constrained rows: the fused kernel's masked variant (sampled rows, no logprobs) and the in-place
    # mask (rows with logprobs), under a bitmask allowing every token. Loaded here, a gated step's sampling
    # launch never loads a kernel lazily: a first load may synchronize the device, which by then waits
    # for the bitmask (BENCHMARKS.md, issue 22: the pre-h52 order hung there).
    allow_all = torch.full((len(rows), -(-logits.shape[1] // 32)), -1, dtype=torch.int32, device=device)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, logprobs=1)):
        rows[0] = RowInputs(params=params, prompt_token_ids=[0], output_token_ids=[])
        sampler(logits, SamplingMetadata.build(rows, shape.vocab_size, device), grammar_bitmask=allow_all)


@torch.inference_mode()
def warmup_kernels(model: torch.nn.Module, sampler: Sampler | None, device: torch.device, dtype: torch.dtype,
                   shape: WarmupShape, sample: bool = True, profile_step: bool = False) -> None:
    """Run the dummy steps above on a CUDA model whose KV cache is bound; a no-op elsewhere.
    sample=False: the forward passes only (worker/precompile.py's collect pass). profile_step: also
    the memory profile's layout (many short prefills: max_num_batched_tokens over max_num_seqs
    requests), cut to 16 requests (at most) of the same length, for a start whose profile was kept and not run
    (worker/gpu_memory.py): its variants load here, not in the first such step of serving."""
    if device.type != "cuda":
        return
    t0 = time.monotonic()
    bs = shape.block_size
    max_len = shape.max_model_len
    budget = shape.max_num_batched_tokens

    def step(query_lens: list[int], seq_lens: list[int]) -> None:
        _dummy_step(model, sampler, device, shape, query_lens, seq_lens, sample)

    n = min(2 * bs + 3, max(budget - 1, 1), max_len - 1)
    if n >= 1:
        step([n, 1], [n, min(n + 2, max_len)])
    # A full token budget once: cuBLAS loads its large-M kernels and the allocator grows to the
    # activations of a full prefill step here, not in the first busy step of serving.
    full = min(budget - 1, max_len - 1)
    if full > n:
        step([full, 1], [full, min(full + 2, max_len)])
    step([1, 1], [1, min(bs + 1, max_len)])
    step([1], [max_len])
    if profile_step:
        tokens = min(budget, shape.max_num_seqs * max_len)
        per_request = tokens // max(min(shape.max_num_seqs, tokens), 1)  # the profile's prompt length
        reqs = min(16, shape.max_num_seqs)  # within the token budget: reqs * per_request <= tokens
        step([per_request] * reqs, [per_request] * reqs)
    # The LM head runs outside the CUDA graphs at every batch size; its few-row kernels
    # (kernels/gemv.py) compile per row-count class, so run each class once.
    hidden = torch.zeros((8, shape.hidden_size), dtype=dtype, device=device)
    for m in (1, 2, 3, 4, 5, 8) if not isinstance(getattr(model, "lm_head", None), PPMissingLayer) else ():
        model.compute_logits(hidden[:m])
    torch.cuda.synchronize(device)
    if sample:
        logger.info("kernel warm-up (eager prefill/decode variants) took %.1f s", time.monotonic() - t0)
