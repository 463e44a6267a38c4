"""Lightning callbacks that keep long training runs alive through numerical overflow.

>>> import pytorch_lightning as pl
>>> from lightning_overflow import default_callbacks
>>> trainer = pl.Trainer(callbacks=default_callbacks(), logger=False)
"""

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

__version__ = "0.1.0"

__all__ = [
    "AutoClip",
    "Diagnosis",
    "DivergenceError",
    "Event",
    "GradNormMonitor",
    "Headroom",
    "LRBackoff",
    "LossSpikeDetector",
    "NonFiniteDetector",
    "NonFiniteError",
    "OverflowWarning",
    "Rollback",
    "RollbackError",
    "__version__",
    "default_callbacks",
    "read_journal",
    "trace_nonfinite",
]
