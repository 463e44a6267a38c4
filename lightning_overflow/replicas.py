"""Replica parity: under DDP every rank holds the same weights, unless something corrupted one of them (silent data
corruption in a GPU, a bad host, a rank-local write).

Every so often each rank puts a checksum of its weights (the float64 sum and sum of squares over all parameters)
into its own slot of the step's one all-reduce; the ranks then compare the slots on the host, identically. Only
when they disagree, a second collective compares every parameter's checksum to name the ones that differ. The
cost of a check is one read of the weights, in the step's read: no collective of its own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_overflow.distributed import per_rank_values, world
from lightning_overflow.numerics.norms import real_values

__all__ = ["ReplicaMismatch", "checksum", "compare", "differing_parameters"]


def checksum(params: list[Tensor]) -> Tensor:
    """``[sum, sum of squares]`` of every parameter value, in float64, on the parameters' device (no read).

    Replicas hold bit-identical weights, and the same reduction of the same values gives the same doubles.
    """
    if not params:
        return torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        return torch.stack([_sums(p.detach()) for p in params]).sum(0)


def _sums(t: Tensor) -> Tensor:
    """``[sum, sum of squares]`` of one tensor in float64 (a complex one: of its real and imaginary parts, which
    ``double()`` alone would drop)."""
    values = real_values(t).double().reshape(-1)
    return torch.stack([values.sum(), torch.dot(values, values)])


@dataclass(frozen=True)
class ReplicaMismatch:
    """Ranks whose weights differ from the majority's."""

    ranks: tuple[int, ...]


def compare(slots: list[float], world_size: int) -> ReplicaMismatch | None:
    """From the all-reduced per-rank slots (``world_size`` sums, then ``world_size`` sums of squares), the ranks
    that disagree with the most common checksum (rank 0's on a tie), or ``None`` when all agree."""
    pairs = list(zip(slots[:world_size], slots[world_size : 2 * world_size]))
    if len(set(pairs)) <= 1:
        return None
    counts = Counter(pairs)
    majority = max(counts, key=lambda pair: (counts[pair], pair == pairs[0]))
    return ReplicaMismatch(tuple(r for r, pair in enumerate(pairs) if pair != majority))


def differing_parameters(named: list[tuple[str, Tensor]], device: torch.device | str) -> list[str]:
    """The parameters whose checksum is not the same on every rank: one all-reduce, entered by every rank."""
    summed = per_rank_values([checksum([p])[1] for _, p in named], device)
    world_size = world()[1]
    return [
        name
        for i, (name, _) in enumerate(named)
        if len(set(summed[i * world_size : (i + 1) * world_size])) > 1
    ]
