"""Input processing shared by every frontend: prompt -> token ids, validation, fan-out of n > 1.

Everything that can be rejected is rejected here, with a ValueError naming the problem, before
anything reaches the engine core.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from pagedllm.config import EngineConfig
from pagedllm.engine.output_processor import ParentRequest, RequestState
from pagedllm.request import Request
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

# vLLM's prompt forms: a string, {"prompt": str}, or {"prompt_token_ids": [int, ...]}.
PromptType = Union[str, Mapping[str, Any], list[int]]

# The keys of vLLM's TextPrompt / TokensPrompt (vllm/inputs) that are built: the text, the token ids
# (with, optionally, the text they came from) and the prefix-cache salt. Pooling adds token_type_ids.
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
# vLLM's other prompt keys, and why each is refused: pagedllm serves text-only decoder models, and a key
# that is dropped would run the prompt without what it asked for (an image, its embeddings, ...).
_NOT_BUILT_KEYS = {
    "multi_modal_data": "multimodal inputs are not built (pagedllm serves text-only models); give text only",
    "mm_processor_kwargs": "multimodal inputs are not built (pagedllm serves text-only models)",
    "multi_modal_uuids": "multimodal inputs are not built (pagedllm serves text-only models)",
    "prompt_embeds": "prompt embeddings as input are not built; give text or prompt_token_ids",
    "token_type_ids": "token_type_ids are read by pooling models only (LLM.embed / LLM.score)",
    "encoder_prompt": "encoder-decoder models are not built",
    "decoder_prompt": "encoder-decoder models are not built",
}


def check_prompt_keys(prompt: Mapping[str, Any], accepted: frozenset[str] = PROMPT_KEYS) -> None:
    """ValueError naming the first key of a prompt dict that is not built. A multimodal key set to None
    or an empty dict asks for nothing (vLLM's types allow None) and passes.

    {"prompt": "hi", "multi_modal_data": {"image": img}} -> ValueError naming multi_modal_data."""
    for key, value in prompt.items():
        if key in accepted:
            continue
        if key in _NOT_BUILT_KEYS:
            if key.startswith(("multi_modal", "mm_")) and (value is None or value == {}):
                continue
            raise ValueError(f"prompt key {key!r} is not supported: {_NOT_BUILT_KEYS[key]}.")
        raise ValueError(f"unknown prompt key {key!r}; a prompt dict takes {', '.join(sorted(accepted))}.")

# Keys of generation_config.json that become default sampling parameters (as in vLLM).
_GEN_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None = None


@dataclass
class ProcessedRequest:
    """One user request, ready for the core: a Request and a RequestState per choice (n > 1 fans out)."""

    requests: list[Request]
    states: list[RequestState]
    output_kind: RequestOutputKind


class Processor:
    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = config.model_config.vocab_size
        self.max_model_len = config.model_config.max_model_len
        eos = set(config.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = eos
        self._structured_backend = None  # built at the first constrained request (structured_output/)
        self._structured_lock = threading.Lock()

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile the request's grammar once here (tokenizer pool thread, cached by xgrammar) so a
        bad schema, regex or grammar is refused before queueing, with the backend's message (and a
        grammar that other masks leave nothing to sample: structured_output/conflicts.py)."""
        so = params.structured_outputs
        if so is None:
            return
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this engine has none (skip_tokenizer_init).")
        with self._structured_lock:
            if self._structured_backend is None:
                from pagedllm.structured_output.manager import make_backend

                self._structured_backend = make_backend(self.tokenizer, self.vocab_size)
        self._structured_backend.validate(so)
        # The grammar against allowed_token_ids / bad_words / min_tokens: a certain conflict is a 400 now.
        from pagedllm.structured_output.conflicts import check_conflicts

        check_conflicts(self._structured_backend, params)

    def default_sampling_params(self) -> SamplingParams:
        gen = self.config.model_config.generation_config
        kwargs = {k: gen[k] for k in _GEN_DEFAULT_KEYS if gen.get(k) is not None}
        if isinstance(gen.get("max_new_tokens"), int):
            kwargs["max_tokens"] = gen["max_new_tokens"]  # vLLM: generation_config's max_new_tokens
        return SamplingParams(**kwargs)

    def tokenize_prompt(self, prompt: PromptType, accepted_keys: frozenset[str] = PROMPT_KEYS) -> ProcessedPrompt:
        salt = None
        if isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, Mapping):
            check_prompt_keys(prompt, accepted_keys)
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            salt = prompt.get("cache_salt")
            if text is None and ids is None:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'.")
            if salt is not None and not isinstance(salt, str):
                raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}.")
        elif isinstance(prompt, list):
            text, ids = None, prompt
        else:
            raise ValueError(f"prompt must be a string, a token-id list or a dict, got {type(prompt).__name__}.")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt text must be a string, got {type(text).__name__}.")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (skip_tokenizer_init); pass prompt_token_ids.")
            ids = self.tokenizer.encode(text)
        else:
            ids = list(ids)
            # The common case checked in C (W1's 256 prompts: ~3x faster than the loop); the loop finds the
            # offending id to name it (a bool, a float, a numpy integer or an id out of range).
            if not ids or not (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < self.vocab_size):
                for t in ids:
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                        raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {self.vocab_size}).")
        if not ids:
            raise ValueError("the prompt is empty; it needs at least one token.")
        return ProcessedPrompt(text, ids, salt)

    def finalize_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """Copy, check against the model, and fill the engine-derived fields."""
        params = params.clone()
        params.verify_vocab(self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > self.config.max_logprobs:
                raise ValueError(f"{name}={v} is more than the server's max_logprobs ({self.config.max_logprobs}).")
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the prompt has "
                f"{num_prompt_tokens} tokens, leaving no room for output. Please shorten the prompt."
            )
        if params.max_tokens is None:
            # As long as the context allows, capped by generation_config's max_new_tokens (vLLM's rule).
            params.max_tokens = self.max_model_len - num_prompt_tokens
            gen_max = self.config.model_config.generation_config.get("max_new_tokens")
            if isinstance(gen_max, int) and gen_max > 0:
                params.max_tokens = min(params.max_tokens, gen_max)
        elif num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + params.max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the prompt or max_tokens."
            )
        if params.min_tokens > params.max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) is more than max_tokens ({params.max_tokens}).")
        params.all_stop_token_ids = set(params.stop_token_ids or [])
        params.update_from_generation_config(self.config.model_config.generation_config, self.eos_token_ids)
        if params.stop and self.tokenizer is None:
            # Stop strings are found in the detokenized text, and there is none without a tokenizer.
            raise ValueError("stop strings need a tokenizer; this engine runs without one (skip_tokenizer_init): "
                             "use stop_token_ids.")
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        self.check_structured_outputs(params)
        return params

    def bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (as vLLM: "foo" and " foo" are
        different tokens in most vocabularies); duplicates dropped."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this engine runs without one (skip_tokenizer_init).")
        out: list[list[int]] = []
        for word in bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def truncate_prompt(self, pp: ProcessedPrompt, params: SamplingParams) -> ProcessedPrompt:
        """vLLM's truncate_prompt_tokens: keep the last k prompt tokens (-1: as many as leave room for
        max_tokens, max_model_len - max_tokens as vLLM's; without max_tokens, max_model_len - 1)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return pp
        if k == -1:
            # max_model_len - 1 with max_tokens set was a 400 (prompt + max_tokens over the context) for the
            # prompts that -1 is for: those longer than the context.
            k = max(1, self.max_model_len - (params.max_tokens or 1))
        if len(pp.prompt_token_ids) <= k:
            return pp
        ids = pp.prompt_token_ids[-k:]
        text = self.tokenizer.decode(ids) if self.tokenizer is not None and pp.prompt is not None else None
        return ProcessedPrompt(text, ids, pp.cache_salt)

    @staticmethod
    def child_params(params: SamplingParams, index: int) -> SamplingParams:
        """Parameters of the index-th of n samples: n=1, and a distinct seed when seeded."""
        child = params.clone()
        child.n = 1
        # best_of may only equal n (sampling_params.py): a child kept at best_of=n with n=1 was refused
        # by the engine process's check, a 500 for a request the frontend had accepted.
        child.best_of = None
        if params.seed is not None:
            child.seed = params.seed + index
        return child

    def process_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | Any, arrival_time: float
    ) -> ProcessedRequest:
        """Tokenize, validate against the model, and fan out n > 1 into child requests
        ("{index}_{request_id}") gathered back by a ParentRequest. Raises ValueError, queues nothing.
        PoolingParams instead of SamplingParams: a pooling request (pooling/processing.py)."""
        if not isinstance(params, SamplingParams):
            from pagedllm.pooling.processing import process_pooling_request

            return process_pooling_request(self, request_id, prompt, params, arrival_time)
        if self.config.model_config.runner_type == "pooling":
            from pagedllm.pooling.processing import wrong_runner_message

            raise ValueError(wrong_runner_message(self.config, False))
        pp = self.truncate_prompt(self.tokenize_prompt(prompt), params)
        final = self.finalize_params(params, len(pp.prompt_token_ids))
        parent = ParentRequest(request_id, final.n, final.output_kind) if final.n > 1 else None
        children = (
            [(parent.child_id(i), self.child_params(final, i)) for i in range(final.n)]
            if parent
            else [(request_id, final)]
        )
        requests, states = [], []
        for index, (core_id, child) in enumerate(children):
            requests.append(Request(core_id, pp.prompt_token_ids, child, arrival_time, pp.cache_salt))
            states.append(
                RequestState(core_id, parent, index, pp.prompt, pp.prompt_token_ids, child, self.tokenizer, arrival_time)
            )
        return ProcessedRequest(requests, states, final.output_kind)
