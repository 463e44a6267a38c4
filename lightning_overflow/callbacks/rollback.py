"""Rollback: restore the last training state verified finite, in process, and never write a poisoned checkpoint.

Large runs have always recovered from divergence by hand: PaLM (Chowdhery et al., 2022, section 5.1) restarted from
a checkpoint about 100 steps before a loss spike and skipped 200-500 data batches; the OPT-175B logbook (Zhang et
al., 2022) shows restarts from earlier checkpoints with a lower learning rate. :class:`Rollback` does the same in
process, in the step where the divergence is detected, from snapshots kept in host memory.

How checkpoints stay clean. Lightning runs checkpoint callbacks after every other callback for the same hook, so a
rollback made in ``on_train_batch_end`` happens before ``ModelCheckpoint`` saves in that hook. For anything still
non-finite when a checkpoint is written (a divergence that no detector reported), :meth:`Rollback.on_save_checkpoint`
checks the checkpoint dict itself (weights and optimizer states) and raises :class:`NonFiniteError`, so that the file
is never written. This guard is a plain callback hook: it sees exactly what is about to be written, needs no access to
Lightning internals or the strategy's ``CheckpointIO``, covers every writer that goes through
``Trainer.save_checkpoint`` (``ModelCheckpoint`` in all its modes, ``OnExceptionCheckpoint``, a user's own call) and
decides on every rank together (one all-reduce of a flag), where a check inside ``CheckpointIO`` would run on rank 0
alone and leave the other ranks waiting. Lightning does not call callback hooks for ``save_weights_only=True``
checkpoints, which this guard therefore does not see; the rollback before the save still applies to them.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytorch_lightning as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_overflow._validation import check_choices, check_int
from lightning_overflow.callbacks._base import ROLLBACK, SuiteCallback
from lightning_overflow.distributed import reduce_and_read
from lightning_overflow.events import WarningCache
from lightning_overflow.exceptions import DivergenceError, NonFiniteError, RollbackError
from lightning_overflow.health import MAX_NAMES, SIGNAL_KINDS, Signal, StepHealth, board_for
from lightning_overflow.policy import StepAction, Verdict
from lightning_overflow.numerics import optimizer_state_tensors
from lightning_overflow.numerics.snapshots import (
    SnapshotError,
    load_snapshot,
    nonfinite_flag,
    nonfinite_indices,
    nonfinite_paths,
    restore_optimizer_,
    restore_state_,
    save_snapshot,
    state_matches,
    state_tensors,
    synchronize,
    take_snapshot,
    temporary_target,
)

__all__ = ["DEFAULT_TRIGGERS", "Rollback"]

DEFAULT_TRIGGERS = ("nonfinite_burst", "nonfinite_state", "scaler_collapse", "loss_spike")

SNAPSHOT_NAME = "rollback-step={step}.pt"
_SNAPSHOT_FILE = re.compile(re.escape(SNAPSHOT_NAME).replace(re.escape("{step}"), r"\d+"))  # any step
_SUITE_ERRORS = (DivergenceError, NonFiniteError, RollbackError)  # raised on every rank together
_SHARDED = ("FSDPStrategy", "XLAFSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy")

HINT = (
    "lower the learning rate (LRBackoff backs off on the detectors' divergence signals outside its cooldown; it "
    "hears nothing of a rollback that Rollback starts itself for a snapshot that failed its check), clip the "
    "gradients (AutoClip), and look at the data around the steps listed; skip_batches skips the batches after a "
    "rollback, max_rollbacks and window set the budget"
)


@dataclass
class _Snapshot:
    """One rollback target: a host copy (``state``), or a file written before a restart that is not loaded yet."""

    step: int
    state: dict[str, Any] | None
    extras: dict[str, Any] = field(default_factory=dict)
    file: str | None = None


class Rollback(SuiteCallback):
    """Keep snapshots of the last training state verified finite; restore one when training diverges.

    An intervention. What it changes: on a rollback it restores, in place, the parameters and buffers, every
    optimizer's state (moments, per-parameter step counts, param-group hyperparameters), every LR scheduler's state
    and the GradScaler state to those of the snapshot, clears the gradients, then tells the other suite callbacks
    (``_after_restore``), so that ``LRBackoff`` re-applies the learning-rate scale it holds now and a rollback never
    undoes a backoff made for the same event, in either callback order. With ``skip_batches``, the next batches are
    consumed without an optimizer step (PaLM's recipe). On a healthy run it changes nothing: it only reads.

    Snapshots. The state a fit starts from is the first snapshot; then one is taken every ``every_n_steps`` healthy
    optimizer steps (steps of batches without any detector signal, not skipped), after the step, at the end of a
    batch without signals, so never inside a spike. Before a snapshot becomes a rollback target its weights and
    optimizer state are checked for inf/NaN (one max-abs pass, which large finite values such as Adam's
    ``exp_avg_sq`` under huge gradients pass, one host read, identical verdict on every rank); one that holds
    inf/NaN is refused and, with ``"nonfinite_state"`` among the triggers, is itself a reason to roll back,
    so Rollback protects a run even without a detector (at snapshot granularity). The last ``keep`` verified
    snapshots are kept. A second rollback to the same snapshot, with no newer snapshot taken in between, goes one
    snapshot further back when there is one: the divergence started before that snapshot.

    Memory and time: each kept snapshot holds one copy of the model and optimizer state in host memory (pinned on a
    GPU), so ``keep=2`` costs twice the model and optimizer state (for AdamW, 3 x 4 bytes per parameter each).
    The buffers are allocated once and reused; copies are batched, and asynchronous on a GPU. Nothing happens on the
    other steps but a look at the signals. Measured on 2 busy CPU threads (``benchmarks/bench_snapshot.py``, 1M and
    20M-parameter transformers with AdamW), taking a snapshot with its check cost 1.4-16% of one training step (the
    check alone 0.5-9%) and restoring one 1-6%; a disk write runs at the speed of serialisation (0.2-0.5 GB/s
    there), so with ``dirpath`` keep ``every_n_steps`` in the hundreds.

    Under DDP every rank keeps its own copy (the replicas are identical), the checks and decisions are made on values
    all-reduced across ranks, so every rank restores the same snapshot at the same step; rank 0 alone writes files.

    When the fit stops with one of the suite's errors (``DivergenceError``, ``RollbackError``, ``NonFiniteError``,
    raised on every rank together) while the weights or optimizer state hold inf/NaN (``LRBackoff`` at its floor,
    placed before Rollback, raises before Rollback's turn in ``on_train_batch_end``), ``on_exception`` restores the
    last verified snapshot, so the model in memory and the checkpoint ``OnExceptionCheckpoint`` writes hold finite
    values and the original error propagates. This is no rollback: the budget and ``history`` stay as they are.
    Lightning calls ``on_exception`` in callback order with checkpoint callbacks last, so this restore precedes
    ``OnExceptionCheckpoint``; a callback of another kind that saves in its own ``on_exception`` before Rollback in
    the list still meets the checkpoint guard. Other exceptions (a user's error, ``KeyboardInterrupt``) may be
    raised on one rank only and leave the state as it is: the restore needs every rank. Under ``ddp_spawn`` and
    ``ddp_fork`` Lightning calls ``on_exception`` in the launching process only, which holds no snapshot.

    A callback instance can serve several fits: ``setup("fit")`` forgets the snapshots, the budget and the history
    of the previous one (a resumed fit loads its own right after).

    What is not rewound (no public API can): ``global_step`` and the epoch, the data position (the batches that led
    to the divergence are not replayed), RNG states, the loggers, attributes of the LightningModule that are not in
    its ``state_dict``. ``max_steps`` therefore counts the rolled-back steps too.

    Triggers (signals of the batch that make it roll back):

    - ``"nonfinite_burst"`` (default): several non-finite steps close together; skipping them no longer helps.
    - ``"nonfinite_state"`` (default): the weights or optimizer moments hold inf/NaN; no skip can repair that.
    - ``"scaler_collapse"`` (default): the GradScaler kept overflowing or its scale collapsed.
    - ``"loss_spike"`` (default): a loss spike, the case PaLM rolled back for.
    - ``"nonfinite"`` (not by default): an isolated non-finite step is skipped at no cost; rolling back for one
      corrupt sample would throw away good progress.
    - ``"grad_spike"`` (not by default): clipping absorbs a large gradient; the loss tells whether the step did harm.

    Args:
        every_n_steps: healthy optimizer steps between snapshots (default 100).
        keep: snapshots kept in memory, and on disk with ``dirpath`` (default 2: a repeated divergence can go one
            snapshot further back).
        dirpath: also write each verified snapshot to this directory (``rollback-step=<step>.pt``), atomically
            (temporary file, fsync, rename), loadable with ``torch.load(weights_only=True)``, pruned to ``keep``;
            rank 0 writes. A run resumed with ``fit(ckpt_path=...)`` can roll back to the files listed in its
            checkpoint (taken before the restart); a file that fails to load or verify is never used. ``None``
            (default): memory only.
        max_rollbacks: rollbacks allowed within ``window`` steps (default 3); the next need raises
            :class:`DivergenceError`.
        window: the window in optimizer steps for ``max_rollbacks`` (default 1000).
        skip_batches: after a rollback, consume this many further training batches without an optimizer step
            (default 0; with gradient accumulation, counted in batches that would have stepped).
        triggers: the signal kinds that cause a rollback, at least one (default :data:`DEFAULT_TRIGGERS`, see
            above).

    Attributes:
        rollbacks: rollbacks made so far (kept across a resume).
        history: one dict per rollback: ``step`` (``global_step`` when it was made), ``reason`` (the signal kind),
            ``trigger_step`` (the step the signal concerned), ``snapshot_step`` and ``source``
            (``"memory"``/``"disk"``).
        skipped_steps: optimizer steps skipped after rollbacks.
        snapshot_steps: the steps of the snapshots kept in memory, oldest first.
        restores_state: ``True`` (``NonFiniteDetector`` then leaves non-finite weights to it instead of raising),
            ``False`` when ``"nonfinite_state"`` is not among the triggers.

    Its checkpoint state (budget, history, files written) is stored under the class name, so one Rollback goes in a
    trainer, and a resumed run keeps its budget even when ``every_n_steps`` or ``keep`` change.

    Raises:
        DivergenceError: ``max_rollbacks`` rollbacks within ``window`` steps and another one needed; the message lists
            every rollback of the window. The last verified snapshot is restored first, so the model in memory and
            any checkpoint written on the way out hold finite values.
        RollbackError: a rollback was needed but no snapshot verified finite exists.
        NonFiniteError: a checkpoint about to be written holds inf/NaN weights or optimizer state (not written).
        NotImplementedError: in ``setup`` under a sharded strategy (FSDP, DeepSpeed, model parallel), at the start
            of training with a ``ZeroRedundancyOptimizer``: each rank holds only a shard there.

    Logged keys:

    ============================  =================================================
    key                           meaning
    ============================  =================================================
    ``overflow/rollbacks``        cumulative rollbacks
    ``overflow/skipped_steps``    cumulative optimizer steps skipped (with others)
    ============================  =================================================

    Journal events: ``rollback``, ``skip``, ``snapshot_refused``, ``snapshot_unusable``, ``snapshot_write_failed``,
    ``checkpoint_refused``, ``abort``, ``exit_restore`` (the restore in ``on_exception``).

    Example:
        >>> import pytorch_lightning as pl
        >>> from lightning_overflow import NonFiniteDetector
        >>> trainer = pl.Trainer(
        ...     callbacks=[NonFiniteDetector(), Rollback(every_n_steps=50, skip_batches=10)], logger=False
        ... )
    """

    stage = ROLLBACK

    restores_state = True

    def __init__(
        self,
        every_n_steps: int = 100,
        keep: int = 2,
        dirpath: str | os.PathLike[str] | None = None,
        max_rollbacks: int = 3,
        window: int = 1000,
        skip_batches: int = 0,
        triggers: Iterable[str] = DEFAULT_TRIGGERS,
    ) -> None:
        self.every_n_steps = check_int("every_n_steps", every_n_steps, minimum=1)
        self.keep = check_int("keep", keep, minimum=1)
        if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
            raise TypeError(f"'dirpath' must be a path or None (got {dirpath!r})")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.max_rollbacks = check_int("max_rollbacks", max_rollbacks, minimum=1)
        self.window = check_int("window", window, minimum=1)
        self.skip_batches = check_int("skip_batches", skip_batches, minimum=0)
        self.triggers = check_choices("triggers", triggers, SIGNAL_KINDS, what="signal kinds")
        if "nonfinite_state" not in self.triggers:
            self.restores_state = False  # non-finite weights are not this instance's to repair
        self._reset()

    def _reset(self) -> None:
        """Forget every fit so far: snapshots, budget, history, pending skips."""
        self.rollbacks = 0
        self.history: list[dict[str, Any]] = []
        self.skipped_steps = 0
        self._memory: list[_Snapshot] = []  # oldest first
        self._disk: list[dict[str, Any]] = []  # files written, oldest first: {"step", "file"}
        self._before_restart: list[_Snapshot] = []  # files from the checkpoint's list, not loaded yet
        self._healthy = 0
        self._last_step = 0
        self._skip_left = 0
        self._skipping = False
        self._last_target: int | None = None
        self._resumed = False
        self._warnings = WarningCache()

    @property
    def snapshot_steps(self) -> list[int]:
        return [snap.step for snap in self._memory]

    # ---- wiring -----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _refuse_sharded(trainer.strategy)
        super().setup(trainer, pl_module, stage)
        self._reset()  # a new fit starts afresh; a resumed one loads its state right after setup
        self._warnings.clear()
        if self.dirpath is not None and trainer.is_global_zero and self.dirpath.is_dir():
            for path in self.dirpath.iterdir():  # left behind by a process killed mid-write
                target = temporary_target(path)
                if target is not None and _SNAPSHOT_FILE.fullmatch(target.name):
                    with contextlib.suppress(OSError):
                        path.unlink()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
                raise NotImplementedError(_sharded_message("ZeroRedundancyOptimizer"))
        self._last_step = int(trainer.global_step)
        self._last_target = None
        self._disk = [entry for entry in self._disk if entry["step"] <= trainer.global_step]
        files = [_Snapshot(entry["step"], None, file=entry["file"]) for entry in self._disk]
        self._before_restart = files if self.dirpath is not None and self._resumed else []
        self._resumed = False
        refused = self._take(trainer, start=True)
        if refused:
            self._warnings.warn("start", refused)

    @override
    def _judge(self, trainer: pl.Trainer, record: StepHealth) -> Verdict | None:
        if self._skip_left <= 0:
            return None
        self._skipping = True
        return Verdict(skip="skipped after a rollback")

    @override
    def _after_step(self, trainer: pl.Trainer, record: StepHealth, action: StepAction) -> None:
        if self._skipping and action.skipped_by is self:
            self.skipped_steps += 1
            nth, after = self.skip_batches - self._skip_left + 1, self.history[-1]["step"] if self.history else "?"
            message = (
                f"Rollback: skipped optimizer step {record.step} (batch {nth} of {self.skip_batches} skipped after "
                f"the rollback at step {after})"
            )
            self._event(trainer, "skip", message, reason="rollback", optimizer=record.optimizer_index)

    @override
    def _after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        steps = int(trainer.global_step) - self._last_step
        self._last_step = int(trainer.global_step)
        skipped = self._skipping
        if skipped:
            self._skipping = False
            self._skip_left -= 1
        board = self.board(trainer)
        fired = [signal for signal in board.signals if signal.kind in self.triggers]
        if fired:
            self._roll_back(trainer, fired[0])
            return
        current = board.current
        skipped = skipped or (current is not None and current.skipped and current.step >= self._last_step - steps)
        if steps <= 0 or skipped or board.signals:
            return  # not a healthy step: nothing to count, no snapshot inside a spike
        self._healthy += steps
        if self._healthy < self.every_n_steps:
            return
        refused = self._take(trainer)
        if refused and "nonfinite_state" in self.triggers:
            self._roll_back(trainer, Signal("nonfinite_state", int(trainer.global_step), refused, "Rollback"))
        elif refused:
            self._warnings.warn("refused", refused + " (shown once)")

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        weight_ranks, state_ranks = _nonfinite_ranks(
            trainer, checkpoint.get("state_dict", {}), checkpoint.get("optimizer_states", [])
        )
        if not weight_ranks and not state_ranks:
            return
        names = nonfinite_paths(checkpoint.get("state_dict", {})) + _nonfinite_moments(trainer)
        what = "weights" if weight_ranks else "optimizer state"
        ranks = ", ".join(str(r) for r in (weight_ranks or state_ranks))
        message = (
            f"Rollback: refused to write a checkpoint at step {trainer.global_step}: its {what} contain inf/NaN "
            f"on rank(s) {ranks}{_quote(names)}; nothing was written."
        )
        hint = (
            "add NonFiniteDetector (and LossSpikeDetector) before the checkpoint callbacks, so that Rollback hears "
            "of the divergence and restores a finite state before anything is saved"
        )
        rank = min(weight_ranks or state_ranks)
        self._event(trainer, "checkpoint_refused", message, rank=rank, parameters=names[:MAX_NAMES])
        raise NonFiniteError(
            f"{message} HINT: {hint}.",
            kind="weight" if weight_ranks else "optimizer_state",
            step=int(trainer.global_step),
            ranks=weight_ranks or state_ranks,
            parameters=names[:MAX_NAMES],
            hint=hint,
        )

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            # Only the suite's errors are raised on every rank together; a foreign one may come from one rank only,
            # and the restore's collective would wait for ranks that never enter it.
            if isinstance(exception, _SUITE_ERRORS) and self._candidates():
                self._restore_on_exit(trainer, exception)
        finally:
            super().on_exception(trainer, pl_module, exception)

    def _restore_on_exit(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """Restore the last verified snapshot if the live state holds inf/NaN on some rank (every rank enters)."""
        state = _live_state(trainer)
        weight_ranks, state_ranks = _nonfinite_ranks(trainer, state["model"], state["optimizers"])
        if not weight_ranks and not state_ranks:
            return
        restored = self._restore_first(trainer, self._candidates())
        what = "weights" if weight_ranks else "optimizer state"
        ranks = ", ".join(str(r) for r in (weight_ranks or state_ranks))
        step = int(trainer.global_step)
        if restored is None:
            message = (
                f"Rollback: the fit stopped at step {step} ({type(exception).__name__}) with inf/NaN in its {what} "
                f"on rank(s) {ranks}, and no snapshot verified finite could be restored."
            )
            self._event(trainer, "exit_restore", message, error=type(exception).__name__, snapshot_step=None)
            return
        target, source = restored
        message = (
            f"Rollback: the fit stopped at step {step} ({type(exception).__name__}) with inf/NaN in its {what} on "
            f"rank(s) {ranks}; restored the snapshot of step {target.step} ({source}), so the model in memory and "
            f"any checkpoint written on the way out hold finite values. The error itself propagates."
        )
        details = {"error": type(exception).__name__, "snapshot_step": target.step, "source": source}
        self._event(trainer, "exit_restore", message, **details)

    # ---- snapshots --------------------------------------------------------------------------------------------
    def _take(self, trainer: pl.Trainer, start: bool = False) -> str | None:
        """Snapshot the live state if it is finite on every rank. When it is not: journal it, return why."""
        self._healthy = 0
        state = _live_state(trainer)
        weight_ranks, state_ranks = _nonfinite_ranks(trainer, state["model"], state["optimizers"])
        step = int(trainer.global_step)
        if weight_ranks or state_ranks:
            what = "weights" if weight_ranks else "optimizer state"
            bad = nonfinite_paths(state["model"]) + _nonfinite_moments(trainer)
            message = (
                f"Rollback: the {what} at step {step} contain inf/NaN on rank(s) "
                f"{', '.join(map(str, weight_ranks or state_ranks))}{_quote(bad)}; "
                f"{'the fit starts from a non-finite state, which' if start else 'this state'} is no rollback target"
            )
            rank = min(weight_ranks or state_ranks)
            self._event(trainer, "snapshot_refused", message, rank=rank, tensors=bad[:MAX_NAMES])
            return message
        reuse = self._memory.pop(0).state if len(self._memory) >= self.keep else None
        extras = copy.deepcopy(self.board(trainer).snapshot_extras(trainer))
        snapshot = _Snapshot(step, take_snapshot(state, reuse), extras)
        self._memory = [s for s in self._memory if s.step != step] + [snapshot]
        self._last_target = None
        if self.dirpath is not None:
            self._write(trainer, snapshot)
        return None

    def _write(self, trainer: pl.Trainer, snapshot: _Snapshot) -> None:
        assert self.dirpath is not None
        name = SNAPSHOT_NAME.format(step=snapshot.step)
        if trainer.is_global_zero:
            try:
                payload = {"state": snapshot.state, "extras": snapshot.extras}
                save_snapshot(payload, self.dirpath / name, step=snapshot.step)
            except Exception as err:  # a full disk must not stop training: the memory snapshot is intact
                with contextlib.suppress(OSError):  # an older file under this name holds another state
                    (self.dirpath / name).unlink()
                message = (
                    f"Rollback: could not write the snapshot of step {snapshot.step} to {self.dirpath}: {err}; the "
                    f"snapshot in memory is intact, and a resumed run will find no file for this step"
                )
                self._event(trainer, "snapshot_write_failed", message, file=name)
                self._warnings.warn("write", message + " (shown once)")
        # The bookkeeping goes on as on the other ranks, which cannot know that rank 0 failed: every rank must list
        # the same rollback targets, or some would enter the collective of _load without the others.
        snapshot.file = name
        self._disk = [e for e in self._disk if e["step"] != snapshot.step] + [{"step": snapshot.step, "file": name}]
        while len(self._disk) > self.keep:
            old = self._disk.pop(0)
            self._before_restart = [s for s in self._before_restart if s.file != old["file"]]
            if trainer.is_global_zero:
                with contextlib.suppress(OSError):
                    (self.dirpath / old["file"]).unlink()

    def _candidates(self) -> list[_Snapshot]:
        """Rollback targets, newest first; a memory snapshot wins over a file of the same step."""
        steps = {s.step for s in self._memory}
        older = [s for s in self._before_restart if s.step not in steps]
        return sorted(self._memory + older, key=lambda s: (s.step, s.state is not None), reverse=True)

    # ---- rolling back -----------------------------------------------------------------------------------------
    def _roll_back(self, trainer: pl.Trainer, signal: Signal) -> None:
        step = int(trainer.global_step)
        recent = [h for h in self.history if step - h["step"] < self.window]
        if len(recent) >= self.max_rollbacks:
            self._stop(trainer, signal, recent)
        candidates = self._candidates()
        avoided = None
        if len(candidates) > 1 and candidates[0].step == self._last_target:
            # It diverged again from there: go one snapshot further back, and keep it only as a last resort.
            avoided = candidates[0]
            candidates = candidates[1:] + candidates[:1]
        restored = self._restore_first(trainer, candidates)
        if restored is None:
            self._no_snapshot(trainer, signal)
        target, source = restored
        if avoided is not None and target is not avoided:
            self._memory = [s for s in self._memory if s is not avoided]
            self._before_restart = [s for s in self._before_restart if s.step != avoided.step]
        entry = {
            "step": step,
            "reason": signal.kind,
            "trigger_step": signal.step,
            "snapshot_step": target.step,
            "source": source,
        }
        self.history.append(entry)
        self.rollbacks += 1
        self._last_target = target.step
        self._healthy = 0
        self._skip_left = self.skip_batches
        left = self.max_rollbacks - len(recent) - 1
        skip = f"; the next {self.skip_batches} batch(es) will be skipped" if self.skip_batches else ""
        message = (
            f"Rollback: restored the snapshot of step {target.step} ({source}) at step {step} after "
            f"{signal.kind} at step {signal.step} ({signal.reason}){skip}. {left} rollback(s) left within "
            f"{self.window} steps."
        )
        details = {key: value for key, value in entry.items() if key != "step"}  # the event's own step
        self._event(trainer, "rollback", message, **details, rollbacks=self.rollbacks, budget_left=left)

    def _restore_first(self, trainer: pl.Trainer, candidates: list[_Snapshot]) -> tuple[_Snapshot, str] | None:
        """Restore the first usable candidate (a file is read and verified first): ``(it, "memory" or "disk")``,
        or ``None`` when none is usable. A file that cannot be used is dropped for good."""
        for candidate in candidates:
            source, state = "memory", candidate.state
            if state is None:
                source, state = "disk", self._load(trainer, candidate)
                if state is None:
                    self._before_restart = [s for s in self._before_restart if s is not candidate]
                    continue
            _restore(trainer, state)
            self.board(trainer).after_restore(trainer, candidate.extras)
            return candidate, source
        return None

    def _load(self, trainer: pl.Trainer, candidate: _Snapshot) -> dict[str, Any] | None:
        """Read and verify a file from before the restart on every rank; ``None`` unless every rank could use it."""
        assert self.dirpath is not None and candidate.file is not None
        path = self.dirpath / candidate.file
        state: dict[str, Any] | None = None
        problem = ""
        try:
            step, payload = load_snapshot(path)
            state, candidate.extras = payload["state"], payload.get("extras", {})
            if step != candidate.step or not _fits_live(trainer, state):
                problem = "it does not match this model and its optimizers"
            else:
                bad = nonfinite_paths(state["model"]) + nonfinite_paths(state["optimizers"], scalars=False)
                problem = f"it holds inf/NaN{_quote(bad)}" if bad else ""
        except Exception as err:  # an untrusted file: whatever it raises, every rank must reach the collective below
            problem = str(err) if isinstance(err, SnapshotError) else f"{type(err).__name__}: {err}"
        (unusable,) = _flags_by_rank(trainer, [torch.tensor(float(bool(problem)))])
        if not unusable:
            return state
        message = f"Rollback: the snapshot file {path} cannot be used on rank(s) {list(unusable)}"
        self._event(trainer, "snapshot_unusable", message + (f": {problem}" if problem else ""), file=candidate.file)
        return None

    def _no_snapshot(self, trainer: pl.Trainer, signal: Signal) -> NoReturn:
        message = (
            f"Rollback: a rollback was needed at step {trainer.global_step} ({signal.kind} at step {signal.step}: "
            f"{signal.reason}) but no snapshot verified finite exists: the state the fit started from was already "
            f"non-finite and no later state passed the check. Nothing was restored. HINT: resume from a checkpoint "
            f"written before the divergence (checkpoints written while Rollback is in the callbacks are finite); "
            f"with dirpath set, a resumed run can also return to the snapshot files listed in its checkpoint."
        )
        self._event(trainer, "abort", message, reason=signal.kind)
        raise RollbackError(message, step=int(trainer.global_step))

    def _stop(self, trainer: pl.Trainer, signal: Signal, recent: list[dict[str, Any]]) -> NoReturn:
        step = int(trainer.global_step)
        restored = self._restore_first(trainer, self._candidates())
        listed = "; ".join(
            f"step {h['step']}: {h['reason']} at step {h['trigger_step']} -> snapshot of step {h['snapshot_step']}"
            for h in recent
        )
        note = (
            f"The snapshot of step {restored[0].step} was restored before stopping, so the model and any "
            f"checkpoint written on the way out hold finite values."
            if restored is not None
            else "No verified snapshot was left to restore."
        )
        message = (
            f"Rollback: the run diverged again at step {step} ({signal.kind} at step {signal.step}: {signal.reason}) "
            f"after {len(recent)} rollback(s) within {self.window} steps (max_rollbacks={self.max_rollbacks}). "
            f"Rollbacks: {listed}. {note} HINT: {HINT}."
        )
        self._event(trainer, "abort", message, reason=signal.kind, rollbacks=[dict(h) for h in recent])
        raise DivergenceError(message, step=step, history=recent)

    # ---- counters and state -----------------------------------------------------------------------------------
    @override
    def _counters(self) -> dict[str, float]:
        return {"overflow/rollbacks": self.rollbacks, "overflow/skipped_steps": self.skipped_steps}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "rollbacks": self.rollbacks,
            "history": [dict(h) for h in self.history],
            "skipped_steps": self.skipped_steps,
            "skip_left": self._skip_left,
            "healthy_steps": self._healthy,
            "disk": [dict(e) for e in self._disk],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollbacks = int(state_dict.get("rollbacks", 0))
        self.history = [dict(h) for h in state_dict.get("history", [])]
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._skip_left = int(state_dict.get("skip_left", 0))
        self._healthy = int(state_dict.get("healthy_steps", 0))
        self._disk = [{"step": int(e["step"]), "file": str(e["file"])} for e in state_dict.get("disk", [])]
        self._resumed = True


# ---- the training state -----------------------------------------------------------------------------------------
def _live_state(trainer: pl.Trainer) -> dict[str, Any]:
    """Model, optimizers, schedulers and GradScaler, as live ``state_dict`` s (their tensors are the live ones)."""
    strategy = trainer.strategy
    return {
        "model": strategy.lightning_module_state_dict(),
        "optimizers": [strategy.optimizer_state(optimizer) for optimizer in trainer.optimizers],
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "precision": trainer.precision_plugin.state_dict(),
    }


def _restore(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    """Put ``state`` back, copying into the live tensors (never aliasing the snapshot)."""
    synchronize()  # the host deep-copies parts of the snapshot: its device-to-host copies must have landed
    live_model = trainer.strategy.lightning_module_state_dict()
    if state_matches(live_model, state["model"]):
        restore_state_(live_model, state["model"])
    else:
        trainer.lightning_module.load_state_dict(state["model"])  # copies
    for optimizer, saved in zip(trainer.optimizers, state["optimizers"]):
        restore_optimizer_(optimizer, saved)
    for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"]):
        config.scheduler.load_state_dict(copy.deepcopy(saved))  # schedulers keep what they load: copy first
    if state["precision"]:
        trainer.precision_plugin.load_state_dict(copy.deepcopy(state["precision"]))
    for optimizer in trainer.optimizers:
        optimizer.zero_grad(set_to_none=True)


def _fits_live(trainer: pl.Trainer, state: Any) -> bool:
    """Whether a state read from a file belongs to this model, its optimizers (same parameter groups) and
    schedulers."""
    if not isinstance(state, dict) or not {"model", "optimizers", "schedulers", "precision"} <= state.keys():
        return False
    if len(state["optimizers"]) != len(trainer.optimizers):
        return False
    if len(state["schedulers"]) != len(trainer.lr_scheduler_configs):
        return False
    for optimizer, saved in zip(trainer.optimizers, state["optimizers"]):
        sizes = [len(group["params"]) for group in optimizer.param_groups]
        if sizes != [len(group["params"]) for group in saved["param_groups"]]:
            return False
    return state_matches(trainer.strategy.lightning_module_state_dict(), state["model"])


def _nonfinite_ranks(trainer: pl.Trainer, model: Any, optimizers: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ranks whose model state, and whose optimizer states (step counters left out), hold inf/NaN."""
    weights = nonfinite_flag(state_tensors(model))
    moments = nonfinite_flag(state_tensors(optimizers), scalars=False)
    weight_ranks, state_ranks = _flags_by_rank(trainer, [weights, moments])
    return weight_ranks, state_ranks


def _nonfinite_moments(trainer: pl.Trainer) -> list[str]:
    """``<parameter>.<state key>`` of the live optimizer state tensors that hold inf/NaN on this rank."""
    names = board_for(trainer).names
    bad: list[str] = []
    for optimizer in trainer.optimizers:
        tensors, labels = optimizer_state_tensors(optimizer, names)
        bad += [labels[i] for i in nonfinite_indices(tensors)]
    return bad


def _flags_by_rank(trainer: pl.Trainer, flags: list[Tensor]) -> list[tuple[int, ...]]:
    """For each 0-d flag, the ranks where it is set: one all-reduce and one host read for all of them."""
    rank, world = int(trainer.global_rank), max(int(trainer.world_size), 1)
    device = trainer.strategy.root_device
    packed = torch.zeros(len(flags) * world, dtype=torch.float64, device=device)
    for i, flag in enumerate(flags):
        packed[i * world + rank] = flag.to(device=device, dtype=torch.float64)
    values, _ = reduce_and_read(packed, packed.new_zeros(0))
    return [tuple(r for r in range(world) if values[i * world + r] != 0) for i in range(len(flags))]


def _quote(names: list[str]) -> str:
    if not names:
        return ""
    more = f" (+{len(names) - MAX_NAMES} more)" if len(names) > MAX_NAMES else ""
    return f" (in {', '.join(names[:MAX_NAMES])}{more})"


def _refuse_sharded(strategy: Any) -> None:
    for cls in type(strategy).__mro__:
        if cls.__name__ in _SHARDED:
            raise NotImplementedError(_sharded_message(cls.__name__))


def _sharded_message(name: str) -> str:
    return (
        f"Rollback does not support {name} yet: each rank holds only a shard of the weights and optimizer state, "
        f"and snapshots of shards are not implemented. Use strategy='ddp' (or a single device) with Rollback, or "
        f"remove Rollback from the callbacks."
    )
