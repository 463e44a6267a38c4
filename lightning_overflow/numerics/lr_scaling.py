"""Scale the learning rate so that the change sticks under every torch scheduler.

Pure torch, no Lightning. Multiplying only ``param_group["lr"]`` is undone on the next ``scheduler.step()`` by every
scheduler that recomputes the rate from a reference: ``LambdaLR`` (``base_lrs``), ``OneCycleLR`` (the groups'
``initial_lr`` / ``max_lr`` / ``min_lr``), ``CyclicLR`` (``base_lrs``, ``max_lrs``), ``CosineAnnealingWarmRestarts``
and ``CosineAnnealingLR`` past ``T_max`` (``base_lrs``, ``eta_min``), ``SequentialLR`` at a milestone (the next
child restarts from its ``base_lrs``) and ``ReduceLROnPlateau``'s floor (``min_lrs``). :func:`scale_lr` multiplies
all of those together, so the schedule continues exactly ``factor`` times the one configured:

============================  ==========================================================================
where                         what is multiplied
============================  ==========================================================================
every param group             ``lr``, ``initial_lr``, ``max_lr``, ``min_lr``, ``swa_lr`` (those present)
every scheduler (and child)   ``base_lrs``, ``max_lrs``, ``min_lrs``, ``eta_min``, ``_last_lr``
``ReduceLROnPlateau``         also ``default_min_lr`` and ``eps`` (its smallest reduction, in LR units)
============================  ==========================================================================

``SequentialLR`` and ``ChainedScheduler`` are walked into their children. Everything changed lives in the
optimizer's and the schedulers' state dicts, so the scale survives a checkpoint and must not be applied again on
resume. ``_last_lr`` is what ``scheduler.get_last_lr()`` returns; ``LearningRateMonitor`` reads the groups' ``lr``.

The values are Python floats or tensors (``lr=torch.tensor(...)`` for capturable or compiled optimizers); tensors
are multiplied in place, so nothing is read back to the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_overflow._validation import check_float, check_type

__all__ = ["GROUP_LR_KEYS", "HELD", "SCHEDULER_LR_LISTS", "group_rates", "scale_group", "scale_lr", "scheduler_tree",
           "schedules"]

HELD = "lightning_overflow_held"
"""The param-group entry ``[rate, scale]`` ``LRBackoff`` keeps: the rate the suite (or a scheduler) last left in the
group, and the backoff's scale the state holds. A rate found changed, and not by a scheduler, was written by the
module's code."""

GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "swa_lr")
"""Param-group keys holding a learning rate (``initial_lr``: every ``LRScheduler``; ``max_lr``/``min_lr``:
``OneCycleLR``; ``swa_lr``: ``SWALR``, which anneals ``lr`` towards it)."""

SCHEDULER_LR_LISTS = ("base_lrs", "max_lrs", "min_lrs", "_last_lr")
"""Scheduler attributes holding one learning rate per param group."""

_SCHEDULER_LR_SCALARS: tuple[str, ...] = ("eta_min", "default_min_lr")
_PLATEAU_LR_SCALARS: tuple[str, ...] = ("eps",)


def scheduler_tree(scheduler: Any) -> Iterator[Any]:
    """``scheduler`` and, depth first, the children of ``SequentialLR`` / ``ChainedScheduler`` (each once).

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> warmup = torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=2)
        >>> decay = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
        >>> seq = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[2])
        >>> [type(s).__name__ for s in scheduler_tree(seq)]
        ['SequentialLR', 'LinearLR', 'ExponentialLR']
    """
    seen: set[int] = set()
    stack = [scheduler]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        children = getattr(current, "_schedulers", None) or ()
        stack.extend(reversed(list(children)))


def group_rates(optimizer: torch.optim.Optimizer) -> list[float]:
    """Each param group's learning rate, as a number (the journal's record of the rates a run goes on with)."""
    return [float(group["lr"]) for group in optimizer.param_groups]


def scale_lr(optimizer: torch.optim.Optimizer, factor: float, schedulers: Iterable[Any] = ()) -> None:
    """Multiply the learning rate of every param group of ``optimizer``, and every reference the schedulers
    recompute it from, by ``factor``, so that the change sticks under any torch scheduler.

    Sync-free: tensor values are multiplied in place on their device.

    Args:
        optimizer: the optimizer whose learning rate changes (all of its param groups).
        factor: the multiplier (> 0). ``0.5`` halves the rate; ``2.0`` undoes that exactly.
        schedulers: the schedulers attached to ``optimizer`` (``SequentialLR`` / ``ChainedScheduler`` children are
            found on their own). A scheduler of another optimizer is left alone.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, ``factor`` not a number, or ``schedulers`` not
            an iterable.
        ValueError: ``factor`` is not a finite positive number.

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
        >>> scale_lr(opt, 0.5, [sched])
        >>> opt.step(); sched.step()
        >>> opt.param_groups[0]["lr"]  # 0.5 x (1.0 / 2): the halving survived the scheduler
        0.25
    """
    check_type("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
    factor = check_float("factor", factor, low=0.0, low_open=True)
    check_type("schedulers", schedulers, Iterable, "an iterable of LR schedulers")
    seen: set[int] = set()
    for group in optimizer.param_groups:
        scale_group(group, factor, seen)
    for root in schedulers:
        for scheduler in scheduler_tree(root):
            if not schedules(scheduler, optimizer):
                continue
            _scale_scheduler(scheduler, factor, seen)


def scale_group(group: dict[str, Any], factor: float, seen: set[int] | None = None) -> None:
    """Multiply the rates of one param group (:data:`GROUP_LR_KEYS`) by ``factor``; ``seen``: the ids of tensors
    already scaled (one tensor reachable from two places is scaled once)."""
    seen = set() if seen is None else seen
    for key in GROUP_LR_KEYS:
        if key in group:
            group[key] = _scaled(group[key], factor, seen)


def schedules(scheduler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scheduler`` sets the learning rates of ``optimizer``: it was built on it, or on a wrapper that shares
    its param groups (Lightning Fabric's ``_FabricOptimizer``, on which litgpt-style loops build their scheduler).
    A scheduler without an ``optimizer`` attribute is taken to be ``optimizer``'s."""
    own = getattr(scheduler, "optimizer", optimizer)
    return own is optimizer or getattr(own, "param_groups", None) is optimizer.param_groups


def _scale_scheduler(scheduler: Any, factor: float, seen: set[int]) -> None:
    for name in SCHEDULER_LR_LISTS:
        values = getattr(scheduler, name, None)
        # SequentialLR shares its active child's ``_last_lr`` list: scale each list object once.
        if isinstance(values, list) and id(values) not in seen:
            seen.add(id(values))
            values[:] = [_scaled(v, factor, seen) for v in values]
    scalars = _SCHEDULER_LR_SCALARS
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scalars = scalars + _PLATEAU_LR_SCALARS
    for name in scalars:
        value = getattr(scheduler, name, None)
        if isinstance(value, (int, float, Tensor)) and not isinstance(value, bool):
            setattr(scheduler, name, _scaled(value, factor, seen))


def _scaled(value: Any, factor: float, seen: set[int]) -> Any:
    if isinstance(value, Tensor):
        if id(value) not in seen:  # one tensor reachable from two places is scaled once
            seen.add(id(value))
            value.mul_(factor)
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value * factor
    return value
