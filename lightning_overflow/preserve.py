"""Leave no trace: a replay or a second candidate must not move the RNG streams, the BatchNorm statistics or any metric's state."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["RngState", "capture_rng", "metric_states", "preserved_state", "put_back_metric_states", "restore_rng"]


@dataclass(frozen=True)
class RngState:
    """The torch random streams: the CPU generator and, once CUDA is initialised, every CUDA device's generator."""

    cpu: Tensor
    cuda: tuple[Tensor, ...] | None


def capture_rng() -> RngState:
    """The torch random streams now (a 5 KB copy of the CPU state; CUDA states are a seed and an offset, no sync)."""
    # is_initialized() alone: CUDA that is not available is never initialised, and the availability check costs
    # more than the copy on every training batch.
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None
    return RngState(torch.get_rng_state(), cuda)


def restore_rng(state: RngState) -> None:
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(list(state.cuda))


@contextmanager
def preserved_state(module: nn.Module, start_rng: RngState | None = None) -> Iterator[None]:
    """Run the body, then put back every random stream, every buffer of ``module`` and every metric's state.

    Random streams: torch's CPU and CUDA generators, Python's ``random``, NumPy's global generator, and every
    ``torch.Generator`` stored as an attribute of one of the modules (those are put back, not rewound to the start
    of the step: the body runs with their current state).

    Parameters and their ``.grad`` are the caller's business (compute gradients with ``torch.autograd.grad``, which
    leaves ``.grad`` alone).

    Args:
        module: the model whose buffers (BatchNorm running statistics and counters) and torchmetrics states are kept.
        start_rng: the torch random streams to run the body with (those of the step being replayed, so that dropout
            draws the same masks); ``None`` runs it with the current streams.

    Example:
        >>> bn = nn.BatchNorm1d(2)
        >>> with preserved_state(bn):
        ...     _ = bn(torch.randn(4, 2))
        >>> bn.running_mean, int(bn.num_batches_tracked)
        (tensor([0., 0.]), 0)
    """
    rng = capture_rng()
    python_rng = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_rng = numpy.random.get_state() if numpy is not None else None
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    metrics = metric_states(module)
    owned = [g for m in module.modules() for g in vars(m).values() if isinstance(g, torch.Generator)]
    generators = [(g, g.get_state()) for g in owned]
    if start_rng is not None:
        restore_rng(start_rng)
    try:
        yield
    finally:
        restore_rng(rng)
        for generator, state in generators:
            generator.set_state(state)
        random.setstate(python_rng)
        if numpy is not None:
            numpy.random.set_state(numpy_rng)
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
        put_back_metric_states(metrics)


def metric_states(module: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """A copy of the state of every torchmetrics ``Metric`` among ``module``'s submodules."""
    return [(m, _metric_state(m)) for m in module.modules() if _is_metric(m)]


def put_back_metric_states(states: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Put back the states :func:`metric_states` copied."""
    for metric, state in states:
        for name, value in state.items():
            setattr(metric, name, value)


def _is_metric(module: nn.Module) -> bool:
    """A torchmetrics ``Metric`` (duck-typed: its public ``metric_state`` property)."""
    return isinstance(getattr(type(module), "metric_state", None), property)


def _metric_state(metric: nn.Module) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, value in metric.metric_state.items():  # type: ignore[operator, union-attr]
        if isinstance(value, Tensor):
            state[name] = value.detach().clone()
        elif isinstance(value, list):
            state[name] = [v.detach().clone() if isinstance(v, Tensor) else v for v in value]
        else:
            state[name] = value
    # What an update changes beside the states: its count, and the cached result of compute().
    for name in ("_update_count", "_computed"):
        if name in vars(metric):
            state[name] = vars(metric)[name]
    return state
