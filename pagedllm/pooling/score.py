"""Scoring text pairs (LLM.score, /v1/score, /rerank), vLLM's rules.

    data_1 one text, data_2 N texts   -> N pairs (data_1, data_2[i])      1 -> N
    data_1 N texts, data_2 N texts    -> N pairs (data_1[i], data_2[i])   N -> N

A cross-encoder (a *ForSequenceClassification model) reads each pair as one prompt, tokenized as a
pair ([CLS] a [SEP] b [SEP], segment ids 0 / 1 for BERT) and scores it with its head (sigmoid of
the logit for one label). An embedding model scores a pair by the cosine of the two embeddings.
"""

from __future__ import annotations

from typing import Any

import torch


class PairsError(ValueError):
    """A side of the pairs that cannot be paired; `name` is the argument (or field) that holds it."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


def make_pairs(data_1: str | list[str], data_2: str | list[str],
               names: tuple[str, str] = ("data_1", "data_2")) -> list[tuple[str, str]]:
    """`names`: what the caller calls the two sides, for the errors (LLM.score's data_1 / data_2, a
    request's text_1 / text_2 or queries / documents)."""
    for name, data in zip(names, (data_1, data_2), strict=True):
        # A dict would be read as its keys, a str's bytes as numbers: neither is texts.
        if not isinstance(data, (str, list, tuple)):
            raise PairsError(f"{name} must be a string or a list of strings, got {type(data).__name__}.", name)
    left = [data_1] if isinstance(data_1, str) else list(data_1)
    right = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, side in zip(names, (left, right), strict=True):
        if not side:
            raise PairsError(f"{name} is empty; give at least one text.", name)
        if not all(isinstance(t, str) for t in side):
            raise PairsError(f"{name} must hold strings only.", name)
    if len(left) == 1:
        left = left * len(right)
    elif len(left) != len(right):
        raise PairsError(f"{names[0]} has {len(left)} texts and {names[1]} {len(right)}: give one {names[0]}, or as "
                         f"many as {names[1]}.", names[1])
    return list(zip(left, right))


def cross_encoder_prompt(tokenizer: Any, a: str, b: str, truncate: int | None, max_model_len: int) -> dict[str, Any]:
    """One pair as a prompt for the engine: its token ids and (when the tokenizer makes them) segment ids."""
    if tokenizer is None:
        raise ValueError("scoring text pairs needs a tokenizer (this engine has skip_tokenizer_init).")
    kwargs: dict[str, Any] = {}
    if truncate is not None:
        k = max_model_len if truncate == -1 else truncate
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= max_model_len:
            # The tokenizer raised OverflowError at 10**30 (a 500 on a cross-encoder server).
            raise ValueError(f"truncate_prompt_tokens must be -1 or 1 to the model's max_model_len ({max_model_len}), "
                             f"got {truncate!r}.")
        kwargs = {"truncation": True, "max_length": k}
    enc = tokenizer(text=a, text_pair=b, **kwargs)
    prompt: dict[str, Any] = {"prompt_token_ids": list(enc["input_ids"])}
    if "token_type_ids" in enc:
        prompt["token_type_ids"] = list(enc["token_type_ids"])
    return prompt


def cosine_scores(left: list[torch.Tensor], right: list[torch.Tensor]) -> list[float]:
    a, b = torch.stack(left).float(), torch.stack(right).float()
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()
