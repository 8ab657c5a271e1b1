"""Input processing for pooling requests: prompt -> token ids (truncated as asked), checks against
the model, and the Request the core runs. Called by Processor.process_request for PoolingParams.

Prompt forms, as for generation: a string, {"prompt": str}, token ids, {"prompt_token_ids": [...]};
a cross-encoder pair arrives tokenized, as {"prompt_token_ids": [...], "token_type_ids": [...]}.

Truncation (vLLM's truncate_prompt_tokens; sentence-transformers' rule at its max_seq_length):
text is tokenized with truncation=True, max_length=k, which keeps the first k - 2 word pieces and
the special tokens ([CLS] ... [SEP]); token ids keep their last k (vLLM's rule for token input);
-1 means k = max_model_len. Without it, a prompt over max_model_len is an error, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pagedllm.engine.processor import PROMPT_KEYS, check_prompt_keys
from pagedllm.pooling.config import check_dimensions
from pagedllm.pooling.outputs import PoolingRequestState
from pagedllm.pooling.params import PoolingParams
from pagedllm.request import Request
from pagedllm.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.processor import ProcessedRequest, Processor, PromptType

# Which endpoints each runner serves, for the error a request of the wrong kind gets.
GENERATE_ENDPOINTS = "/v1/completions, /v1/chat/completions (LLM.generate, LLM.chat)"
POOLING_ENDPOINTS = "/v1/embeddings, /pooling, /v1/score, /rerank, /classify (LLM.embed, LLM.score, LLM.encode)"
# A pooling prompt dict may carry token_type_ids too (vLLM's TokensPrompt: cross-encoders' segments).
POOLING_PROMPT_KEYS = PROMPT_KEYS | {"token_type_ids"}


def wrong_runner_message(config: EngineConfig, wants_pooling: bool) -> str:
    name = config.model_config.served_model_name[0]
    if wants_pooling:
        return (f"The model {name!r} runs with runner='generate', which serves {GENERATE_ENDPOINTS}; embeddings, "
                f"scores and classification need a server started with --runner pooling and a pooling model.")
    return (f"The model {name!r} runs with runner='pooling', which serves {POOLING_ENDPOINTS}; text generation "
            f"needs a server started with --runner generate and a generative model.")


def check_runner(config: EngineConfig, is_pooling_request: bool) -> None:
    if (config.model_config.runner_type == "pooling") != is_pooling_request:
        raise ValueError(wrong_runner_message(config, is_pooling_request))


def tokenize_for_pooling(processor: Processor, prompt: PromptType, truncate: int | None) -> tuple[
        str | None, list[int], list[int] | None]:
    """(text, token ids, token type ids or None), truncated to `truncate` tokens (-1: max_model_len)."""
    max_len = processor.max_model_len
    k = max_len if truncate == -1 else truncate
    if k is not None and k > max_len:
        raise ValueError(f"truncate_prompt_tokens ({k}) is larger than the model's max_model_len ({max_len}).")
    text, ids, types = None, None, None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, Mapping):
        check_prompt_keys(prompt, POOLING_PROMPT_KEYS)  # before the dict is rebuilt below
        text, ids, types = prompt.get("prompt"), prompt.get("prompt_token_ids"), prompt.get("token_type_ids")
    if ids is None and isinstance(text, str) and k is not None:
        if processor.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init); pass prompt_token_ids.")
        ids = processor.tokenizer(text, truncation=True, max_length=k)["input_ids"]
        prompt = {"prompt": text, "prompt_token_ids": ids}
    pp = processor.tokenize_prompt(prompt, POOLING_PROMPT_KEYS)
    ids = pp.prompt_token_ids
    if k is not None and len(ids) > k:
        ids = ids[-k:]
        types = types[-k:] if types is not None else None
    if types is not None and len(types) != len(ids):
        raise ValueError(f"token_type_ids has {len(types)} entries for {len(ids)} prompt tokens.")
    if len(ids) > max_len:
        raise ValueError(
            f"This model's maximum context length is {max_len} tokens. However, you requested {len(ids)} tokens "
            "in the input for embedding generation. Please reduce the length of the input, or set "
            "truncate_prompt_tokens (-1: truncate to the model's limit)."
        )
    return pp.prompt, ids, types


def process_pooling_request(processor: Processor, request_id: str, prompt: PromptType, params: Any,
                            arrival_time: float) -> ProcessedRequest:
    from pagedllm.engine.processor import ProcessedRequest

    config = processor.config
    if not isinstance(params, PoolingParams):
        raise ValueError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}.")
    check_runner(config, True)
    pooler = config.model_config.pooler_config
    params = params.clone()
    if params.dimensions is not None:
        if pooler.task != "embed":
            raise ValueError("dimensions applies to embeddings only; this model classifies.")
        check_dimensions(config.model_config.hf_config, params.dimensions)
    text, ids, types = tokenize_for_pooling(processor, prompt, params.truncate_prompt_tokens)
    if types is not None:
        params.extra_kwargs = {**(params.extra_kwargs or {}), "token_type_ids": list(types)}
    params.output_kind = RequestOutputKind.FINAL_ONLY
    request = Request(request_id, ids, None, arrival_time, pooling_params=params)
    state = PoolingRequestState(request_id, text, ids, arrival_time)
    return ProcessedRequest([request], [state], RequestOutputKind.FINAL_ONLY)  # type: ignore[list-item]
