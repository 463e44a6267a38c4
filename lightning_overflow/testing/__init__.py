"""Tiny models and fault injection, shipped so that users can test their own recovery paths in CI.

>>> import tempfile
>>> import pytorch_lightning as pl
>>> from lightning_overflow import NonFiniteDetector
>>> from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor
>>> trainer = pl.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
...                      enable_model_summary=False, default_root_dir=tempfile.mkdtemp(),
...                      callbacks=[NonFiniteDetector(), FaultInjector(Fault(step=2, kind="nan_loss"))])
>>> trainer.fit(TinyRegressor())
>>> trainer.callbacks[0].skipped_steps
1
"""

from lightning_overflow.testing.faults import FAULT_KINDS, Fault, FaultInjector
from lightning_overflow.testing.models import TinyGAN, TinyRegressor, regression_data

__all__ = ["FAULT_KINDS", "Fault", "FaultInjector", "TinyGAN", "TinyRegressor", "regression_data"]
