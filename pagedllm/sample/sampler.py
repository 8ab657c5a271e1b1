"""The batched sampler: (R, V) logits + SamplingMetadata -> one token per row (+ logprobs).

Order, as in vLLM v1:
  1. raw logprobs = log_softmax(logits)        (only if a row asked; the model's distribution)
  2. logit_bias, 3. min_tokens (stop ids -> -inf), 4. penalties (repetition, frequency, presence)
  5. greedy rows: argmax                        (all-greedy batch stops here: no softmax, no sort)
  6. temperature, 7. min_p, 8. top_k / top_p, 9. softmax + the draw (exponential race on a GPU,
     inverse CDF on the CPU: topk_topp.random_sample)
  10. logprobs of the sampled token, its rank and the batch's top-k, all from step 1

Logits arrive in the model's dtype (bf16 / fp16 on a GPU: the LM head's output, not copied).
They become float32 only where float32 changes the answer or the math needs it: logprobs, the
edits of steps 2-4, and the torch sampling path. Greedy argmax and the fused Gumbel-max kernel
read them as they are (bf16 -> fp32 is exact, so the ids are those of the float32 copy).

Everything stays on the logits' device; the only host read is the caller's, once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from pagedllm.cpu.build import load_cpu_kernels
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.penalties import apply_all_penalties, apply_logit_bias, apply_min_tokens
from pagedllm.sample.token_masks import apply_allowed_token_ids, apply_bad_words
from pagedllm.sample.topk_topp import apply_min_p, apply_top_k_top_p, random_sample
from pagedllm.sampling_params import _SAMPLING_EPS


class LogprobsTensors(NamedTuple):
    """Column 0 is the sampled token, columns 1..k the k most likely tokens (k = max_num_logprobs).

    Rows that asked for fewer than k keep their first 1 + n columns.
    """

    logprob_token_ids: torch.Tensor  # int64 (R, k + 1)
    logprobs: torch.Tensor  # float32 (R, k + 1)
    selected_token_ranks: torch.Tensor  # int64 (R,): 1 + number of tokens with a strictly higher logprob

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """Host lists (one device->host copy per tensor)."""
        return (
            self.logprob_token_ids.tolist(),
            self.logprobs.tolist(),
            self.selected_token_ranks.tolist(),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 (R,)
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1): on float32 CPU rows one vectorized C pass (torch's single-threaded
    argmax over (16, 49152) takes ~1.5 ms); same result, first index of the max, NaN the largest."""
    if logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1:
        lib = load_cpu_kernels()
        if lib is not None and logits.shape[1] > 0:
            out = torch.empty(logits.shape[0], dtype=torch.int64)
            lib.argmax_rows(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr())
            return out
    return logits.argmax(dim=-1)


def _fused(logits: torch.Tensor, md: SamplingMetadata) -> bool:
    """Whether `Sampler.sample` takes the fused Gumbel-max kernel: CUDA, some row sampled, rows
    with neither top-k, top-p, min-p nor a per-request seed."""
    return (logits.is_cuda and not md.all_greedy and not md.generators and md.min_p is None and md.top_k is None
            and md.top_p is None)


class Sampler(nn.Module):
    """Stateless; forward may overwrite `logits` in place (as vLLM's does) to save (R, V) copies."""

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata,
                grammar_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """grammar_bitmask: int32 (R, ceil(V / 32)) on a CUDA device, one row per logits row
        (structured outputs, every row constrained): applied before step 1, or by the fused sampling
        kernel when nothing before it reads the logits (one launch fewer: BENCHMARKS.md, issue 22)."""
        md = sampling_metadata
        if logits.dim() != 2 or logits.shape[0] != md.num_reqs or logits.shape[1] != md.vocab_size:
            raise ValueError(
                f"logits must be (num_reqs={md.num_reqs}, vocab_size={md.vocab_size}), "
                f"got {tuple(logits.shape)}."
            )
        edits = md.logit_bias is not None or md.min_tokens or not md.no_penalties or md.allowed_token_ids or md.bad_words
        if grammar_bitmask is not None and (md.max_num_logprobs is not None or edits or not _fused(logits, md)):
            from pagedllm.kernels.grammar_bitmask import apply_bitmask_inplace

            logits = apply_bitmask_inplace(logits if logits.stride(1) == 1 else logits.contiguous(), grammar_bitmask, None)
            grammar_bitmask = None
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            # One float32 copy, shared by the logprobs and whatever follows.
            logits = logits.to(torch.float32)
            raw_logprobs = self.compute_logprobs(logits)
        if edits:
            # In float32: a bias of 0.3 or a penalty of 1.1 would be rounded to bf16's 8 bits.
            logits = logits.to(torch.float32)
            logits = apply_logit_bias(logits, md)
            logits = apply_min_tokens(logits, md)
            logits = apply_all_penalties(logits, md)
            logits = apply_allowed_token_ids(logits, md.allowed_token_ids)
            logits = apply_bad_words(logits, md.bad_words, md.output_token_ids)
        sampled = self.sample(logits, md, grammar_bitmask)
        logprobs_tensors = None
        if raw_logprobs is not None:
            assert md.max_num_logprobs is not None
            logprobs_tensors = self.gather_logprobs(raw_logprobs, md.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs_tensors)

    @staticmethod
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(dim=-1, dtype=torch.float32)

    @staticmethod
    def sample(logits: torch.Tensor, md: SamplingMetadata, grammar_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """(R, V) logits in any float dtype -> int64 (R,). May overwrite float32 `logits`.
        grammar_bitmask: only where `_fused` holds (the fused kernel applies it)."""
        if md.all_greedy:
            assert grammar_bitmask is None
            return greedy_argmax(logits)
        if _fused(logits, md):
            # Temperature only (plus greedy rows): one fused Gumbel-max pass over the logits, in
            # their own dtype. The seed comes from torch's CPU generator: no device sync.
            from pagedllm.kernels.sampling import gumbel_argmax

            return gumbel_argmax(logits, md.temperature, int(torch.randint(2**31 - 1, (1,)).item()),
                                 bitmask=grammar_bitmask)
        assert grammar_bitmask is None
        logits = logits.to(torch.float32)
        greedy_sampled = None if md.all_random else greedy_argmax(logits)
        is_greedy = md.temperature < _SAMPLING_EPS  # (R,) bool, device-side
        # Greedy rows are replaced by their argmax below; divide them by 1, not by 0.
        temperature = md.temperature if md.all_random else md.temperature.masked_fill(is_greedy, 1.0)
        logits = logits.div_(temperature.unsqueeze(1))
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k, md.all_rows_top_k)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        random_sampled = random_sample(probs, md.generators)
        if greedy_sampled is None:
            return random_sampled
        return torch.where(is_greedy, greedy_sampled, random_sampled)

    @staticmethod
    def gather_logprobs(
        logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
    ) -> LogprobsTensors:
        """(R, V) logprobs, sampled ids (R,) -> LogprobsTensors with k = num_logprobs columns of top-k."""
        token_ids = token_ids.unsqueeze(1)  # (R, 1)
        token_logprobs = logprobs.gather(1, token_ids)  # (R, 1)
        ranks = (logprobs > token_logprobs).sum(dim=-1) + 1  # (R,)
        if num_logprobs > 0:
            topk_logprobs, topk_ids = logprobs.topk(num_logprobs, dim=-1)
            token_ids = torch.cat((token_ids, topk_ids), dim=1)
            token_logprobs = torch.cat((token_logprobs, topk_logprobs), dim=1)
        return LogprobsTensors(token_ids, token_logprobs, ranks)
