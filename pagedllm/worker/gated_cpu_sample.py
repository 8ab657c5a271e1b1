"""A gated step's sampling on the CPU (structured_output/gate.py): deferred until its tokens are needed.

On a GPU a gated step's sampling is queued behind a device wait for its bitmask. The CPU has no
stream to order it, so the sampling runs when the step's output is first read (`PendingOutput.get`)
or when the next step launches (its inputs are these tokens), whichever comes first:

    execute_model (gated) -> PendingOutput, sampled None      the grammar workers fill the bitmask
    ... pending.get()  or  the next execute_model             -> GatedCpuSample.sample(): wait for
                                                                 the fill, mask, sample, set the ids
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.structured_output.bitmask import apply_grammar_bitmask
from pagedllm.structured_output.gate import GrammarGate
from pagedllm.worker.input_batch import CachedRequestState, StepInputs
from pagedllm.worker.pending_output import PendingOutput


class ModelRunner(Protocol):
    """What a deferred sampling uses of worker/model_runner.ModelRunner (named here, not imported:
    that module imports this one)."""

    sampler: Sampler
    last_sampled: torch.Tensor | None
    gate_waits: dict[str, int]
    _gated_cpu: GatedCpuSample | None

    def _sampling_metadata(self, inp: StepInputs, states: list[CachedRequestState]) -> SamplingMetadata: ...


class GatedCpuSample:
    """A gated step on the CPU: sampled once its bitmask is filled, when first needed (its output's
    `get()`, or the next launch, whose inputs are its tokens), as a device's stream would."""

    def __init__(self, runner: ModelRunner, pending: PendingOutput, inp: StepInputs,
                 states: list[CachedRequestState], logits: torch.Tensor, gate: GrammarGate, all_rows: bool) -> None:
        self.runner, self.pending, self.inp, self.states = runner, pending, inp, states
        self.logits, self.gate, self.all_rows = logits, gate, all_rows
        pending.before_read = self.sample

    @torch.inference_mode()
    def sample(self, timeout_s: float | None = None) -> None:
        runner = self.runner
        if runner._gated_cpu is self:
            runner._gated_cpu = None
        self.pending.before_read = None
        if self.logits is None:
            return
        from pagedllm.structured_output.gate import HOST_WAIT_TIMEOUT_S, host_wait

        host_wait(self.gate, HOST_WAIT_TIMEOUT_S if timeout_s is None else timeout_s)
        runner.gate_waits["host"] = runner.gate_waits.get("host", 0) + 1
        logits, self.logits = self.logits, None
        if self.all_rows:
            rows = list(range(len(self.states)))
        else:
            row_of = {st.req_id: j for j, st in enumerate(self.states)}
            rows = [row_of[r] for r in self.gate.request_ids]
        logits = apply_grammar_bitmask(logits, self.gate.bitmask, rows)
        out = runner.sampler(logits, runner._sampling_metadata(self.inp, self.states), None)
        self.pending.sampled, self.pending.logprobs = out.sampled_token_ids, out.logprobs
        runner.last_sampled = out.sampled_token_ids  # the newest step: a later launch samples this one first

