"""The floating-point tensors that make up a training state: parameters and optimizer state."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["optimizer_state_tensors", "parameters_of"]


def parameters_of(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every parameter ``optimizer`` updates, in param-group order (the order of its ``state_dict``)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_tensors(
    optimizer: torch.optim.Optimizer, names: dict[int, str] | None = None
) -> tuple[list[Tensor], list[str]]:
    """The floating-point state tensors of ``optimizer`` (Adam's ``exp_avg``, ``exp_avg_sq``, momentum buffers...).

    Scalars such as Adam's ``step`` are left out: they are counts, not values that can overflow.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        names: parameter id -> name, used to label the tensors ``"<param name>.<state key>"``.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.Adam([p])
        >>> p.grad = torch.ones(2); opt.step()
        >>> optimizer_state_tensors(opt, {id(p): "w"})[1]
        ['w.exp_avg', 'w.exp_avg_sq']
    """
    names = names or {}
    tensors: list[Tensor] = []
    labels: list[str] = []
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, Tensor) and value.is_floating_point() and value.dim() > 0:
                tensors.append(value)
                labels.append(f"{names.get(id(param), 'param')}.{key}")
    return tensors, labels

