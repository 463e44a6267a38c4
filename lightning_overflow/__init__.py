"""Lightning callbacks that keep long training runs alive through numerical overflow.

>>> import pytorch_lightning as pl
>>> from lightning_overflow import GradNormMonitor, NonFiniteDetector
>>> trainer = pl.Trainer(callbacks=[GradNormMonitor(), NonFiniteDetector()], logger=False)
"""

from lightning_overflow.callbacks import GradNormMonitor, NonFiniteDetector
from lightning_overflow.events import Event, read_journal
from lightning_overflow.exceptions import DivergenceError, NonFiniteError, OverflowWarning, RollbackError

__version__ = "0.1.0"

__all__ = [
    "DivergenceError",
    "Event",
    "GradNormMonitor",
    "NonFiniteDetector",
    "NonFiniteError",
    "OverflowWarning",
    "RollbackError",
    "__version__",
    "read_journal",
]
