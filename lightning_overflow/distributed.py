"""The suite's collectives: one all-reduce per checked step, and the per-rank flag packer.

Every value that must reach the host goes into one small float64 tensor. The part that differs between ranks (loss
flags, per-rank statistics, and under FSDP2 each rank's part of the gradients' squared norms, which add up to those
of the full gradients) is summed across ranks with a single all-reduce; the part that is already identical
(gradient norms, all-reduced by DDP before ``on_before_optimizer_step``) is not reduced, so it stays bit-exact.
Then the whole tensor is read once. Every rank calls these at the same points, so no rank waits on another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["flags_by_rank", "named_on_any_rank", "objects_by_rank", "pack_per_rank", "per_rank_values", "ranks_where",
           "read_packed", "sum_and_read", "world"]


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` outside distributed runs."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def read_packed(packed: Tensor, n_summed: int, world_size: int) -> list[float]:
    """Sum the first ``n_summed`` values of 1-D ``packed`` across ranks (in place), then read all of it to the host.

    Every host read of the suite's collectives goes through here (the step record packs its values itself, in one
    concatenation; :func:`sum_and_read` is the all-summed case). Entered on every rank together.

    Args:
        packed: the values to sum over ranks (float64 where ``world_size > 1``), then values already identical on
            every rank.
        n_summed: how many values at the front are summed.
        world_size: the number of ranks (1: nothing is reduced).
    """
    if n_summed and world_size > 1:
        dist.all_reduce(packed[:n_summed], op=dist.ReduceOp.SUM)  # a contiguous view: reduced inside ``packed``
    return packed.tolist()


def sum_and_read(values: Tensor) -> list[float]:
    """Sum ``values`` across ranks in float64 (one all-reduce) and read them to the host. Entered on every rank
    together. A 1-D float64 ``values`` is reduced in place (pass a tensor of its own, as every caller builds)."""
    packed = values.reshape(-1).to(torch.float64)
    return read_packed(packed, packed.numel(), world()[1])


def pack_per_rank(values: list[Tensor], rank: int, world_size: int, device: torch.device | str) -> Tensor:
    """Place each 0-d value in this rank's slot of its own ``world_size`` block, zeros elsewhere.

    Summed across ranks, block ``i`` holds every rank's ``values[i]``; read it back with :func:`ranks_where` or by
    slicing. No host read.
    """
    packed = torch.zeros(len(values) * world_size, dtype=torch.float64, device=device)
    for i, value in enumerate(values):
        packed[i * world_size + rank] = value.detach().to(device=device, dtype=torch.float64).reshape(())
    return packed


def ranks_where(summed: list[float], world_size: int) -> list[tuple[int, ...]]:
    """For each ``world_size`` block of summed per-rank slots, the ranks whose slot is non-zero."""
    blocks = len(summed) // world_size
    return [
        tuple(r for r in range(world_size) if summed[i * world_size + r] != 0) for i in range(blocks)
    ]


def per_rank_values(values: list[Tensor], device: torch.device | str) -> list[float]:
    """Every rank's value of each 0-d ``values[i]``, as block ``i`` of ``world_size`` host floats: one all-reduce
    and one host read for all of them. Entered on every rank together."""
    rank, world_size = world()
    return sum_and_read(pack_per_rank(values, rank, world_size, device))


def flags_by_rank(flags: list[Tensor], device: torch.device | str) -> list[tuple[int, ...]]:
    """For each 0-d flag, the ranks where it is set: one all-reduce and one host read for all of them.

    Entered on every rank together.
    """
    return ranks_where(per_rank_values(flags, device), world()[1])


def objects_by_rank(obj: Any) -> list[Any]:
    """``obj`` of every rank, by rank (``[obj]`` in one process). Entered on every rank together; off the hot path
    (it pickles ``obj``)."""
    world_size = world()[1]
    if world_size == 1:
        return [obj]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def named_on_any_rank(*names: list[str]) -> tuple[list[str], ...]:
    """Each list of names joined over the ranks (rank 0's first, then each rank's new ones, in order): what one rank
    found by name, every rank names alike (a message, an error, a callback's state). Entered on every rank together;
    off the hot path (it pickles the lists)."""
    if world()[1] == 1:
        return names
    gathered = objects_by_rank(names)
    return tuple(list(dict.fromkeys(name for lists in gathered if lists is not None for name in lists[i]))
                 for i in range(len(names)))  # fmt: skip
