"""hidden states -> vocabulary logits through the LM head (gather over TP ranks, drop padding)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.tp import tensor_model_parallel_all_gather
from pagedllm.layers.vocab_embedding import ParallelLMHead


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, scale: float = 1.0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.scale = scale
        self.tp_group = get_tp_group()

    def forward(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states (T', hidden) -> logits (T', vocab_size) in the LM head's output dtype.

        No float32 copy here (vLLM's habit too): the sampler casts where it needs float32, and its
        greedy / Gumbel-max paths read bf16 directly (a (256, 151936) copy costs ~110 us on an H200).
        With a padded head the result is a view with row stride num_embeddings_padded.
        """
        logits = lm_head.quant_method.apply(lm_head, hidden_states, lm_head.bias)
        # Every TP rank gets the whole vocabulary and samples the same token (greedy, or the same
        # seeded draw), so each keeps its own copy of the request state without another message.
        logits = tensor_model_parallel_all_gather(logits, group=self.tp_group)
        # (T', num_embeddings_padded) -> (T', vocab_size): padded rows are not tokens.
        logits = logits[..., : self.vocab_size]
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits
