"""Logit edits that change which token is the argmax: logit_bias, min_tokens, penalties.

They run before greedy argmax, so they apply to greedy rows too (vLLM v1's order). None of
them reads a device value back to the host: index lists are built on the host and copied in.
"""

from __future__ import annotations

import torch

from pagedllm.host_copy import host_tensor
from pagedllm.sample.metadata import SamplingMetadata, make_tensor_with_pad


def apply_logit_bias(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """logits[r, t] += logit_bias_r[t] for every row that has a bias. In place."""
    if md.logit_bias is None:
        return logits
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for r, bias in enumerate(md.logit_bias):
        if bias:
            rows.extend([r] * len(bias))
            cols.extend(bias.keys())
            vals.extend(bias.values())
    idx = host_tensor([rows, cols], torch.int64, logits.device)
    values = host_tensor(vals, logits.dtype, logits.device)
    return logits.index_put_((idx[0], idx[1]), values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Rows that still owe min_tokens cannot pick a stop token: those logits become -inf. In place."""
    if not md.min_tokens:
        return logits
    rows: list[int] = []
    cols: list[int] = []
    for r, (_, stop_ids) in md.min_tokens.items():
        rows.extend([r] * len(stop_ids))
        cols.extend(stop_ids)
    idx = host_tensor([rows, cols], torch.int64, logits.device)
    # A 0-dim fill made on the device: a Python scalar here would cost a host->device copy.
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put_((idx[0], idx[1]), neg_inf)


def get_token_bin_counts_and_mask(
    tokens: torch.Tensor, vocab_size: int, num_seqs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded (R, L) token ids (pad = vocab_size) -> counts int32 (R, V) and mask bool (R, V).

    [[2, 2, 0, V]] -> counts [[1, 0, 2, 0, ...]], mask [[True, False, True, False, ...]]
    """
    # One extra column swallows the padding, then is dropped.
    bin_counts = torch.zeros((num_seqs, vocab_size + 1), dtype=torch.int32, device=tokens.device)
    bin_counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.int32))
    bin_counts = bin_counts[:, :vocab_size]
    return bin_counts, bin_counts > 0


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor | None,
    frequency_penalties: torch.Tensor | None,
    repetition_penalties: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM's penalties on (R, V) logits; token tensors are padded with V.

    repetition (HF / CTRL style): a token seen in the prompt or the output has its logit divided
    by the penalty when positive, multiplied when not (penalty 1.2: 3.0 -> 2.5, -1.0 -> -1.2).
    frequency: logit -= penalty * (times the token appears in the output).
    presence:  logit -= penalty * (1 if the token appears in the output).
    """
    num_seqs, vocab_size = logits.shape
    output_bin_counts, output_mask = get_token_bin_counts_and_mask(output_token_ids, vocab_size, num_seqs)
    if repetition_penalties is not None:
        assert prompt_token_ids is not None, "repetition penalty needs the prompt tokens"
        _, prompt_mask = get_token_bin_counts_and_mask(prompt_token_ids, vocab_size, num_seqs)
        scale = torch.where(prompt_mask | output_mask, repetition_penalties.unsqueeze(1), 1.0)
        # torch.where, not boolean indexing: a masked assignment would read a count back to the host.
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    if frequency_penalties is not None:
        logits = logits - frequency_penalties.unsqueeze(1) * output_bin_counts
    if presence_penalties is not None:
        logits = logits - presence_penalties.unsqueeze(1) * output_mask
    return logits


def apply_all_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.no_penalties:
        return logits
    output_token_ids = make_tensor_with_pad(md.output_token_ids, md.vocab_size, logits.device)
    return apply_penalties(
        logits,
        md.prompt_token_ids,
        output_token_ids,
        md.presence_penalties,
        md.frequency_penalties,
        md.repetition_penalties,
    )
