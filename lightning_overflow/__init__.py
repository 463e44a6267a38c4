"""Lightning callbacks that keep long training runs alive through numerical overflow.

>>> import pytorch_lightning as pl
>>> from lightning_overflow import default_callbacks
>>> trainer = pl.Trainer(callbacks=default_callbacks(), logger=False)

A plain PyTorch loop or a Lightning Fabric loop: ``Guard(model, optimizer)``, then ``guard.step(loss)`` after each
backward pass instead of ``optimizer.step()``.

The public names are loaded on first use (PEP 562), so that ``import lightning_overflow.numerics`` (pure torch) does
not load Lightning: the numerics work in a plain PyTorch loop without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_overflow.callbacks import (
        AutoClip,
        GradNormMonitor,
        LossSpikeDetector,
        LRBackoff,
        NonFiniteDetector,
        Rollback,
    )
    from lightning_overflow.composition import default_callbacks
    from lightning_overflow.diagnosis import Diagnosis, Headroom, trace_nonfinite
    from lightning_overflow.events import Event, read_journal
    from lightning_overflow.exceptions import DivergenceError, NonFiniteError, OverflowWarning, RollbackError
    from lightning_overflow.guard import Guard
    from lightning_overflow.preserve import side_run
    from lightning_overflow.trial import TrialConfig

__version__ = "0.1.0"

# Public name -> the module that defines it.
_SOURCES = {
    "AutoClip": "lightning_overflow.callbacks",
    "GradNormMonitor": "lightning_overflow.callbacks",
    "LossSpikeDetector": "lightning_overflow.callbacks",
    "LRBackoff": "lightning_overflow.callbacks",
    "NonFiniteDetector": "lightning_overflow.callbacks",
    "Rollback": "lightning_overflow.callbacks",
    "default_callbacks": "lightning_overflow.composition",
    "Diagnosis": "lightning_overflow.diagnosis",
    "Headroom": "lightning_overflow.diagnosis",
    "trace_nonfinite": "lightning_overflow.diagnosis",
    "Event": "lightning_overflow.events",
    "read_journal": "lightning_overflow.events",
    "DivergenceError": "lightning_overflow.exceptions",
    "NonFiniteError": "lightning_overflow.exceptions",
    "OverflowWarning": "lightning_overflow.exceptions",
    "RollbackError": "lightning_overflow.exceptions",
    "Guard": "lightning_overflow.guard",
    "side_run": "lightning_overflow.preserve",
    "TrialConfig": "lightning_overflow.trial",
}

__all__ = [
    "AutoClip",
    "Diagnosis",
    "DivergenceError",
    "Event",
    "GradNormMonitor",
    "Guard",
    "Headroom",
    "LRBackoff",
    "LossSpikeDetector",
    "NonFiniteDetector",
    "NonFiniteError",
    "OverflowWarning",
    "Rollback",
    "RollbackError",
    "TrialConfig",
    "__version__",
    "default_callbacks",
    "read_journal",
    "side_run",
    "trace_nonfinite",
]


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
