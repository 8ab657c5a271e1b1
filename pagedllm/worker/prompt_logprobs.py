"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): the log-softmax of the logits at each prompt
position for the prompt token that follows it, with the k most likely tokens, computed on the prefill
chunks that hold those positions.

A step's chunk of prompt positions [p0, p0 + n) predicts prompt tokens p0 + 1 .. p0 + n (the logits at the
prompt's last position belong to the first sampled token, not to the prompt). Each position gives an entry
shaped as a sampled token's logprobs: (ids, logprobs, rank) with ids[0] the prompt token, ids[1:] the top k,
rank 1 + the number of tokens with a strictly higher logprob. The logprobs are the raw model's (before
temperature and penalties: vLLM's raw_logprobs). The scheduler keeps them on its request by position (a
recomputed prompt, after preemption, gives the same positions again and they are not added twice) and sends
them with the request's first output; the output processor makes vLLM's list, None for the first token.

Example: prompt [5, 9, 2], prompt_logprobs=1, one chunk: positions 0 and 1 give entries for tokens 9 and 2
(start 1); RequestOutput.prompt_logprobs = [None, {9: Logprob, top1: ...}, {2: ..., top1: ...}].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PromptLogprobsJob:
    """One step's prompt positions to score: per request row, its first predicted position and count."""

    req_ids: list[str]
    starts: list[int]  # the first prompt token each row predicts (p0 + 1)
    counts: list[int]
    ks: list[int]  # top-k per row (prompt_logprobs)
    flat_index: np.ndarray  # int64: the rows of the step's hidden states, row by row
    targets: np.ndarray  # int64: the prompt token each of those positions predicts


def plan(req_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray,
         state_of: Callable[[str], object]) -> PromptLogprobsJob | None:
    """The step's job for the rows whose requests ask for prompt logprobs, None when no row needs one.
    state_of(req_id) -> the request's state (token_ids, num_prompt_tokens, sampling_params)."""
    pos = positions if positions.ndim == 1 else positions[0]
    ids, starts, counts, ks, flat, targets = [], [], [], [], [], []
    for i, rid in enumerate(req_ids):
        st = state_of(rid)
        k = st.sampling_params.prompt_logprobs
        if k is None:
            continue
        lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
        p0 = int(pos[lo])
        n = min(hi - lo, st.num_prompt_tokens - 1 - p0)
        if n <= 0:
            continue
        ids.append(rid)
        starts.append(p0 + 1)
        counts.append(n)
        ks.append(int(k))
        flat.append(np.arange(lo, lo + n, dtype=np.int64))
        targets.append(np.asarray(st.token_ids[p0 + 1:p0 + 1 + n], dtype=np.int64))
    if not ids:
        return None
    return PromptLogprobsJob(ids, starts, counts, ks, np.concatenate(flat), np.concatenate(targets))


# Positions scored at a time: a slice's fp32 logits are SLICE x vocab (256 x 128,256 x 4 B = 131 MB), so a long
# prefill chunk (8,192 positions) never holds all of its logits at once beside the step's own memory.
SLICE = 256


def compute(job: PromptLogprobsJob, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
            vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids (P, 1 + k), logprobs (P, 1 + k), ranks (P,)) for the job's P positions, k its largest top-k;
    column 0 the prompt token. On hidden's device, queued in stream order, SLICE positions at a time."""
    dev = hidden.device
    idx = torch.from_numpy(job.flat_index).to(dev)
    targets = torch.from_numpy(job.targets).to(dev)
    k = max(job.ks)
    ids, lps, ranks = [], [], []
    for lo in range(0, idx.numel(), SLICE):
        target = targets[lo:lo + SLICE, None]
        logits = compute_logits(hidden.index_select(0, idx[lo:lo + SLICE]))[:, :vocab_size].float()
        lp = torch.log_softmax(logits, dim=-1)
        chosen = lp.gather(1, target)  # (S, 1)
        ranks.append((lp > chosen).sum(dim=1) + 1)
        if k > 0:
            top_lp, top_ids = lp.topk(k, dim=1)
            ids.append(torch.cat([target, top_ids], 1))
            lps.append(torch.cat([chosen, top_lp], 1))
        else:
            ids.append(target)
            lps.append(chosen)
    return torch.cat(ids), torch.cat(lps), torch.cat(ranks)


def to_lists(job: PromptLogprobsJob, ids: torch.Tensor, lps: torch.Tensor,
             ranks: torch.Tensor) -> dict[str, tuple[int, list[tuple[list[int], list[float], int]]]]:
    """req_id -> (first predicted position, entries (ids, logprobs, rank) one per position), host lists."""
    ids_l, lps_l, ranks_l = ids.tolist(), lps.tolist(), ranks.tolist()
    out = {}
    j = 0
    for rid, start, n, k in zip(job.req_ids, job.starts, job.counts, job.ks, strict=True):
        out[rid] = (start, [(ids_l[j + t][:k + 1], lps_l[j + t][:k + 1], ranks_l[j + t]) for t in range(n)])
        j += n
    return out
