"""`SamplingParams`: vLLM's names, defaults and validation.

Every invalid value raises ValueError naming the field and the allowed range, so the server can
turn it into a 400 without guessing.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from pagedllm.structured_output.params import (
    GuidedDecodingParams,
    StructuredOutputsParams,
    check_backend,
    coerce_structured_outputs,
)

__all__ = ["BeamSearchParams", "GuidedDecodingParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

_SAMPLING_EPS = 1e-5

# Limits that protect the engine from requests that would exhaust it (named in docs/LIMITS.md).
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
# The largest integer field value (int64), so every request can be sent to the engine process.
MAX_INT = 2**63 - 1


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries all tokens so far
    DELTA = 1  # every output carries only the new tokens
    FINAL_ONLY = 2  # only the finished output is returned


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _as_list(value: Any, name: str, what: str) -> list[Any]:
    """An iterable (list, tuple, set, generator: as vLLM's list(value)) -> a list. A number, a dict,
    bytes or a lone string where a list of items goes -> TypeError naming the field, not "'int'
    object is not iterable" (or b"\x01" silently read as [1])."""
    if isinstance(value, (str, bytes, bytearray, dict)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r:.60}.")
    return list(value)


def _check_structured_option_types(p: StructuredOutputsParams) -> None:
    """The flags of StructuredOutputsParams are bools (json_object: or None): a string there would be
    sent to the engine process, whose decoder refuses it and dies."""
    for name in ("json_object", "disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
        v = getattr(p, name)
        if not isinstance(v, bool) and not (v is None and name == "json_object"):
            raise ValueError(f"structured_outputs.{name} must be true or false, got {v!r}.")
    if p._backend is not None and not isinstance(p._backend, str):
        raise ValueError(f"structured_outputs.backend must be a string, got {type(p._backend).__name__}.")


# Immutable values a clone may share (IntEnum members are ints).
_ATOMS = (int, float, str, bytes)


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrained decoding (structured_output/): vLLM 0.21's field, and older vLLM's guided_decoding.
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: GuidedDecodingParams | None = None
    # vLLM's constraints: sample only among these ids; never produce these words; keep only the
    # last k prompt tokens (-1: the last max_model_len - 1 of them).
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # Filled by the engine from the tokenizer / generation_config, not by users.
    all_stop_token_ids: set[int] = field(default_factory=set)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # from bad_words, by the Processor

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = _as_list(self.stop, "stop", "a string or a list of strings")
        self.stop_token_ids = _as_list(self.stop_token_ids or [], "stop_token_ids", "a list of token ids")
        for name in ("allowed_token_ids", "bad_words"):
            if getattr(self, name) is not None:
                setattr(self, name, _as_list(getattr(self, name), name, "a list"))
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}.")
        if self.top_k == -1:
            self.top_k = 0
        # vLLM's spellings: seed=-1 is "no seed" (not a seeded generator started at -1), and
        # logprobs=True / prompt_logprobs=True ask for the sampled token's logprob alone (1).
        if _is_int(self.seed) and self.seed == -1:
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                setattr(self, name, 1)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both.")
            self.structured_outputs, self.guided_decoding = coerce_structured_outputs(self.guided_decoding), None
        if isinstance(self.structured_outputs, dict):
            backend = self.structured_outputs.get("backend")
            if backend is not None and not isinstance(backend, str):
                raise ValueError(f"structured_outputs.backend must be a string, got {type(backend).__name__}.")
        self.structured_outputs = coerce_structured_outputs(self.structured_outputs)
        if self.structured_outputs is not None:
            _check_structured_option_types(self.structured_outputs)
            check_backend(self.structured_outputs._backend, "structured_outputs backend")
        self._verify()
        # A union, not a reset: a copy decoded in a worker process keeps what the engine added.
        self.all_stop_token_ids = set(self.stop_token_ids) | set(self.all_stop_token_ids or ())

    # -- validation -----------------------------------------------------------------------------
    def _verify(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}.")

        # Every field crosses to the engine process as msgpack, decoded by its annotation: a value of
        # another type there would kill the engine, so the types are checked here (True is not an int).
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "a RequestOutputKind")
        # msgpack holds integers in [-2**63, 2**64 - 1]: a larger one could not be sent to the engine.
        for name in ("top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            v = getattr(self, name)
            if _is_int(v) and v > MAX_INT:
                raise bad(name, f"at most {MAX_INT} (2**63 - 1)")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}]")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of != self.n):
            raise bad("best_of", "None or equal to n (beam-style best_of is not supported)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise bad(name, "a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", "a finite number > 0")
        if not _is_number(self.temperature) or math.isnan(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", "a number in [0, 2]")
        if not _is_number(self.top_p) or math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 1, or 0 / -1 for no limit")
        if not _is_number(self.min_p) or math.isnan(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "a number in [0, 1]")
        # torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; a larger seed would fail in the engine.
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", "None or an integer in [-2**63, 2**64 - 1]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise bad(name, "an integer >= 0 or None")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}.")
        if self.stop and not self.detokenize:
            # Stop strings are matched in the detokenized text: without it they would never stop anything.
            raise ValueError("stop strings are only supported when detokenize is True; set detokenize=True to use stop.")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}.")
            if len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(f"each stop string may be at most {MAX_STOP_STRING_LEN} characters long.")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}.")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries.")
            clean: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                try:
                    # An int, or its decimal text (JSON keys are strings); never a float (1.5 -> 1).
                    tok = k if _is_int(k) else int(k) if isinstance(k, str) else None
                except ValueError:
                    tok = None
                if tok is None:
                    raise ValueError(f"logit_bias keys must be token ids (integers), got {k!r}.")
                if not _is_number(v) or math.isnan(v) or not -100.0 <= v <= 100.0:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for {k!r}.")
                clean[tok] = float(v)
            self.logit_bias = clean

        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes)) or not all(_is_int(t) and t >= 0 for t in ids) or not ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids >= 0, got {ids!r}.")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not all(isinstance(w, str) and w for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}.")
            self.bad_words = list(self.bad_words)
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 (or -1: the context length), got {t!r}.")

    def verify_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids inside the vocabulary."""
        for t in self.stop_token_ids or []:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids contains {t}, outside the vocabulary [0, {vocab_size}).")
        for t in self.logit_bias or {}:
            if not 0 <= t < vocab_size:
                raise ValueError(f"logit_bias contains token id {t}, outside the vocabulary [0, {vocab_size}).")
        for t in self.allowed_token_ids or []:
            if t >= vocab_size:
                raise ValueError(f"allowed_token_ids contains {t}, outside the vocabulary [0, {vocab_size}).")

    # -- derived ---------------------------------------------------------------------------------
    def update_from_generation_config(self, generation_config: dict[str, Any], eos_token_ids: set[int]) -> None:
        """Stop on the model's EOS ids (unless ignore_eos), as vLLM does with generation_config."""
        if not self.ignore_eos:
            self.all_stop_token_ids |= set(eos_token_ids)

    def clone(self) -> SamplingParams:
        """A copy sharing nothing mutable with this one, as `copy.deepcopy` would give, without its walk over
        every field (two clones a request were ~40% of add_request's host time at W1's 256 requests): numbers,
        strings and enums are shared, lists / sets / dicts of them copied one level, anything else (the
        structured-output params and their schemas) deep-copied."""
        new = copy.copy(self)
        for name, v in self.__dict__.items():
            if v is None or isinstance(v, _ATOMS):
                continue
            if isinstance(v, (list, set)) and all(isinstance(x, _ATOMS) for x in v):
                setattr(new, name, type(v)(v))
            elif isinstance(v, dict) and all(isinstance(x, _ATOMS) for x in v.values()):
                setattr(new, name, dict(v))  # keys of a dict are hashable; these fields' are ints
            else:
                setattr(new, name, copy.deepcopy(v))
        return new

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """Build from keyword arguments where None means "use the default" (server requests)."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: what `LLM.beam_search` takes (pagedllm/beam_search.py runs it)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # vLLM's field; beam search takes no stop strings

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}.")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}.")
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}.")
