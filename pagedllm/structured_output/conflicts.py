"""Conflicts between a request's grammar and its other token masks that show before queueing: a 400.

The grammar bans every token it does not allow; allowed_token_ids, bad_words and min_tokens ban
others. Where their bans cover the whole vocabulary nothing valid can be sampled. Two such conflicts
are certain from the request alone and refused here (the frontend, before queueing):

  - the first token: no token the grammar may start with survives the other masks, e.g.
      json schema + allowed_token_ids=[id of "a"]    (a JSON value starts with {, [, ", a digit, ...)
      choice ["yes", "no"] + min_tokens=1 when the only tokens left are the stop tokens
  - min_tokens with a `choice`: every option is spelled in fewer tokens than min_tokens even one byte
    per token (the most tokens a string can take), so after any option the grammar allows only a stop
    token, which min_tokens still bans: choice ["yes", "no"] + min_tokens=4.

Conflicts reached later in the output (after "{", allowed_token_ids holds no '"') are caught when the
token is sampled (sample_check.py: the request ends with an error, its token never emitted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.structured_output.sample_check import conflicting_masks, needs_sample_check

if TYPE_CHECKING:
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.structured_output.backend_types import StructuredOutputBackend


def unpack_bitmask_row(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 (W,) bitmask row -> bool (vocab_size,): [0b101] -> [True, False, True, False, ...]."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (row.unsqueeze(-1) >> shifts) & 1  # (W, 32), bit b of word w is token 32 * w + b
    return bits.reshape(-1)[:vocab_size].bool()


def check_conflicts(backend: StructuredOutputBackend, params: SamplingParams) -> None:
    """ValueError naming the conflict when `params`' grammar and other masks leave nothing to sample
    (params: finalized: all_stop_token_ids and bad_words_token_ids filled)."""
    so = params.structured_outputs
    if so is None or not needs_sample_check(params):
        return
    reasoning = bool(so._reasoning_end_token_ids)  # the grammar starts after the thinking text
    stop_ids = sorted(params.all_stop_token_ids)
    if so.kind == "choice" and params.min_tokens and stop_ids and not reasoning:
        longest = max(so.choice, key=lambda c: len(c.encode("utf-8")))
        if len(longest.encode("utf-8")) < params.min_tokens:
            raise ValueError(
                f"min_tokens={params.min_tokens} conflicts with structured_outputs.choice: every option is "
                f"shorter (the longest, {longest!r}, takes at most {len(longest.encode('utf-8'))} tokens), and "
                "after an option the grammar allows only a stop token, which min_tokens bans until then.")
    vocab = backend.vocab_size
    bitmask = backend.allocate_bitmask(1)
    backend.compile_grammar(so, stop_ids).fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask_row(bitmask[0], vocab)
    grammar_first = int(allowed.sum())
    if params.allowed_token_ids:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[torch.tensor(params.allowed_token_ids, dtype=torch.int64)] = True
        allowed &= keep
    for word in params.bad_words_token_ids:
        if len(word) == 1:  # a one-token bad word is banned everywhere; longer ones after their prefix
            allowed[word[0]] = False
    if params.min_tokens and not reasoning:
        allowed[torch.tensor(stop_ids, dtype=torch.int64)] = False
    if not bool(allowed.any()):
        masks = conflicting_masks(params)
        raise ValueError(
            f"{masks} conflict{'' if ' and ' in masks else 's'} with "
            f"structured_outputs.{so.kind}: none of the {grammar_first} tokens the grammar may start with is left "
            "to sample, so no output can match it.")
