"""A pipeline stage's step: receive the previous stage's activations, run this stage's layers, send
them on; and the sampled token ids handed back to every stage.

Per step and per stage boundary, for T scheduled tokens (every rank knows T from the step's
SchedulerOutput, so no shape travels):

    stage s -> s+1   hidden_states (T, hidden) and residual (T, hidden), model dtype
    last -> all      the sampled ids (R,) int64, R = requests that sample this step (a broadcast
                     over the PP group): each stage keeps its own copy of every request's tokens

Dummy passes (memory profiling, kernel warm-up) run each stage alone on zeros, without talking.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import GroupCoordinator, get_pp_group
from pagedllm.models.utils import IntermediateTensors


def _stage_inputs(model: nn.Module, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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
        hidden, residual = _stage_inputs(model, input_ids.shape[0], input_ids.device)
        pp.recv(hidden, pp.prev_rank)
        pp.recv(residual, pp.prev_rank)
        intermediate = IntermediateTensors({"hidden_states": hidden, "residual": residual})
    out = model(input_ids, positions, md, intermediate)
    if pp.is_last_rank:
        return out
    pp.send(out["hidden_states"], pp.next_rank)
    pp.send(out["residual"], pp.next_rank)
    return None


def dummy_forward_stage(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                        md: AttentionMetadata) -> torch.Tensor | None:
    """A forward pass of this stage alone on zero activations (profiling, warm-up): the hidden
    states on the last stage, None on the others. Nothing is sent."""
    pp = get_pp_group()
    if pp.world_size == 1:
        return model(input_ids, positions, md)
    intermediate = None
    if not pp.is_first_rank:
        hidden, residual = _stage_inputs(model, input_ids.shape[0], input_ids.device)
        intermediate = IntermediateTensors({"hidden_states": hidden.zero_(), "residual": residual.zero_()})
    out = model(input_ids, positions, md, intermediate)
    return out if pp.is_last_rank else None


def share_sampled(sampled: torch.Tensor | None, num_rows: int, device: torch.device,
                  pp: GroupCoordinator | None = None) -> torch.Tensor:
    """The last stage's sampled ids (R,) int64 on every stage of the pipeline (`sampled` is None on
    the stages that did not sample). One rank: `sampled` itself."""
    pp = pp or get_pp_group()
    if pp.world_size == 1:
        assert sampled is not None
        return sampled
    buf = sampled.to(torch.int64) if sampled is not None else torch.empty(num_rows, dtype=torch.int64, device=device)
    return pp.broadcast(buf, src=pp.world_size - 1)
