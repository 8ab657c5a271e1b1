"""The offline `LLM` class, as in vLLM: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import gc
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from pagedllm.beam_search import BeamSearchOutput, beam_search
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.gc_heap import unfreeze_gc_heap
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import PromptType
from pagedllm.entrypoints.chat_utils import check_chat_template_kwargs, check_tools, render_chat
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedllm.vllm_flags import check_llm_kwargs

_ENGINE_ARG_NAMES = {f.name for f in dataclasses.fields(EngineArgs)}
# LLM.chat's chat_template_content_format values that mean what runs: content rendered as a string.
_CONTENT_FORMATS = ("auto", "string")


def check_lora_request(lora_request: Any) -> None:
    """vLLM's calls take lora_request=None (a script that passes it explicitly must run); an adapter is
    refused, never run without it."""
    if lora_request is not None and lora_request != []:
        raise ValueError("lora_request is not supported: LoRA adapters are not built; merge the adapter into the "
                         "weights first.")


def check_priority(priority: Any, num_prompts: int) -> None:
    """vLLM's priority (one per prompt): only 0, the first-come-first-served policy, runs here."""
    if priority is None:
        return
    if not isinstance(priority, Sequence) or isinstance(priority, str) or len(priority) != num_prompts:
        raise ValueError(f"priority must be a list of one integer per prompt ({num_prompts}), got {priority!r:.60}.")
    if any(p != 0 for p in priority):
        raise ValueError(f"priority {list(priority)!r:.60} is not supported: requests are served first come, first "
                         "served; priority scheduling is not built.")


def check_no_kwargs(name: str, value: Any, why: str) -> None:
    """vLLM's per-call dicts (tokenization_kwargs, mm_processor_kwargs): None or empty asks for nothing."""
    if value:
        raise ValueError(f"{name}={value!r:.60} is not supported: {why}.")


