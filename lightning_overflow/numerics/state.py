"""The parameters that make up a training state."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["parameters_of"]


def parameters_of(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every parameter ``optimizer`` updates, in param-group order (the order of its ``state_dict``)."""
    return [p for group in optimizer.param_groups for p in group["params"]]
