"""Truncation (min_p, top_k, top_p) and the random draw, on temperature-scaled (R, V) logits.

Truncated tokens get -inf, so they keep probability 0 in the final softmax. Every function
writes into `logits` and returns it; none reads a device value back to the host.
"""

from __future__ import annotations

import torch


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (probability of the most likely token).

    probs [0.5, 0.3, 0.15, 0.05], min_p 0.2 -> threshold 0.1 -> the 0.05 token is dropped.
    A row with min_p 0 keeps everything (no probability is < 0).
    """
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """top_k without a full sort: one topk(max_top_k) gives each row's k-th largest logit.

    k holds vocab_size for rows without a limit; `max_top_k` is the host copy of the largest
    real k, so topk's size never comes from the device. Ties with the k-th value are kept.
    """
    vocab_size = logits.shape[1]
    top_values = logits.topk(max_top_k, dim=1).values  # (R, max_top_k), descending
    kth = top_values.gather(1, (k.clamp(max=max_top_k) - 1).unsqueeze(1))  # (R, 1)
    kth.masked_fill_((k >= vocab_size).unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    max_top_k: int,
    all_rows_top_k: bool = False,
) -> torch.Tensor:
    """vLLM's top-k / top-p: one ascending sort, mask in sorted order, scatter back.

    top_p keeps the smallest set of most likely tokens whose mass reaches p, and always the
    most likely one: sorted probs [0.1, 0.2, 0.3, 0.4], p 0.6 -> cumsum [0.1, 0.3, 0.6, 1.0];
    drop cumsum <= 1 - p = 0.4 -> keeps 0.3 and 0.4.

    `all_rows_top_k` (every sampled row has a top_k) lets top-p work on the max_top_k
    candidates alone instead of sorting the whole vocabulary.
    """
    if p is None:
        if k is None:
            return logits
        return apply_top_k_only(logits, k, max_top_k)
    if k is not None and all_rows_top_k:
        return _apply_top_k_top_p_bounded(logits, k, p, max_top_k)
    vocab_size = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        # k = vocab_size (no limit) points at column 0, the smallest logit: nothing is dropped.
        kth = logits_sort.gather(1, (vocab_size - k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
    top_p_mask = probs_sum <= 1 - p.unsqueeze(1)
    top_p_mask[:, -1] = False  # the most likely token always stays
    logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return logits.scatter_(1, logits_idx, logits_sort)


def _apply_top_k_top_p_bounded(
    logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, max_top_k: int
) -> torch.Tensor:
    """top-k then top-p on the (R, max_top_k) best candidates; every other token gets -inf.

    Same rule as the sort path, read in descending order: a token stays when the mass of the
    tokens above it is < p (sorted probs [0.4, 0.3, 0.2, 0.1], p 0.6 -> mass above
    [0, 0.4, 0.7, 0.9] -> keeps 0.4 and 0.3). One difference: ties with the k-th logit are cut
    to exactly k here, where the sort path keeps them all. Rows with k = vocab_size (greedy rows,
    whose pick is replaced by their argmax) keep the max_top_k candidates.
    """
    values, indices = logits.topk(max_top_k, dim=1)  # (R, K), descending
    positions = torch.arange(max_top_k, device=logits.device)
    values.masked_fill_(positions >= k.unsqueeze(1), float("-inf"))
    probs = values.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    values.masked_fill_(mass_above >= p.unsqueeze(1), float("-inf"))  # column 0 (mass 0) always stays
    return logits.fill_(float("-inf")).scatter_(1, indices, values)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row with probability probs[row, token]: (R, V) -> int64 (R,).

    A seeded row (a key of `generators`) draws only from its own generator, so its tokens depend
    only on its seed and its own probabilities, not on the batch around it or on its row index.
    On a GPU: the exponential race (parallel, no cumsum); on the CPU: the inverse CDF, which needs
    one random number per row instead of one per token (a few times faster there: BENCHMARKS.md).
    The two draw different tokens from the same seed.
    """
    if probs.is_cuda:
        return _exponential_race(probs, generators)
    return _inverse_cdf(probs, generators)


def _uniform_rows(out: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Fill `out` (R, ...) with U[0, 1): row i from generators[i] when it has one, the other rows
    from torch's default generator (skipped when every row is seeded)."""
    if len(generators) != out.shape[0]:
        out.uniform_()
    for i, generator in generators.items():
        out[i].uniform_(generator=generator)
    return out


def _exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1) i.i.d.; overwrites `probs`.

    P(argmax = i) = probs_i (the race is won by the smallest q_i / probs_i, an Exp(probs_i)
    variable), and it needs no cumsum and no host sync. A seeded row draws its whole q row from
    its own generator. q = -log(u), u ~ U[0, 1): the same Exp(1) as exponential_(), faster.
    q > 0 always (u < 1); u = 0 gives q = inf, so that token scores 0, never NaN.
    """
    q = _uniform_rows(torch.empty_like(probs), generators)
    q.log_().neg_()
    return probs.div_(q).argmax(dim=-1)


def _inverse_cdf(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u * total, u ~ U[0, 1) per row.

    probs [0.5, 0.0, 0.3, 0.2] -> cumulative [0.5, 0.5, 0.8, 1.0]; u = 0.6 -> token 2. Summed in
    float64, so u * total < total exactly and the search always lands on a token; a token of
    probability 0 has an empty interval and is never drawn (the search takes the first cumulative
    value strictly above u).
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # (R, V)
    u = _uniform_rows(torch.empty(probs.shape[0], 1, dtype=torch.float64, device=probs.device), generators)
    picked = torch.searchsorted(cdf, u.mul_(cdf[:, -1:]), right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[1] - 1)  # only a NaN row (no distribution) gets here
