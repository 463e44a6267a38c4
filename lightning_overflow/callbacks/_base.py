"""What every suite callback shares: the board of its trainer, loss observation, settling held schedulers."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from torch import Tensor
from typing_extensions import override

from lightning_overflow._compat import Callback
from lightning_overflow.events import Event
from lightning_overflow.health import HealthBoard, Signal, StepHealth, board_for


class SuiteCallback(Callback):
    """Base of the suite's callbacks. Subclasses override the template methods, not the wiring below.

    Template methods:
        ``_contribute(trainer, pl_module, record)``: add device values to the step's one host read.
        ``_after_batch(trainer, pl_module, outputs)``: act at ``on_train_batch_end`` once held schedulers are back.
        ``_counters()``: cumulative counters to log (``overflow/...``).
        ``_snapshot_extra()`` / ``_after_restore(trainer, extra)``: what to keep beside a rollback snapshot, and
            how to re-align after a rollback restored one (LRBackoff re-applies its scale there).

    Interventions read ``self.board(trainer).signals`` (detectors' :class:`~lightning_overflow.health.Signal` s of
    this batch) in ``_after_batch``.
    """

    def board(self, trainer: pl.Trainer) -> HealthBoard:
        return board_for(trainer)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.board(trainer).attach(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.board(trainer).begin_batch()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if trainer.training:
            self.board(trainer).observe_loss(trainer, loss)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        board = self.board(trainer)
        board.settle(trainer)
        self._after_batch(trainer, pl_module, outputs)
        board.log_counters(trainer, self)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.board(trainer).summarise(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.board(trainer).release()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.board(trainer).release()

    # ---- template methods -------------------------------------------------------------------------------------
    def _contribute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: StepHealth) -> None:
        """Add this callback's device statistics to the step's single read (default: nothing)."""

    def _after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        """Act at the end of a training batch (default: nothing)."""

    def _counters(self) -> dict[str, float]:
        """Cumulative counters logged under their ``overflow/...`` keys (default: none)."""
        return {}

    def _snapshot_extra(self) -> dict[str, Any]:
        """Primitives to store beside a rollback snapshot (default: nothing)."""
        return {}

    def _after_restore(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        """The training state was just restored from a snapshot taken with ``extra`` beside it (default: nothing)."""

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _event(
        self, trainer: pl.Trainer, kind: str, message: str, rank: int = 0, step: int | None = None, **details: Any
    ) -> Event:
        """Record an event; ``step`` defaults to ``trainer.global_step`` (pass it when reporting a past step)."""
        event = Event(
            step=int(trainer.global_step) if step is None else int(step),
            kind=kind,
            rank=rank,
            source=type(self).__name__,
            message=message,
            details=details,
            epoch=int(trainer.current_epoch),
        )
        self.board(trainer).record(event)
        return event

    def _signal(self, trainer: pl.Trainer, kind: str, reason: str, optimizer_index: int = 0) -> None:
        signal = Signal(kind, int(trainer.global_step), reason, type(self).__name__, optimizer_index)
        self.board(trainer).signal(signal)
