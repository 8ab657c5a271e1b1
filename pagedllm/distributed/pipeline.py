"""A pipeline stage's step: receive the previous stage's activations, run this stage's layers, send
them on.

Per step and per stage boundary, for T scheduled tokens (every rank knows T from the step's
SchedulerOutput, so no shape travels):

    stage s -> s+1   hidden_states (T, hidden) and residual (T, hidden), model dtype

Nothing travels back: the sampled ids reach the driver from the last stage, and every stage from
the driver, in the next SchedulerOutput that schedules the request (vLLM's new_token_ids). So a
stage that has sent batch k's activations starts batch k+1 at once while the next stage computes
batch k (the engine core's batch queue keeps up to pipeline_parallel_size batches in flight).

Dummy passes (memory profiling, kernel warm-up) run each stage alone on zeros, without talking.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import GroupCoordinator, get_pp_group
from pagedllm.models.utils import IntermediateTensors


def stage_input_buffers(model: nn.Module, num_tokens: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (num_tokens, hidden) hidden-states and residual buffers in the model's dtype."""
    hidden_size = int(model.config.hidden_size)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return (torch.empty((num_tokens, hidden_size), dtype=dtype, device=device),
            torch.empty((num_tokens, hidden_size), dtype=dtype, device=device))


def forward_stage(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                  pp: GroupCoordinator | None = None) -> torch.Tensor | None:
    """This stage's share of one forward pass: the last stage's hidden states (T, hidden), None on
    the others (their output went to the next stage)."""
    pp = pp or get_pp_group()
    if pp.world_size == 1:
        return model(input_ids, positions, md)
    intermediate = None
    if not pp.is_first_rank:
        intermediate = recv_stage_inputs(pp, *stage_input_buffers(model, input_ids.shape[0], input_ids.device))
    out = model(input_ids, positions, md, intermediate)
    if pp.is_last_rank:
        return out
    send_stage_outputs(pp, out, input_ids.shape[0])
    return None


def recv_stage_inputs(pp: GroupCoordinator, hidden: torch.Tensor, residual: torch.Tensor) -> IntermediateTensors:
    """The previous stage's activations, received into `hidden` and `residual` (T, hidden) (a CUDA
    graph's static buffers, or fresh ones)."""
    pp.recv(hidden, pp.prev_rank)
    pp.recv(residual, pp.prev_rank)
    return IntermediateTensors({"hidden_states": hidden, "residual": residual})


def send_stage_outputs(pp: GroupCoordinator, out: IntermediateTensors, num_tokens: int) -> None:
    """This stage's first `num_tokens` rows of activations to the next stage (a padded CUDA graph's
    output holds more rows; the next stage expects exactly the step's tokens)."""
    pp.send(out["hidden_states"][:num_tokens], pp.next_rank)
    pp.send(out["residual"][:num_tokens], pp.next_rank)


def dummy_forward_stage(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                        md: AttentionMetadata) -> torch.Tensor | None:
    """A forward pass of this stage alone on zero activations (profiling, warm-up): the hidden
    states on the last stage, None on the others. Nothing is sent."""
    pp = get_pp_group()
    if pp.world_size == 1:
        return model(input_ids, positions, md)
    intermediate = None
    if not pp.is_first_rank:
        hidden, residual = stage_input_buffers(model, input_ids.shape[0], input_ids.device)
        intermediate = IntermediateTensors({"hidden_states": hidden.zero_(), "residual": residual.zero_()})
    out = model(input_ids, positions, md, intermediate)
    return out if pp.is_last_rank else None
