"""Run a LightningModule's ``training_step`` outside the loop (a replay, a second candidate), as Lightning calls it."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pytorch_lightning.loggers.logger import DummyLogger
from torch import Tensor

from lightning_overflow import _compat

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["loss_of", "signature_parameters", "silenced_logging", "takes_batch_idx"]


def loss_of(output: Any) -> Tensor | None:
    """The loss ``training_step`` returned: the tensor itself, or the ``"loss"`` of a dict (``None`` otherwise)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


@contextmanager
def silenced_logging(pl_module: pl.LightningModule) -> Iterator[None]:
    """Nothing a ``training_step`` logs inside the body reaches the run's logs (it would log the batch twice):
    ``self.log`` / ``self.log_dict`` do nothing, and the trainer's loggers are a dummy that absorbs every call, so
    ``self.logger.log_metrics(...)`` and ``self.logger.experiment.add_scalar(...)`` (a module that writes its own
    logs) write nothing either."""
    own = {name: _compat.replace_method(pl_module, name, _no_log) for name in ("log", "log_dict")}
    trainer = getattr(pl_module, "_trainer", None)
    loggers = list(trainer.loggers) if trainer is not None else []
    if loggers:
        trainer.loggers = [DummyLogger() for _ in loggers]  # Trainer.loggers is a public property with a setter
    try:
        yield
    finally:
        if loggers:
            trainer.loggers = loggers
        for name, previous in own.items():
            _compat.restore_method(pl_module, name, previous)


def _no_log(*_: Any, **__: Any) -> None:
    return None


def signature_parameters(function: Any) -> dict[str, inspect.Parameter]:
    """The parameters of ``function``'s signature (empty when it has none that ``inspect`` can read)."""
    try:
        return dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return {}


def takes_batch_idx(pl_module: pl.LightningModule) -> bool:
    """As Lightning decides: a ``batch_idx`` parameter, or at least two positional parameters, or ``*args``."""
    params = signature_parameters(pl_module.training_step)
    if "batch_idx" in params:
        return True
    kinds = [p.kind for p in params.values()]
    positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)
    return positional >= 2 or inspect.Parameter.VAR_POSITIONAL in kinds
