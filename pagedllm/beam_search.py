"""`LLM.beam_search` (vLLM's offline beam search): its parameters, its outputs and the search itself.

As in vLLM, the search runs above the engine: every step asks `LLM.generate` for one token of each
live beam with the top 2 * beam_width logprobs (the prefix cache keeps the beams' shared prefill
cheap), extends each beam by each candidate, and keeps the beam_width best by
`get_beam_search_score`. A beam that ends in EOS is set aside as completed; at the end the completed
and the live beams compete for the beam_width places. vLLM's quirks are kept on purpose, so scripts
rank and print as they did: the length in the score counts the prompt's tokens, and a sequence's
`tokens` and `text` hold the prompt followed by the completion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tqdm.auto import tqdm

from pagedllm.outputs import Logprob
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.outputs import RequestOutput


class LLM(Protocol):
    """What the search asks of `pagedllm.LLM` (named here, not imported: entrypoints/llm.py imports this module)."""

    llm_engine: Any

    def get_tokenizer(self) -> Any: ...

    def generate(self, prompts: Any, sampling_params: Any = None, use_tqdm: Any = True) -> list[RequestOutput]: ...


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens and then the generated ones, one logprobs dict per generated token."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (ended in EOS) | "length" (max_tokens)
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beam_width best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's score: the cumulative logprob over the sequence's length (prompt included, a final EOS not)
    to the power length_penalty."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


def _prompt_tokens(llm: LLM, prompt: Any) -> list[int]:
    """vLLM's beam_search prompts are TokensPrompt / TextPrompt dicts; a string or a token-id list also runs."""
    if isinstance(prompt, dict):
        if prompt.get("prompt_token_ids") is not None:
            return list(prompt["prompt_token_ids"])
        prompt = prompt.get("prompt")
    if isinstance(prompt, list):
        return list(prompt)
    if not isinstance(prompt, str):
        raise TypeError(f"beam_search prompts must be TextPrompt / TokensPrompt dicts, strings or token-id lists, "
                        f"got {type(prompt).__name__}.")
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError("this engine has no tokenizer (skip_tokenizer_init); pass prompt_token_ids.")
    return tokenizer.encode(prompt)


def beam_search(llm: LLM, prompts: Sequence[Any], params: BeamSearchParams, use_tqdm: bool | Callable[..., Any] = False,
                concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    max_logprobs = llm.llm_engine.config.max_logprobs
    if 2 * params.beam_width > max_logprobs:
        raise ValueError(f"beam_width={params.beam_width} needs {2 * params.beam_width} logprobs a step, more than "
                         f"max_logprobs ({max_logprobs}); start the LLM with max_logprobs={2 * params.beam_width}.")
    if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}.")
    tokenizer = llm.get_tokenizer()
    eos_ids = set() if params.ignore_eos else set(llm.llm_engine.processor.eos_token_ids)
    eos_id = getattr(tokenizer, "eos_token_id", None)

    def score(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_id, params.length_penalty)

    step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature,
                                 ignore_eos=True)
    instances: list[tuple[list[BeamSearchSequence], list[BeamSearchSequence]]] = []
    max_len = llm.llm_engine.model_config.max_model_len
    for p in prompts:
        tokens = _prompt_tokens(llm, p)
        if len(tokens) + params.max_tokens > max_len:
            raise ValueError(f"This model's maximum context length is {max_len} tokens; a prompt of {len(tokens)} "
                             f"tokens and max_tokens={params.max_tokens} do not fit. Reduce the prompt or max_tokens.")
        instances.append(([BeamSearchSequence(tokens)], []))
    limit = concurrency_limit or max(len(instances), 1)
    bar_cls = use_tqdm if callable(use_tqdm) else tqdm
    for start in range(0, len(instances), limit):
        batch = instances[start:start + limit]
        steps = bar_cls(range(params.max_tokens), desc="Beam search", unit="token", disable=not use_tqdm)
        for _ in steps:
            live = [(i, beam) for i, (beams, _) in enumerate(batch) for beam in beams]
            if not live:
                break
            outs = llm.generate([{"prompt_token_ids": beam.tokens} for _, beam in live], step_params, use_tqdm=False)
            candidates: list[list[BeamSearchSequence]] = [[] for _ in batch]
            for (i, beam), out in zip(live, outs):
                step_logprobs = out.outputs[0].logprobs[0]
                for token_id, lp in step_logprobs.items():
                    new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [step_logprobs],
                                             cum_logprob=beam.cum_logprob + lp.logprob)
                    if token_id in eos_ids:
                        new.finish_reason = "stop"
                        batch[i][1].append(new)
                    else:
                        candidates[i].append(new)
            for i, (_, completed) in enumerate(batch):
                batch[i] = (sorted(candidates[i], key=score, reverse=True)[: params.beam_width], completed)
        instances[start:start + limit] = batch
    outputs = []
    for beams, completed in instances:
        for beam in beams:
            beam.finish_reason = "length"
        best = sorted(completed + beams, key=score, reverse=True)[: params.beam_width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
        outputs.append(BeamSearchOutput(best))
    return outputs