class LLM:
    """vLLM's offline entry point. Keyword arguments are EngineArgs' fields; vLLM's arguments that
    only mean something in vLLM's design (use_v2_block_manager, num_scheduler_steps, ...) are
    accepted with one warning each, and those of features not built are refused by name
    (pagedllm/vllm_flags.py holds the table)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        kwargs = check_llm_kwargs(kwargs, _ENGINE_ARG_NAMES)
        unknown = sorted(set(kwargs) - _ENGINE_ARG_NAMES)
        if unknown:
            raise TypeError(
                f"LLM() got unsupported argument(s): {', '.join(unknown)}. Supported: {', '.join(sorted(_ENGINE_ARG_NAMES))}."
            )
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def __del__(self) -> None:
        """`del llm` frees the model, the KV cache and the CUDA graphs at once, as in vLLM, so the
        next `LLM(...)` in the process finds the GPU memory free (seed §4.3 / §7.1's loop:
        `del llm; torch.cuda.empty_cache()`, with no gc.collect()). The engine's objects hold
        reference cycles (a layer's parameters point back at it through their weight_loader) and
        were frozen out of the collector's sight at start (engine/gc_heap.py), so plain
        reference counting would never free them: drop the engine, hand the heap back, collect."""
        engine = self.__dict__.pop("llm_engine", None)
        if engine is None:
            return  # __init__ failed before the engine existed
        engine.shutdown()
        del engine
        unfreeze_gc_heap()
        gc.collect()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.processor.default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's LLM.reset_prefix_cache); False while requests run."""
        return self.llm_engine.reset_prefix_cache()

    # vLLM's LLM methods for what is not built here: each refuses by name and says why (an AttributeError
    # would read as a typo in the caller's script).
    def sleep(self, level: int = 1) -> None:
        raise NotImplementedError("LLM.sleep is not built: pagedllm keeps its weights and KV cache resident for the "
                                  "LLM's life; delete the LLM to free the GPU.")

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise NotImplementedError("LLM.wake_up is not built (LLM.sleep is not either): the LLM never sleeps.")

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        raise NotImplementedError("LLM.collective_rpc is not built: the workers take no calls from outside the "
                                  "engine (weights are loaded once, at start).")

    def apply_model(self, func: Callable[..., Any]) -> list:
        raise NotImplementedError("LLM.apply_model is not built: the model may run in another process, out of "
                                  "the caller's reach.")

    # -- generation --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        *,
        lora_request: Any = None,
        priority: list[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        check_lora_request(lora_request)
        check_no_kwargs("tokenization_kwargs", tokenization_kwargs,
                        "prompts are tokenized with the model's defaults; use SamplingParams.truncate_prompt_tokens")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError(
                f"prompts must be a string, a token-id list, a prompt dict or a list of them, got {type(prompts).__name__}."
            )
        prompts = list(prompts)
        check_priority(priority, len(prompts))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            if not isinstance(sampling_params, Sequence) or not all(
                isinstance(p, SamplingParams) for p in sampling_params
            ):
                raise TypeError("sampling_params must be a SamplingParams or a list of them (one per prompt).")
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; give one or one per prompt."
                )
        return self._run(prompts, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat, its arguments in vLLM's order. continue_final_message renders the last
        (assistant) message open, for the model to continue; it takes add_generation_prompt=False."""
        if not isinstance(messages, list):
            raise TypeError(f"messages must be a list of {{role, content}} dicts (or a list of such lists), "
                            f"got {type(messages).__name__}.")
        check_lora_request(lora_request)
        check_no_kwargs("mm_processor_kwargs", mm_processor_kwargs,
                        "multimodal inputs are not built (pagedllm serves text-only models)")
        if chat_template_content_format not in _CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} is not supported: "
                             "message content is rendered as strings (text parts joined); use 'auto' or 'string'.")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true; set "
                             "add_generation_prompt=False to continue the final message.")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        check_tools(tools)  # the server's check: a malformed tool is a ValueError naming it, not a template error
        check_chat_template_kwargs(chat_template_kwargs)  # before it is merged: a list would be no Mapping
        kwargs = dict(chat_template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True  # transformers' apply_chat_template argument
        tok = self.llm_engine.tokenizer
        prompts: list[PromptType] = []
        for conv in conversations:
            text = render_chat(tok, conv, chat_template, add_generation_prompt, kwargs or None, tools=tools)
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: Sequence[Any], params: BeamSearchParams, lora_request: Any = None,
                    use_tqdm: bool | Callable[..., Any] = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's offline beam search over TextPrompt / TokensPrompt dicts (pagedllm/beam_search.py)."""
        check_lora_request(lora_request)
        return beam_search(self, prompts, params, use_tqdm, concurrency_limit)

    # -- pooling (runner="pooling"): pagedllm/pooling/offline.py --------------------------------------
    def encode(self, prompts: Any, pooling_params: Any = None, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None, pooling_task: str | None = None,
               tokenization_kwargs: dict[str, Any] | None = None) -> list:
        from pagedllm.pooling import offline

        check_lora_request(lora_request)
        check_no_kwargs("tokenization_kwargs", tokenization_kwargs,
                        "prompts are tokenized with the model's defaults; use truncate_prompt_tokens")
        return offline.encode(self, prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, pooling_task=pooling_task)

    def embed(self, prompts: Any, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable[..., Any] = True, pooling_params: Any = None, lora_request: Any = None) -> list:
        from pagedllm.pooling import offline

        check_lora_request(lora_request)
        return offline.embed(self, prompts, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                             pooling_params=pooling_params)

    def classify(self, prompts: Any, *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool | Callable[..., Any] = True, pooling_params: Any = None,
                 lora_request: Any = None) -> list:
        from pagedllm.pooling import offline

        check_lora_request(lora_request)
        return offline.classify(self, prompts, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                                pooling_params=pooling_params)

    def score(self, data_1: Any, data_2: Any, /, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable[..., Any] = True, pooling_params: Any = None, lora_request: Any = None) -> list:
        from pagedllm.pooling import offline

        check_lora_request(lora_request)
        return offline.score(self, data_1, data_2, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm, pooling_params=pooling_params)

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams],
             use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                rid = str(next(self._counter))
                engine.add_request(rid, prompt, params)
                ids.append(rid)
        except Exception:  # a refused prompt (ValueError, TypeError): the ones added before it must not run on
            engine.abort_request(ids)
            raise
        return engine.run_to_completion(ids, use_tqdm)
