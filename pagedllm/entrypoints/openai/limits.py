"""Per-request limits of the server, checked on the event loop before any tokenization.

Each limit is a flag (docs/LIMITS.md lists them all). SamplingParams keeps hard ceilings of its own
(MAX_N, MAX_STOP_STRINGS, ...) that hold for the offline `LLM` too; the server's flags may only
lower them, and are checked first so the error names the flag an operator can change:

    {"n": 500}  ->  400 "n must be an integer in [1, 128] (--max-n), got 500."
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_N, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS

# --max-prompt-bytes default: this many bytes of prompt text per token of max_model_len (no real
# tokenizer packs more than a few bytes into a token), and never less than MIN_AUTO_PROMPT_BYTES.
AUTO_PROMPT_BYTES_PER_TOKEN = 32
MIN_AUTO_PROMPT_BYTES = 64 * 1024
# Defaults of the count limits (docs/LIMITS.md says why each is safe and enough).
DEFAULT_MAX_JSON_VALUES = 1_000_000  # json_body.py: the largest body decodes in tens of ms (BENCHMARKS.md)
DEFAULT_MAX_MESSAGES = 2048
DEFAULT_MAX_CONTENT_PARTS = 256
DEFAULT_MAX_STOP_TOKEN_IDS = 1024
DEFAULT_MAX_TOOLS = 128  # OpenAI's own limit on functions
DEFAULT_MAX_PROMPT_CPU_SECONDS = 2.0
# Not a flag: a request_id is echoed in every chunk of a stream and in logs.
MAX_REQUEST_ID_LEN = 512


@dataclass(frozen=True)
class ServerLimits:
    max_n: int = MAX_N
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_len: int = MAX_STOP_STRING_LEN
    max_logit_bias_entries: int = MAX_LOGIT_BIAS_ENTRIES
    max_logprobs: int = 20
    max_prompt_bytes: int = MIN_AUTO_PROMPT_BYTES
    max_model_len: int = 2048
    max_json_values: int = DEFAULT_MAX_JSON_VALUES
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_content_parts: int = DEFAULT_MAX_CONTENT_PARTS
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    max_tools: int = DEFAULT_MAX_TOOLS
    # Prompts of one completions request: at most what the server ever runs or queues at once.
    max_prompts: int = 1088
    max_prompt_cpu_seconds: float = DEFAULT_MAX_PROMPT_CPU_SECONDS

    def __post_init__(self) -> None:
        for name, ceiling in (
            ("max_n", MAX_N),
            ("max_stop_strings", MAX_STOP_STRINGS),
            ("max_stop_string_len", MAX_STOP_STRING_LEN),
            ("max_logit_bias_entries", MAX_LOGIT_BIAS_ENTRIES),
        ):
            v = getattr(self, name)
            low = 0 if name in ("max_stop_strings", "max_logit_bias_entries") else 1
            if not low <= v <= ceiling:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be in [{low}, {ceiling}], got {v}.")
        if self.max_prompt_bytes < 1:
            raise ValueError(f"--max-prompt-bytes must be >= 1, got {self.max_prompt_bytes}.")
        for name in ("max_json_values", "max_messages", "max_content_parts", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        for name in ("max_stop_token_ids", "max_tools"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}.")
        if not self.max_prompt_cpu_seconds > 0:
            raise ValueError(f"--max-prompt-cpu-seconds must be > 0, got {self.max_prompt_cpu_seconds}.")

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, max_model_len: int, max_logprobs: int, max_prompts: int = 1088
    ) -> ServerLimits:
        prompt_bytes = args.max_prompt_bytes
        if prompt_bytes is None:
            prompt_bytes = max(MIN_AUTO_PROMPT_BYTES, AUTO_PROMPT_BYTES_PER_TOKEN * max_model_len)
        return cls(
            max_n=args.max_n,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_len=args.max_stop_string_len,
            max_logit_bias_entries=args.max_logit_bias_entries,
            max_logprobs=max_logprobs,
            max_prompt_bytes=prompt_bytes,
            max_model_len=max_model_len,
            max_json_values=args.max_json_values,
            max_messages=args.max_messages,
            max_content_parts=args.max_content_parts,
            max_stop_token_ids=args.max_stop_token_ids,
            max_tools=args.max_tools,
            max_prompts=max_prompts,
            max_prompt_cpu_seconds=args.max_prompt_cpu_seconds,
        )

    # -- counts, on the decoded JSON before any typed validation ---------------------------------
    def check_counts(self, obj: dict[str, Any]) -> None:
        """Every list field of any endpoint's body, by length only (O(fields), whatever the lists
        hold), so typed validation and everything after it work on bounded data. Wrong types are
        left to the typed validation, which names them."""
        def too_many(param: str, got: int, limit: int, flag: str, what: str) -> APIError:
            return APIError(f"{param} may hold at most {limit} {what} ({flag}), got {got}.", param=param)

        prompt = obj.get("prompt")
        # With truncate_prompt_tokens a longer token prompt is fine: it is cut before it is checked
        # (serving_completion.py); the body's size bound (--max-json-values) still holds it.
        truncated = obj.get("truncate_prompt_tokens") is not None
        if isinstance(prompt, list):
            if prompt and isinstance(prompt[0], int):  # one prompt of token ids
                if len(prompt) >= self.max_model_len and not truncated:
                    self.check_prompt_token_ids(len(prompt), None, "prompt")
            else:
                if len(prompt) > self.max_prompts:
                    raise APIError(
                        f"prompt may hold at most {self.max_prompts} prompts (what the server runs or queues at "
                        f"once: --max-num-seqs + --max-num-queued-reqs), got {len(prompt)}.",
                        param="prompt",
                    )
                for p in prompt:
                    if isinstance(p, list) and len(p) >= self.max_model_len and not truncated:
                        self.check_prompt_token_ids(len(p), None, "prompt")
        tokens = obj.get("tokens")  # /detokenize
        if isinstance(tokens, list) and len(tokens) > self.max_model_len:
            raise too_many("tokens", len(tokens), self.max_model_len, "--max-model-len", "token ids")
        messages = obj.get("messages")
        if isinstance(messages, list):
            if len(messages) > self.max_messages:
                raise too_many("messages", len(messages), self.max_messages, "--max-messages", "messages")
            for i, m in enumerate(messages):
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, list) and len(content) > self.max_content_parts:
                    raise too_many(f"messages[{i}].content", len(content), self.max_content_parts,
                                   "--max-content-parts", "content parts")
        stop = obj.get("stop")
        if isinstance(stop, list) and len(stop) > self.max_stop_strings:
            raise too_many("stop", len(stop), self.max_stop_strings, "--max-stop-strings", "strings")
        ids = obj.get("stop_token_ids")
        if isinstance(ids, list) and len(ids) > self.max_stop_token_ids:
            raise too_many("stop_token_ids", len(ids), self.max_stop_token_ids, "--max-stop-token-ids", "token ids")
        bias = obj.get("logit_bias")
        if isinstance(bias, dict) and len(bias) > self.max_logit_bias_entries:
            raise too_many("logit_bias", len(bias), self.max_logit_bias_entries, "--max-logit-bias-entries",
                           "entries")
        tools = obj.get("tools")
        if isinstance(tools, list) and len(tools) > self.max_tools:
            raise too_many("tools", len(tools), self.max_tools, "--max-tools", "tools")
        rid = obj.get("request_id")
        if isinstance(rid, str) and len(rid) > MAX_REQUEST_ID_LEN:
            raise APIError(
                f"request_id may be at most {MAX_REQUEST_ID_LEN} characters, got {len(rid)}.", param="request_id"
            )

    # -- checks ------------------------------------------------------------------------------------
    def check_sampling(self, request: Any, *, logprobs_field: str) -> None:
        """n, stop, logit_bias and logprobs of a chat or completions request (pydantic has already
        checked the JSON types). `logprobs_field` is the field that carries the count:
        "top_logprobs" for chat, "logprobs" for completions."""
        n = request.n
        if n is not None and not 1 <= n <= self.max_n:
            raise APIError(f"n must be an integer in [1, {self.max_n}] (--max-n), got {n}.", param="n")
        stop = request.stop
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > self.max_stop_strings:
            raise APIError(
                f"stop may hold at most {self.max_stop_strings} strings (--max-stop-strings), got {len(stops)}.",
                param="stop",
            )
        for s in stops:
            if not s:
                raise APIError("stop strings must be non-empty; remove the empty string from stop.", param="stop")
            if len(s) > self.max_stop_string_len:
                raise APIError(
                    f"each stop string may be at most {self.max_stop_string_len} characters "
                    f"(--max-stop-string-len), got one of {len(s)}.",
                    param="stop",
                )
        bias = request.logit_bias
        if bias is not None and len(bias) > self.max_logit_bias_entries:
            raise APIError(
                f"logit_bias may hold at most {self.max_logit_bias_entries} entries (--max-logit-bias-entries), "
                f"got {len(bias)}.",
                param="logit_bias",
            )
        count = getattr(request, logprobs_field)
        if isinstance(count, int) and not isinstance(count, bool):
            if count < 0:
                raise APIError(f"{logprobs_field} must be >= 0, got {count}.", param=logprobs_field)
            if count > self.max_logprobs:
                raise APIError(
                    f"{logprobs_field}={count} is more than the server's max_logprobs ({self.max_logprobs}, "
                    "--max-logprobs).",
                    param=logprobs_field,
                )

    def check_prompt_bytes(self, num_bytes: int, param: str) -> None:
        if num_bytes > self.max_prompt_bytes:
            raise APIError(
                f"The prompt is {num_bytes} bytes of text; the limit is {self.max_prompt_bytes} bytes "
                "(--max-prompt-bytes). Please shorten it.",
                param=param,
            )

    def check_max_tokens(self, max_tokens: int | None, param: str) -> None:
        """max_tokens that leaves no room for even a one-token prompt is refused before tokenizing."""
        if max_tokens is not None and max_tokens >= self.max_model_len:
            raise APIError(
                f"{param}={max_tokens} is too large: this model's maximum context length is {self.max_model_len} "
                f"tokens, prompt and completion together, so {param} may be at most {self.max_model_len - 1}.",
                param=param,
                code="context_length_exceeded",
            )

    def check_prompt_token_ids(self, num_tokens: int, max_tokens: int | None, param: str) -> None:
        """Token-id prompts: too long for the model is known before anything is queued."""
        if num_tokens >= self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the prompt has "
                f"{num_tokens} tokens, leaving no room for output. Please shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and num_tokens + max_tokens > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_tokens + max_tokens} tokens ({num_tokens} in the prompt, {max_tokens} in the completion). "
                "Please reduce the prompt or max_tokens.",
                param=param,
                code="context_length_exceeded",
            )
