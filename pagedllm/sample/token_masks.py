"""vLLM's `allowed_token_ids` and `bad_words`: logits set to -inf before sampling (greedy rows too).

    allowed_token_ids [5, 9]  -> row r keeps logits[r, 5] and logits[r, 9]; every other id is -inf
    bad_words ["foo bar"]     -> token ids [[712, 2340]] (and the spelling with a leading space):
                                 a one-token word is always banned; a longer one bans its last token
                                 while the output so far ends with the others ([..., 712] -> no 2340)

Index lists are built on the host and copied in, as in penalties.py; nothing is read back.
"""

from __future__ import annotations

import torch

from pagedllm.host_copy import host_tensor


def apply_allowed_token_ids(logits: torch.Tensor, allowed: dict[int, list[int]]) -> torch.Tensor:
    """(R, V) logits; `allowed` row -> the only ids it may sample. In place for those rows."""
    if not allowed:
        return logits
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    rows = [r for r, ids in allowed.items() for _ in ids]
    cols = [t for ids in allowed.values() for t in ids]
    idx = host_tensor([rows, cols], torch.int64, logits.device)
    keep[idx[0], idx[1]] = True
    masked_rows = host_tensor(sorted(allowed), torch.int64, logits.device)
    keep_rows = keep[masked_rows]
    logits[masked_rows] = logits[masked_rows].masked_fill(~keep_rows, float("-inf"))
    return logits


def bad_word_bans(bad_words: list[list[int]], output_token_ids) -> list[int]:
    """The ids a row may not sample next: [[7], [3, 4]] with outputs [..., 3] -> [7, 4]."""
    banned = []
    tail = list(output_token_ids[-max((len(w) for w in bad_words), default=1) + 1 :]) if bad_words else []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(tail) >= len(prefix) and tail[len(tail) - len(prefix) :] == prefix):
            banned.append(word[-1])
    return banned


def apply_bad_words(logits: torch.Tensor, bad_words: dict[int, list[list[int]]], output_token_ids) -> torch.Tensor:
    """Ban each row's bad-word continuations (`bad_word_bans`). In place."""
    rows: list[int] = []
    cols: list[int] = []
    for r, words in bad_words.items():
        for t in bad_word_bans(words, output_token_ids[r]):
            rows.append(r)
            cols.append(t)
    if not rows:
        return logits
    idx = host_tensor([rows, cols], torch.int64, logits.device)
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put_((idx[0], idx[1]), neg_inf)
