"""The suite's one collective per checked step.

Every value that must reach the host goes into one small float64 tensor. The part that differs between ranks (loss
flags, per-rank statistics) is summed across ranks with a single all-reduce; the part that is already identical
(gradient norms, all-reduced by DDP before ``on_before_optimizer_step``) is not reduced, so it stays bit-exact.
Then the whole tensor is read once. Every rank calls this at the same points, so no rank waits on another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["reduce_and_read"]


def reduce_and_read(summed: Tensor, local: Tensor) -> tuple[list[float], list[float]]:
    """Sum ``summed`` across ranks, then read both tensors to the host with one transfer.

    Args:
        summed: 1-D float64 values to add up over ranks.
        local: 1-D float64 values already identical on every rank.

    Returns:
        ``(summed values, local values)`` as Python floats.
    """
    packed = torch.cat([summed.to(torch.float64), local.to(device=summed.device, dtype=torch.float64)])
    n = summed.numel()
    if n and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        head = packed[:n]  # a contiguous view: reduced in place inside ``packed``
        dist.all_reduce(head, op=dist.ReduceOp.SUM)
    values = packed.tolist()
    return values[:n], values[n:]
