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
from typing import TYPE_CHECKING

import torch

from pagedllm.attention.metadata import build_metadata
from pagedllm.sample.metadata import RowInputs, SamplingMetadata
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _dummy_step(runner: ModelRunner, query_lens: list[int], seq_lens: list[int]) -> None:
    bs = runner.block_size
    tables = [[0] * -(-s // bs) for s in seq_lens]  # every position reads block 0
    md = build_metadata(query_lens, seq_lens, tables, bs, device=runner.device)
    md.slot_mapping.fill_(-1)  # write nothing
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]).to(runner.device)
    input_ids = torch.zeros_like(positions)
    hidden = runner.model(input_ids, positions, md)
    last = md.query_start_loc[1:].long() - 1
    logits = runner.model.compute_logits(hidden[last])
    rows = [
        RowInputs(params=SamplingParams(temperature=1.0 if r % 2 == 0 else 0.0), prompt_token_ids=[0],
                  output_token_ids=[])
        for r in range(len(query_lens))
    ]
    runner.sampler(logits, SamplingMetadata.build(rows, runner.vocab_size, runner.device))
    # A batch asking for logprobs samples from a float32 copy: that variant too.
    rows[0] = RowInputs(params=SamplingParams(temperature=1.0, logprobs=1), prompt_token_ids=[0], output_token_ids=[])
    runner.sampler(logits, SamplingMetadata.build(rows, runner.vocab_size, runner.device))


@torch.inference_mode()
def warmup_kernels(runner: ModelRunner) -> None:
    """Run the dummy steps above on a CUDA runner whose KV cache is bound; no-op elsewhere."""
    if runner.device.type != "cuda" or not runner.kv_caches:
        return
    t0 = time.monotonic()
    bs = runner.block_size
    max_len = runner.config.model_config.max_model_len
    budget = runner.config.scheduler_config.max_num_batched_tokens
    n = min(2 * bs + 3, max(budget - 1, 1), max_len - 1)
    if n >= 1:
        _dummy_step(runner, [n, 1], [n, min(n + 2, max_len)])
    # A full token budget once: cuBLAS loads its large-M kernels and the allocator grows to the
    # activations of a full prefill step here, not in the first busy step of serving.
    full = min(budget - 1, max_len - 1)
    if full > n:
        _dummy_step(runner, [full, 1], [full, min(full + 2, max_len)])
    _dummy_step(runner, [1, 1], [1, min(bs + 1, max_len)])
    _dummy_step(runner, [1], [max_len])
    # The LM head runs outside the CUDA graphs at every batch size; its few-row kernels
    # (kernels/gemv.py) compile per row-count class, so run each class once.
    hidden = torch.zeros((8, runner.model.config.hidden_size), dtype=runner.dtype, device=runner.device)
    for m in (1, 2, 3, 4, 5, 8):
        runner.model.compute_logits(hidden[:m])
    torch.cuda.synchronize(runner.device)
    logger.info("kernel warm-up (eager prefill/decode variants) took %.1f s", time.monotonic() - t0)
