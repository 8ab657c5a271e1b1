"""`SamplingMetadata`: the per-step sampling inputs of a batch, as tensors (vLLM v1's shape).

Row r of every tensor is request r of the batch, in batch order. A field is None when no row
needs it, so the sampler skips that work (an all-greedy batch never softmaxes or sorts). Worked
example with three rows and vocab_size 8:

    params            greedy       T=0.7, top_k=2     T=1.0, repetition_penalty=1.2
    temperature       [0.0,        0.7,               1.0]
    top_k             [8,          2,                 8]     # vocab_size = "no limit"; max_top_k 2
    top_p             None                                   # every row has top_p == 1
    prompt_token_ids  [[1, 2, 8], [3, 8, 8], [4, 5, 6]]      # padded with vocab_size (8)

Everything is built on the host and moved with one pinned, non-blocking copy per tensor, so
building the metadata never waits for the GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.host_copy import host_tensor, needs_pinning, to_device_async
from pagedllm.sampling_params import _SAMPLING_EPS, SamplingParams


@dataclass
class RowInputs:
    """What the builder needs from one request of the batch."""

    params: SamplingParams
    # Lists or int numpy arrays; arrays (as a runner's persistent token buffer gives) pad faster.
    prompt_token_ids: list[int] | np.ndarray
    output_token_ids: list[int] | np.ndarray  # tokens generated so far (the live list; not copied)
    # The request's own generator (made once, from params.seed, on the logits' device); it is
    # required for seeded requests and advances by one draw per step.
    generator: torch.Generator | None = None


def new_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator a seeded request keeps for its whole life."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


def make_tensor_with_pad(
    token_lists: Sequence[list[int] | np.ndarray], pad: int, device: torch.device
) -> torch.Tensor:
    """Ragged token lists -> int64 (R, max_len) padded with `pad`, with no per-row Python copy.

    [[5, 6, 7], [9]] with pad 8 -> [[5, 6, 7], [9, 8, 8]]
    Rows may be Python lists or numpy arrays (arrays skip the slow per-element conversion).
    """
    num_rows = len(token_lists)
    lens = np.fromiter(map(len, token_lists), dtype=np.int64, count=num_rows)
    max_len = int(lens.max()) if num_rows else 0
    if num_rows and all(isinstance(x, np.ndarray) for x in token_lists):
        flat = np.concatenate(token_lists).astype(np.int64, copy=False)
    else:
        flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(lens.sum()))
    # Written straight into the (pinned) host buffer that the device copy reads.
    out_t = torch.empty((num_rows, max_len), dtype=torch.int64, pin_memory=needs_pinning(device))
    out = out_t.numpy()
    out.fill(pad)
    # Row-major boolean assignment fills each row's first len(row) slots in order.
    out[np.arange(max_len) < lens[:, None]] = flat
    return to_device_async(out_t, device)


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # float32 (R,); greedy rows hold their temperature (< 1e-5)
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # float32 (R,); None when every sampled row has top_p == 1
    top_k: torch.Tensor | None  # int64 (R,); rows without a limit hold vocab_size; None when none has one
    max_top_k: int  # host copy of the largest active top_k, so top-k needs no device->host read
    all_rows_top_k: bool  # every sampled row has a top_k: top-p then looks at max_top_k candidates only
    min_p: torch.Tensor | None  # float32 (R,); None when every sampled row has min_p == 0
    presence_penalties: torch.Tensor | None  # float32 (R,); None when all are 0
    frequency_penalties: torch.Tensor | None  # float32 (R,); None when all are 0
    repetition_penalties: torch.Tensor | None  # float32 (R,); None when all are 1
    prompt_token_ids: torch.Tensor | None  # int64 (R, Lp) padded with vocab_size; only with repetition
    output_token_ids: list[list[int] | np.ndarray]  # per row, for the penalties
    generators: dict[int, torch.Generator]  # row -> generator, for seeded sampled (non-greedy) rows
    max_num_logprobs: int | None  # largest `logprobs` asked in the batch (capped at vocab_size)
    # row -> (min_tokens still to generate, stop ids to mask); only rows with something to mask.
    min_tokens: dict[int, tuple[int, set[int]]]
    logit_bias: list[dict[int, float] | None] | None  # per row; None when no row has one
    vocab_size: int
    # row -> the only ids it may sample / its bad words as token ids (sample/token_masks.py).
    allowed_token_ids: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    bad_words: dict[int, list[list[int]]] = dataclasses.field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]

    @property
    def no_penalties(self) -> bool:
        return (
            self.presence_penalties is None
            and self.frequency_penalties is None
            and self.repetition_penalties is None
        )

    @classmethod
    def build(cls, rows: list[RowInputs], vocab_size: int, device: torch.device | str) -> SamplingMetadata:
        device = torch.device(device)
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}.")
        num_reqs = len(rows)
        params = [row.params for row in rows]
        # One pass over the Python objects; everything after works on whole columns.
        temperature = [p.temperature for p in params]
        greedy = [t < _SAMPLING_EPS for t in temperature]
        all_greedy = all(greedy)
        all_random = num_reqs > 0 and not any(greedy)  # an empty batch counts as all-greedy

        def column(values: list, neutral: float, dtype: torch.dtype) -> torch.Tensor | None:
            # None when every row holds the neutral value: the sampler then skips the op.
            if all(v == neutral for v in values):
                return None
            return host_tensor(values, dtype, device)

        # Truncation only matters for sampled rows; a greedy row counts as "off" there.
        top_p = top_k = min_p = None
        max_top_k = 0
        all_rows_top_k = False
        if not all_greedy:
            pairs = list(zip(params, greedy, strict=True))
            top_p = column([1.0 if g else p.top_p for p, g in pairs], 1.0, torch.float32)
            min_p = column([0.0 if g else p.min_p for p, g in pairs], 0.0, torch.float32)
            # top_k 0 (off) or >= vocab_size keeps every token: store vocab_size ("no limit").
            ks = [vocab_size if g or not 0 < p.top_k < vocab_size else p.top_k for p, g in pairs]
            top_k = column(ks, vocab_size, torch.int64)
            max_top_k = max((k for k in ks if k < vocab_size), default=0)
            all_rows_top_k = all(g or k < vocab_size for k, g in zip(ks, greedy, strict=True))

        presence = column([p.presence_penalty for p in params], 0.0, torch.float32)
        frequency = column([p.frequency_penalty for p in params], 0.0, torch.float32)
        repetition = column([p.repetition_penalty for p in params], 1.0, torch.float32)
        prompt_token_ids = None
        if repetition is not None:
            prompt_token_ids = make_tensor_with_pad([r.prompt_token_ids for r in rows], vocab_size, device)

        generators: dict[int, torch.Generator] = {}
        min_tokens: dict[int, tuple[int, set[int]]] = {}
        logit_bias: list[dict[int, float] | None] | None = None
        allowed_token_ids: dict[int, list[int]] = {}
        bad_words: dict[int, list[list[int]]] = {}
        max_num_logprobs: int | None = None
        for i, (row, p, g) in enumerate(zip(rows, params, greedy, strict=True)):
            if p.seed is not None and row.generator is None and not g:
                raise ValueError(
                    f"row {i} has seed={p.seed} but no generator; make one per request with "
                    "new_generator(seed, device) and pass the same one every step."
                )
            if row.generator is not None and not g:
                if row.generator.device.type != device.type:
                    raise ValueError(
                        f"row {i}'s generator is on {row.generator.device}, the logits on {device}."
                    )
                generators[i] = row.generator
            if p.logprobs is not None:
                max_num_logprobs = max(max_num_logprobs or 0, min(p.logprobs, vocab_size))
            remaining = p.min_tokens - len(row.output_token_ids)
            if remaining > 0 and p.all_stop_token_ids:
                _check_ids(i, "stop token id", p.all_stop_token_ids, vocab_size)
                min_tokens[i] = (remaining, set(p.all_stop_token_ids))
            if p.logit_bias:
                _check_ids(i, "logit_bias token id", p.logit_bias, vocab_size)
                if logit_bias is None:
                    logit_bias = [None] * num_reqs
                logit_bias[i] = p.logit_bias
            if p.allowed_token_ids:
                _check_ids(i, "allowed token id", p.allowed_token_ids, vocab_size)
                allowed_token_ids[i] = p.allowed_token_ids
            if p.bad_words_token_ids:
                _check_ids(i, "bad word token id", [t for w in p.bad_words_token_ids for t in w], vocab_size)
                bad_words[i] = p.bad_words_token_ids

        return cls(
            temperature=host_tensor(temperature, torch.float32, device),
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=top_p,
            top_k=top_k,
            max_top_k=max_top_k,
            all_rows_top_k=all_rows_top_k,
            min_p=min_p,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=[r.output_token_ids for r in rows],
            generators=generators,
            max_num_logprobs=max_num_logprobs,
            min_tokens=min_tokens,
            logit_bias=logit_bias,
            vocab_size=vocab_size,
            allowed_token_ids=allowed_token_ids,
            bad_words=bad_words,
        )


def _check_ids(row: int, what: str, ids, vocab_size: int) -> None:
    # An out-of-range index would be a device-side assert on CUDA; refuse it here instead.
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"row {row}: {what} {bad[0]} is outside the vocabulary [0, {vocab_size}).")
