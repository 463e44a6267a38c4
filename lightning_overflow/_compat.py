"""The one place that touches Lightning's (and torch's) private API. Each item names the version it was checked on.

Checked against pytorch-lightning 2.6.6 and torch 2.13.0.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning import Callback
from torch import Tensor

__all__ = [
    "Callback",
    "batches_that_stepped",
    "scaler_of",
    "scaler_scale",
    "should_update_logs",
]


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The step value Lightning itself logs with (``LearningRateMonitor`` uses the same; 2.6.6)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether this training batch is a logging step under ``Trainer(log_every_n_steps=...)`` (2.6.6)."""
    return bool(trainer._logger_connector.should_update_logs)


def scaler_of(trainer: pl.Trainer) -> Any | None:
    """The ``GradScaler`` of a ``16-mixed`` run, ``None`` otherwise (``MixedPrecision.scaler`` is public; 2.6.6)."""
    return getattr(trainer.precision_plugin, "scaler", None)


def scaler_scale(scaler: Any) -> Tensor | None:
    """The scaler's current scale as a device tensor. ``GradScaler.get_scale()`` would read it to the host, a sync
    per call; ``_scale`` is the tensor behind it (torch 2.13.0). ``None`` before the first scaled backward."""
    return getattr(scaler, "_scale", None)
