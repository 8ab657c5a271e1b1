"""What the scheduler hands the model runner each step, and what comes back.

The runner keeps its own per-request state (token ids, block table row, sampling rows), so a step
only carries what changed: new requests in full, running ones as deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resuming after preemption (state rebuilt)."""

    req_id: str
    token_ids: list[int]  # every known token: prompt plus any output before a preemption
    num_prompt_tokens: int
    output_token_ids: list[int]  # the output part of token_ids (for penalties)
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None  # a pooling request (its sampling_params are neutral)


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Pipeline parallel only (vLLM's new_token_ids): the sampled tokens among this step's, which
    # the stages learn from here (a stage before the last never sees the sampler). They sit at
    # positions max(num_computed_tokens, num_prompt_tokens) onwards: a decode step's one token.
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget: finished, aborted or preempted since the last step.
    finished_req_ids: set[str] = field(default_factory=set)
    # The preempted ones among them: they come back (as new requests), so what outlives a
    # preemption on the worker (a seeded request's generator) is kept.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests whose last scheduled token is their newest one: this step samples for them.
    sampling_req_ids: set[str] = field(default_factory=set)
    # Some request's sampling reads its past outputs: collect the step in flight before this one.
    needs_output_history: bool = False
    # Some request that samples this step has a grammar (set by the engine core): the runner stops
    # before sampling and waits for `sample_tokens(grammar_output)` (vLLM's split).
    has_structured_output_requests: bool = False
    # Gated sampling (structured_output/gate.py; in-process executors only): the step samples with
    # its launch, its bitmask rows waited for on the device; has_structured_output_requests is then False.
    # A GrammarGate (host tensors), typed Any: the mp executor's msgspec decoder types every field,
    # and it only ever carries None.
    grammar_gate: Any = None
    # Swap preemption: (gpu block, cpu block) to copy out and (cpu block, gpu block) to copy in,
    # before this step's forward pass.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to do: no tokens and no block copies."""
        return self.total_num_scheduled_tokens == 0 and not self.blocks_to_swap_out and not self.blocks_to_swap_in


@dataclass
class ModelRunnerOutput:
    """One step's samples, in plain lists: what a worker process sends back (msgpack-encodable)."""

    req_ids: list[str]  # batch order
    sampled_token_ids: list[int]  # one per request; ignored for requests still mid-prefill
    # Per request: (token ids, logprobs, rank of sampled) with column 0 the sampled token.
    logprobs: list[tuple[list[int], list[float], int]] | None = None
    # Pooling runner: per request, its pooled output (float32 CPU tensor).
    pooler_output: list[torch.Tensor | None] | None = None
    # Prompt logprobs (worker/prompt_logprobs.py): req_id -> (first predicted prompt position, one
    # (token ids, logprobs, rank) entry per position), for the rows whose chunk held prompt positions.
    prompt_logprobs: dict[str, tuple[int, list[tuple[list[int], list[float], int]]]] | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # with "error": the message
    num_cached_tokens: int = 0
    pooling_output: torch.Tensor | None = None  # a finished pooling request's result
    # With a request's first output, when it asked for prompt logprobs: one entry per prompt token but the
    # first, (ids, logprobs, rank) with ids[0] the prompt token
    prompt_logprobs: list[tuple[list[int], list[float], int]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
