"""Process groups for tensor and pipeline parallelism (vLLM's `parallel_state`, the part we need).

World ranks are laid out TP-major inside each pipeline stage, as vLLM does:

    tp 2, pp 2 -> world 4:   stage 0: ranks [0, 1]    stage 1: ranks [2, 3]
                             TP groups [0, 1], [2, 3]   PP groups [0, 2], [1, 3]
    world rank = pp_rank * tp_size + tp_rank

A worker process calls `init_distributed_environment` (one torch.distributed world: gloo on the
CPU, NCCL on CUDA with device `cuda:local_rank`) and then `initialize_model_parallel(tp, pp)`,
before it builds the model: layers read their group once, at construction (`get_tp_group()`), and
call its collectives in forward. A process that never initialises (the in-process uni executor)
gets the trivial group of one rank, whose collectives are identities.

The groups are process-wide state set once per worker process and torn down by
`destroy_model_parallel` when the worker stops; they are never read to decide anything per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class GroupCoordinator:
    """One TP or PP group as seen from this rank.

    `ranks` are world ranks in group order; `device_group` carries tensors on the model's device
    (NCCL on CUDA, gloo on the CPU). None for the trivial single-rank group.
    """

    ranks: list[int]
    rank: int  # this process's world rank
    device_group: dist.ProcessGroup | None = None
    name: str = ""
    # Bytes this rank sent through the group's collectives / sends since the last reset
    # (docs/DISTRIBUTED.md's measurement). Counting is a Python add per call, free beside a collective.
    bytes_sent: int = field(default=0)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """World rank of the next member (wraps around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place. A ring all-reduce sends 2 (n-1)/n of the tensor per rank."""
        if self.world_size == 1:
            return x
        n = self.world_size
        self.bytes_sent += 2 * (n - 1) * x.numel() * x.element_size() // n
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`: (..., d) -> (..., n * d) for dim -1."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        self.bytes_sent += (self.world_size - 1) * x.numel() * x.element_size()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenation along `dim` on group rank `dst` only (others get None)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if self.rank_in_group != dst:
            self.bytes_sent += x.numel() * x.element_size()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank_in_group == dst else None
        dist.gather(x, parts, dst=self.ranks[dst], group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Group rank `src`'s `x` on every rank, in place."""
        if self.world_size == 1:
            return x
        if self.rank_in_group == src:
            self.bytes_sent += (self.world_size - 1) * x.numel() * x.element_size()
        dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point-to-point to world rank `dst` (pipeline stages: hidden states and residuals)."""
        x = x.contiguous()
        self.bytes_sent += x.numel() * x.element_size()
        dist.send(x, dst=dst, group=self.device_group)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into the preallocated `x` (every rank knows the step's shapes) from world rank `src`."""
        dist.recv(x, src=src, group=self.device_group)
        return x


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


def _single() -> GroupCoordinator:
    return GroupCoordinator(ranks=[0], rank=0, name="single")


def get_world_group() -> GroupCoordinator:
    return _WORLD if _WORLD is not None else _single()


def get_tp_group() -> GroupCoordinator:
    """This rank's tensor-parallel group (the trivial one when not initialised)."""
    return _TP if _TP is not None else _single()


def get_pp_group() -> GroupCoordinator:
    """This rank's pipeline-parallel group (the trivial one when not initialised)."""
    return _PP if _PP is not None else _single()


def model_parallel_is_initialized() -> bool:
    return _TP is not None and _PP is not None


def init_distributed_environment(
    world_size: int, rank: int, local_rank: int, distributed_init_method: str, device: str
) -> None:
    """Join the torch.distributed world: NCCL with `cuda:local_rank` on CUDA, gloo on the CPU.

    `distributed_init_method` is a torch init URL, e.g. "tcp://127.0.0.1:29533" (every rank of
    every node the same). Once per process; a second call with a live world is a bug.
    """
    global _WORLD
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    kwargs = {}
    if device == "cuda":
        # NCCL binds the communicator to this device up front (no lazy per-call device guess).
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend=backend, init_method=distributed_init_method, world_size=world_size,
                            rank=rank, **kwargs)
    _WORLD = GroupCoordinator(ranks=list(range(world_size)), rank=rank, device_group=dist.group.WORLD,
                              name="world")
    logger.info("rank %d/%d joined the %s world (local rank %d)", rank, world_size, backend, local_rank)


def tp_pp_ranks(world_size: int, tp_size: int, pp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(TP groups, PP groups) as world-rank lists. tp 2, pp 2 -> ([[0, 1], [2, 3]], [[0, 2], [1, 3]])."""
    if tp_size * pp_size != world_size:
        raise ValueError(f"tensor_parallel_size {tp_size} x pipeline_parallel_size {pp_size} != world size {world_size}")
    tp_groups = [list(range(p * tp_size, (p + 1) * tp_size)) for p in range(pp_size)]
    pp_groups = [list(range(t, world_size, tp_size)) for t in range(tp_size)]
    return tp_groups, pp_groups


def initialize_model_parallel(tp_size: int, pp_size: int) -> None:
    """Create every TP and PP group (each rank must create all of them, in the same order)."""
    global _TP, _PP
    world = get_world_group()
    tp_groups, pp_groups = tp_pp_ranks(world.world_size, tp_size, pp_size)
    for kind, groups in (("tp", tp_groups), ("pp", pp_groups)):
        for ranks in groups:
            # new_group is collective over the world even for groups this rank is not in.
            pg = dist.new_group(ranks) if len(ranks) > 1 else None
            if world.rank in ranks:
                coord = GroupCoordinator(ranks=ranks, rank=world.rank, device_group=pg, name=kind)
                if kind == "tp":
                    _TP = coord
                else:
                    _PP = coord


def destroy_model_parallel() -> None:
    """Leave the world (the worker is stopping); safe to call when nothing was initialised."""
    global _WORLD, _TP, _PP
    _TP = _PP = _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()


def reset_bytes_sent() -> None:
    for g in (_WORLD, _TP, _PP):
        if g is not None:
            g.bytes_sent = 0
