"""The base of the suite's callbacks: Lightning's hooks wired to the step pipeline of
:mod:`lightning_overflow.health`. Subclasses implement the pipeline's stages, not the hooks below."""

from __future__ import annotations

from typing import Any, ClassVar

import pytorch_lightning as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_overflow import _compat
from lightning_overflow._compat import Callback
from lightning_overflow.events import Event
from lightning_overflow.health import STAGES, HealthBoard, StepHealth, board_for
from lightning_overflow.policy import Signal, StepAction, Verdict
from lightning_overflow.snapshot_store import Snapshot
from lightning_overflow.training_state import StateCheck
from lightning_overflow.trials import TrialOutcome

__all__ = ["MONITOR", "DETECTOR", "CLIPPER", "BACKOFF", "ROLLBACK", "SuiteCallback"]

# Pipeline stages: who judges and acts first. Detectors judge before clippers, so that a skipped step is never
# clipped; LRBackoff acts before Rollback at batch end, so that the rollback carries the new LR scale.
MONITOR, DETECTOR, CLIPPER, BACKOFF, ROLLBACK = 0, 1, 2, 3, 4

# The hooks the board's leader forwards to the board; in the other suite callbacks they are muted for the fit.
_FORWARDED = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


class SuiteCallback(Callback):
    """Base of the suite's callbacks: joins the trainer's board in ``setup``; the board's leader (the first suite
    callback in ``trainer.callbacks``) forwards Lightning's per-batch hooks to it. For the fit, each callback has
    Lightning skip the per-batch hooks it has nothing to do in (the others' forwarding hooks, the hooks no suite
    callback uses), so six of them cost Lightning's hook dispatch about what one does.

    Pipeline stages (override what the callback needs; every default does nothing; the board calls a callback only in
    the stages its class overrides):
        ``_before_batch(trainer, pl_module, batch, batch_idx)``: at ``on_train_batch_start``, before the forward pass.
        ``_contribute(trainer, pl_module, record)``: add device values to the step's one host read.
        ``_judge(trainer, record)``: from the read record, return a :class:`~lightning_overflow.policy.Verdict`
            (ask for a skip, propose a clip) or ``None``.
        ``_after_step(trainer, record, action)``: learn from the step as decided; queue metrics, journal events.
        ``_after_batch(trainer, pl_module, outputs)``: act at ``on_train_batch_end`` on the batch's signals.
        ``_counters()``: cumulative counters to log (``overflow/...``).
        ``_snapshot_extra()`` / ``_after_restore(trainer, extra)``: what to keep beside a rollback snapshot, and
            how to re-align after a rollback restored one (LRBackoff re-applies its scale there).
    """

    stage: ClassVar[int] = MONITOR

    _board: HealthBoard | None = None  # the board of the fit in progress (setup to teardown)
    _joined: HealthBoard | None = None  # the board of the last fit this callback joined, kept after it (board_for)

    def board(self, trainer: pl.Trainer) -> HealthBoard:
        """The board of ``trainer``: held from ``setup`` to ``teardown``."""
        board = self._board
        return board if board is not None else board_for(trainer)

    def __getstate__(self) -> dict[str, Any]:
        """A pickled or copied callback is this one as configured, with its cumulative state, joined to no fit:
        Lightning pickles callbacks in the middle of a fit (a module's hyperparameters in every checkpoint) and
        LightningCLI and the tuner deep-copy them, and a copy must neither break on nor share the live fit's state."""
        state = self.__dict__.copy()
        state.pop("_board", None)  # one trainer's, in one process
        state.pop("_joined", None)
        # Lightning sets every callback's log and log_dict to the module's bound methods at each fit: pickled, they
        # would carry the whole model (and its data) into every checkpoint that stores the callbacks.
        state.pop("log", None)
        state.pop("log_dict", None)
        for hook in state.pop("_muted", ()):
            state.pop(hook, None)  # the instance's None that has Lightning skip the hook for this fit
        state["_muted"] = ()
        self._detach(state)
        return state

    def _detach(self, state: dict[str, Any]) -> None:
        """Drop from a copy's ``state`` what belongs to the step or the fit in progress (default: nothing)."""

    # ---- Lightning's hooks ------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unmute()
        if stage == "fit":
            _compat.check_strategy(trainer.strategy, type(self).__name__)
            board = self._board = self._joined = board_for(trainer)
            board.join(self, trainer, pl_module)
            self._muted = _compat.mute_hooks(self, self._idle_hooks(board))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        board = self.board(trainer)
        if board.leads(self):
            board.start_training(trainer)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        board = self.board(trainer)
        if board.leads(self):
            board.begin_batch(trainer, pl_module, batch, int(args[0]) if args else 0)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        board = self.board(trainer)
        if board.leads(self) and trainer.training:
            board.observe_loss(trainer, loss)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        board = self.board(trainer)
        if board.leads(self):
            board.before_optimizer_step(trainer, pl_module, optimizer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        board = self.board(trainer)
        if board.leads(self):
            board.end_batch(trainer, pl_module, outputs)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        board = self.board(trainer)
        if board.leads(self):
            if trainer.lr_scheduler_configs:  # a plateau stepped as the last epoch ended
                board.follow_plateaus(trainer)
            board.trials.end_fit(trainer, board)
            board.check_at_end(trainer)
            board.note_ending(trainer)
            board.flush(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        board = self.board(trainer)
        board.note_replaced_weights(trainer)
        board.flush(trainer)
        board.summarise(trainer)
        board.upload_journal(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        board = self.board(trainer)
        board.flush(trainer)
        board.summarise(trainer)  # every ending is told: finished, stopped or raised
        board.upload_journal(trainer)
        board.release()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.board(trainer).release()
        self._board = None
        self._unmute()

    def _unmute(self) -> None:
        _compat.unmute_hooks(self, getattr(self, "_muted", ()))
        self._muted: tuple[str, ...] = ()

    def _idle_hooks(self, board: HealthBoard) -> list[str]:
        """The per-batch hooks in which this callback has nothing to do in this fit, for Lightning to skip: those its
        class leaves to Lightning's no-op, and, unless it leads the board, those that only forward to the board."""
        cls = type(self)
        idle = [hook for hook in _compat.BATCH_HOOKS if getattr(cls, hook) is getattr(Callback, hook)]
        if not board.leads(self):
            idle += [hook for hook in _FORWARDED if getattr(cls, hook) is getattr(SuiteCallback, hook)]
        return idle

    # ---- pipeline stages --------------------------------------------------------------------------------------
    def _stages(self) -> frozenset[str]:
        """The per-step stages this callback's class implements (overrides), the only ones the board calls."""
        cls = type(self)
        return frozenset(name for name in STAGES if getattr(cls, name) is not getattr(SuiteCallback, name))

    def _before_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        """Prepare for a training batch, before its forward pass (default: nothing)."""

    def _wants_record(self) -> bool:
        """Whether this callback needs the step record now (default: yes). When no participant does, the step
        costs the suite no norm and no read."""
        return True

    def _contribute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: StepHealth) -> None:
        """Add this callback's device statistics to the step's single read (default: nothing)."""

    def _judge(self, trainer: pl.Trainer, record: StepHealth) -> Verdict | None:
        """Judge the read record (default: no objection, no clip)."""
        return None

    def _after_step(self, trainer: pl.Trainer, record: StepHealth, action: StepAction) -> None:
        """Learn from the step as decided (default: nothing)."""

    def _after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        """Act at the end of a training batch (default: nothing)."""

    def _counters(self) -> dict[str, float]:
        """Cumulative counters logged under their ``overflow/...`` keys (default: none)."""
        return {}

    def _snapshot_extra(self) -> dict[str, Any]:
        """Primitives to store beside a rollback snapshot (default: nothing)."""
        return {}

    def _settings(self) -> tuple[float, ...]:
        """What this callback changed in how the run trains (LRBackoff: its scales), so that a rollback can tell
        a return to a snapshot with new settings from a repeat of the same (default: nothing)."""
        return ()

    def _after_restore(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        """The training state was just restored from a snapshot taken with ``extra`` beside it (default: nothing)."""

    def _remedy_start(self, trainer: pl.Trainer, signal: Signal) -> Snapshot | None:
        """Turn the live state into the start of a trial's remedy; return the snapshot restored (default: nothing
        done, ``None``)."""
        return None

    def _remedy_lr(
        self, trainer: pl.Trainer, snapshot: Snapshot | None, signal: Signal | None, power: int
    ) -> tuple[list[float], float] | None:
        """Scale the live learning rate for a trial's remedy (by a factor to the ``power``); return its scales and the
        factor (default: ``None``)."""
        return None

    def _after_trial(self, trainer: pl.Trainer, outcome: TrialOutcome) -> None:
        """A trial ended. By default a kept remedy that started from a snapshot is what a rollback to it is: the
        callback hears of the restore (``_after_restore``) with what it kept beside that snapshot."""
        remedy = outcome.remedy
        if outcome.kept and remedy.snapshot_step is not None:
            self._after_restore(trainer, remedy.extras.get(self.state_key, {}))

    def _answer_at_end(self, trainer: pl.Trainer, check: StateCheck) -> bool:
        """The fit ends with inf/NaN in its state: restore it, or say so (default: not this callback's business)."""
        return False

    def _trial_state(self) -> dict[str, Any] | None:
        """The board's trial state, for the one callback that carries it in checkpoints (``None`` for the others)."""
        board = self._board
        if board is None or board.trial_host() is not self:
            return None
        return board.trials.state_dict()

    def _load_trial_state(self, state: dict[str, Any] | None) -> None:
        if state is not None and self._board is not None:
            self._board.trials.load_state_dict(state)

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _log(self, trainer: pl.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
        """Queue metrics for the suite's one logging call of this batch (``step``: Lightning's logging step), and
        ``trainer.callback_metrics``, with a logger or without."""
        self.board(trainer).metrics.add(metrics, _compat.batches_that_stepped(trainer) if step is None else step)

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

    def _signal(
        self, trainer: pl.Trainer, kind: str, reason: str, optimizer_index: int = 0, onset: int | None = None
    ) -> None:
        signal = Signal(kind, int(trainer.global_step), reason, type(self).__name__, optimizer_index, onset)
        self.board(trainer).signal(signal)

