"""Rollback: restore the last training state verified finite, in process, and never write a non-finite checkpoint.

Large runs have always recovered from divergence by hand: PaLM (Chowdhery et al., 2022, section 5.1) restarted from
a checkpoint about 100 steps before a loss spike and skipped 200-500 data batches; the OPT-175B logbook (Zhang et
al., 2022) shows restarts from earlier checkpoints with a lower learning rate. :class:`Rollback` does the same in
process, in the step where the divergence is detected, from snapshots kept in host memory (and optionally on disk).
``docs/rollback.md`` explains the snapshots, their cost, the triggers, DDP and resuming at length.

The callback is the policy only. What it reads, checks and restores is :mod:`lightning_overflow.training_state`;
where snapshots live (a ring of host buffers, checksummed files on any fsspec filesystem) is
:mod:`lightning_overflow.snapshot_store`.

How checkpoints stay finite. Every Lightning checkpoint goes through ``Trainer.save_checkpoint``, on every rank:
``ModelCheckpoint`` in all its modes (``save_weights_only=True`` included, which calls no callback hook on the way),
``OnExceptionCheckpoint``, a user's own call. Rollback guards that method of its trainer
(:class:`~lightning_overflow.training_state.CheckpointGuard`): before the checkpoint is assembled, every rank checks
the live weights, buffers and optimizer state together (one all-reduce of two flags); when some rank holds inf/NaN,
Rollback first rolls back to the last verified snapshot (a rollback like any other: journaled, counted in the budget)
and the checkpoint is then written from the restored, finite state, and the run goes on. That covers the update that
itself produced NaN weights on a step where ``ModelCheckpoint(every_n_train_steps=...)`` saves, whatever the
detectors said. The check costs one pass over the state per checkpoint written, nothing on the other steps; a check
inside the strategy's ``CheckpointIO`` would run on rank 0 alone and leave the other ranks waiting. Without
``"nonfinite_state"`` among the triggers, or with no snapshot to return to, the save is refused with
:class:`NonFiniteError` (nothing written). ``on_save_checkpoint`` refuses the same way a checkpoint assembled by a
writer that bypasses the trainer's method. The same check runs when validation starts and at an epoch's end, before
the checkpoints are scored and ranked; after a rollback, checkpoints ranked by a metric of the training steps (whose
value is the replaced weights') are held until the epoch ends (``docs/rollback.md``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable
from typing import Any, NoReturn

import pytorch_lightning as pl
import torch
from typing_extensions import override

from lightning_overflow import _compat
from lightning_overflow._validation import check_choices, check_int, check_type, refuse_removed
from lightning_overflow.callback_state import StateReader, versioned
from lightning_overflow.callbacks._base import ROLLBACK, SuiteCallback
from lightning_overflow.diagnosis.hints import divergence_hint
from lightning_overflow.distributed import flags_by_rank, objects_by_rank
from lightning_overflow.events import WarningCache, log
from lightning_overflow.exceptions import DivergenceError, NonFiniteError, RollbackError
from lightning_overflow.health import MAX_NAMES
from lightning_overflow.numerics.lr_scaling import group_rates
from lightning_overflow.numerics.snapshots import held_nbytes, take_snapshot, without_placeholders
from lightning_overflow.policy import (
    DEFAULT_ROLLBACK_TRIGGERS,
    REMOVED_SETTINGS,
    RESTART_ONCE,
    ROLLBACK_WINDOW,
    SIGNAL_KINDS,
    SUSPICION_SIGNALS,
    Signal,
)
from lightning_overflow.replicas import checksum
from lightning_overflow.snapshot_store import Snapshot, SnapshotFiles, SnapshotRing, snapshot_name
from lightning_overflow.training_state import (
    CheckpointGuard,
    StateCheck,
    across_pruning,
    check_state,
    checked_weights,
    live_state,
    local_state,
    module_layout,
    nonfinite_parts,
    optimizer_labels,
    parameter_names,
    pruned_since,
    restorable,
    restore_,
    unrestorable_optimizer,
    split_snapshot,
)
from lightning_overflow.trial import DEFAULT_TRIAL, TrialConfig
from lightning_overflow.trials import TrialOutcome

__all__ = ["DEFAULT_TRIGGERS", "Rollback"]

DEFAULT_TRIGGERS = DEFAULT_ROLLBACK_TRIGGERS

_SUITE_ERRORS = (DivergenceError, NonFiniteError, RollbackError)  # raised on every rank together
HINT = (
    "Rollback's own settings: max_rollbacks sets the budget (LRBackoff backs off on the detectors' divergence "
    "signals outside its cooldown; it hears nothing of a rollback that Rollback starts itself for a state that "
    "failed its check)"
)


class Rollback(SuiteCallback):
    """Keep snapshots of the last training state verified finite; restore one when training diverges.

    An intervention. On a rollback it restores, in place, the LightningModule's whole ``state_dict`` (parameters,
    buffers, ``get_extra_state`` values), every optimizer's state, every LR scheduler's state and the GradScaler's,
    clears the gradients, and tells the other suite callbacks (``LRBackoff`` keeps the scale it holds now). A healthy
    run is left bit-identical.

    Snapshots: the state the fit starts from, then one every ``every_n_steps`` healthy optimizer steps (no detector
    signal, not skipped), each verified finite on every rank first (parameters and optimizer moments strictly;
    buffers may keep the infs they held when first seen, such as a causal mask's ``-inf``, even one built on the
    first forward pass) and, under DDP, the same on every rank (a checksum of the parameters compared across the
    replicas in the same all-reduce). A state that fails the check is refused and, with ``"nonfinite_state"`` (or
    ``"replica_mismatch"``) among the triggers, is itself a reason to roll back. A second rollback to the same
    snapshot goes one snapshot further back. Every checkpoint written during the fit is checked first and rolled
    back before it is written when it is not finite (see the module docstring).
    Not rewound: ``global_step``, the data position, RNG states, loggers. Details: ``docs/rollback.md``.

    Host memory per rank, for ``P`` parameters trained with AdamW in FP32 (12 bytes per parameter: the weights and
    two moments): ``keep x 12P`` on one device; ``keep x 12P / world`` under DDP, where each rank keeps only its
    share of the tensors (balanced by bytes, at most one tensor more than ``1/world``; rebuilt on a rollback by a
    broadcast from each owner), so a node of 8 ranks holds at most one copy per snapshot, whatever the world size; and
    ``keep x 12P / world`` under FSDP2, where each rank keeps its own shards and restores them in place. Step
    counters, schedulers and the scaler (a few bytes) are kept on every rank. :attr:`snapshot_nbytes` reports it.

    Triggers (signal kinds that make it roll back; the default, :data:`DEFAULT_TRIGGERS`, is the evidence that the
    training state degrades, and DDP replicas that disagree): ``"nonfinite_persistent"``, ``"nonfinite_state"``,
    ``"scaler_collapse"``, ``"loss_divergence"``, ``"loss_trend"``, ``"weight_growth"``, ``"replica_mismatch"``. A
    skipped non-finite step, a burst of them on bad data, and a single spike are not (a skip or a clip absorbs them at
    no cost; see :mod:`lightning_overflow.policy`). A signal that names where the state began to degrade
    (``weight_growth``: the start of its window; ``loss_divergence`` and ``loss_trend``: the first step of the losses
    judged) sends the rollback to a snapshot from before then, and the snapshots taken since are dropped.

    Args:
        every_n_steps: healthy optimizer steps between snapshots (default 100).
        keep: snapshots kept in memory, and on disk with ``dirpath`` (default 2).
        dirpath: also write each verified snapshot to this directory, a local path or an fsspec URL
            (``s3://...``, ``memory://...``), as ``rollback-step=<step>.pt`` (checksummed, written atomically,
            pruned to ``keep``; on several ranks each rank writes the part it holds into ``<dirpath>/rank=<r>``).
            A fit resumed with ``ckpt_path`` can roll back to the files listed in its checkpoint. Checked in
            ``setup`` (``None``, the default: memory only).
        max_rollbacks: rollbacks allowed within ``ROLLBACK_WINDOW`` (1000) steps (default 3); the next need raises
            :class:`DivergenceError`. A rollback whose settings differ from the previous rollback's (the LR backed
            off since) is progress and is not counted: the backoff's floor bounds those.
        triggers: the signal kinds that cause a rollback, at least one (default :data:`DEFAULT_TRIGGERS`).

    Attributes:
        rollbacks: rollbacks made so far (kept across a resume).
        history: one dict per rollback: ``step``, ``reason`` (signal kind), ``trigger_step``, ``snapshot_step``,
            ``source`` (``"memory"``/``"disk"``). The journal's ``rollback`` event also says whether it was
            ``counted`` in the budget.
        snapshot_steps: the steps of the snapshots kept in memory, oldest first.
        snapshot_nbytes: host bytes this rank's snapshots in memory hold.
        restores_state: ``False`` when ``"nonfinite_state"`` is not among the triggers (``NonFiniteDetector`` then
            raises on non-finite weights itself).

    Raises:
        DivergenceError: ``max_rollbacks`` counted rollbacks within ``window`` steps and another one needed with
            nothing changed (the last verified snapshot is restored first).
        RollbackError: a rollback was needed but no snapshot verified finite exists.
        NonFiniteError: a checkpoint about to be written holds inf/NaN and cannot be rolled back (not written).
        ValueError: in ``setup``, when ``dirpath`` is a file, lies under a file, or cannot be written.
        NotImplementedError: in ``setup``, under a strategy the suite refuses (``FSDPStrategy``,
            ``XLAFSDPStrategy``, ``DeepSpeedStrategy``) or ``XLAStrategy``; with a ``ZeroRedundancyOptimizer``.

    Logged keys: ``overflow/rollbacks`` (cumulative rollbacks). Journal events: ``rollback``, ``snapshot_refused``,
    ``snapshot_unusable``, ``snapshot_write_failed``, ``checkpoint_refused``, ``abort``, ``exit_restore``.

    Example:
        >>> import pytorch_lightning as pl
        >>> from lightning_overflow import NonFiniteDetector
        >>> trainer = pl.Trainer(
        ...     callbacks=[NonFiniteDetector(), Rollback(every_n_steps=50, max_rollbacks=5)], logger=False
        ... )
    """

    stage = ROLLBACK
    one_per_trainer = True  # acts on the whole run: a second one would act twice (refused at setup)

    restores_state = True
    window = ROLLBACK_WINDOW

    def __init__(
        self,
        every_n_steps: int = 100,
        keep: int = 2,
        dirpath: str | os.PathLike[str] | None = None,
        max_rollbacks: int = 3,
        triggers: Iterable[str] = DEFAULT_TRIGGERS,
        trial: TrialConfig | None = DEFAULT_TRIAL,
        **removed: Any,
    ) -> None:
        refuse_removed(Rollback, removed, REMOVED_SETTINGS["Rollback"])
        self.every_n_steps = check_int("every_n_steps", every_n_steps, minimum=1)
        self.keep = check_int("keep", keep, minimum=1)
        if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
            raise TypeError(f"'dirpath' must be a path or None (got {dirpath!r})")
        if dirpath is not None and not os.fspath(dirpath):
            raise ValueError(f"'dirpath' must be a non-empty path or None (got {dirpath!r})")
        self.dirpath = dirpath
        self.max_rollbacks = check_int("max_rollbacks", max_rollbacks, minimum=1)
        self.triggers = check_choices("triggers", triggers, SIGNAL_KINDS, what="signal kinds")
        self.trial = check_type("trial", trial, TrialConfig, "a TrialConfig", optional=True)
        if "nonfinite_state" not in self.triggers:
            self.restores_state = False  # non-finite weights are not this instance's to repair
        self._files = SnapshotFiles(dirpath) if dirpath is not None else None
        self._guard: CheckpointGuard | None = None
        self._reset()

    def _reset(self) -> None:
        """Forget every fit so far: snapshots, budget, history."""
        self.rollbacks = 0
        self.history: list[dict[str, Any]] = []
        self._memory = SnapshotRing(self.keep)
        self._writer: SnapshotFiles | None = None  # this rank's folder of dirpath (dirpath itself on one process)
        self._disk: list[dict[str, Any]] = []  # files written, oldest first: {"step", "file", "digests"} (by rank)
        self._before_restart: list[Snapshot] = []  # files from the checkpoint's list, not read yet
        self._restart: Snapshot | None = None  # the state a resumed fit started from, should none of its files do
        self._restored_at = -1  # the step whose state was restored outside a batch's end (before a checkpoint)
        self._healthy = 0
        self._last_step = 0
        self._fit_start = 0  # the step this fit started (or resumed) from
        self._last_target: int | None = None
        self._last_settings: tuple[float, ...] = ()
        self._retries = 0  # rollbacks in a row to the last target after the first
        self._rollback_settings: tuple[float, ...] | None = None  # at the last rollback (not reset by a snapshot)
        self._free: set[int] = set()  # indices into history of the rollbacks that were progress (not counted)
        self._resumed = False
        self._dropped = 0  # snapshots found unusable and dropped this fit
        self._layout: tuple[Any, ...] = ()  # the model's layout (module_layout) when the last snapshot was taken
        self._names: dict[int, str] = {}  # and its parameters' names (parameter_names)
        self._warnings = WarningCache()
        self._validated = False  # a validation ran since the last training batch
        self._unscored: dict[str, Any] | None = None  # the last rollback of the epoch under way: step, epoch, target
        self._held: set[int] = set()  # the checkpoint callbacks told of it (by id)

    @property
    def snapshot_steps(self) -> list[int]:
        return self._memory.steps

    @property
    def snapshot_nbytes(self) -> int:
        """Host bytes this rank's snapshots in memory hold now (at most ``keep`` of them; see the class docstring), with
        the state a resumed fit started from while it is held."""
        return self._memory.nbytes + (held_nbytes(self._restart.state) if self._restart is not None else 0)

    @override
    def _detach(self, state: dict[str, Any]) -> None:
        state["_guard"] = None  # tied to one trainer (a weak reference): a copy guards none
        # The snapshots in memory are copies of this fit's model (keep x its size): a pickled copy (a module's
        # hyperparameters in every checkpoint) would carry them all. The files on disk stay listed.
        state["_memory"] = SnapshotRing(self.keep)
        state["_restart"] = None
        state["_writer"] = None

    # ---- hooks ------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _compat.check_strategy(trainer.strategy, type(self).__name__)
        _refuse_sharded(trainer.strategy)
        super().setup(trainer, pl_module, stage)
        self._begin_fit(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _refuse_sharded_optimizers(trainer.optimizers)
        super().on_train_start(trainer, pl_module)
        self._start(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._retake_if_reshaped(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_start(trainer, pl_module)
        if trainer.state.fn == "fit" and not trainer.sanity_checking and self._guard is not None:
            self._before_scoring(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        self._hold_unscored_saves(trainer)
        # ModelPruning(prune_on_train_epoch_end=False) changes the layout here, in any order of the callbacks: the
        # next training batch looks, as an epoch's start does.
        self._validated = trainer.state.fn == "fit" and not trainer.sanity_checking

    @override
    def _before_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._validated:
            self._validated = False
            self._retake_if_reshaped(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if getattr(trainer, "checkpoint_callbacks", None) and self._guard is not None:
            # Before the epoch's checkpoints (they save after this hook): a rollback at the save would file the
            # restored weights under the score taken of the ones replaced.
            self._before_scoring(trainer, "when the epoch's checkpoints were to be written")
        self._hold_unscored_saves(trainer)
        self._unscored = None  # the next epoch's training metrics are those of the weights it trains

    @override
    def _wants_record(self) -> bool:
        return False  # it acts on the detectors' signals at batch end, never on a step's values

    @override
    def _after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        steps = int(trainer.global_step) - self._last_step
        self._last_step = int(trainer.global_step)
        board = self.board(trainer)
        current = board.current  # a suite callback may have skipped this batch's step
        skipped = current is not None and current.skipped and current.step >= self._last_step - steps
        fired = [signal for signal in board.signals if signal.kind in self.triggers]
        if self._restored_at == self._last_step and any(s.kind == "nonfinite_state" for s in fired):
            # A checkpoint another callback wrote earlier in this batch's end was preceded by a restore of the
            # inf/NaN state: that finding is answered (the others, a suspicion that names an onset, are not).
            board.forget_batch_logs(trainer)
            fired = [signal for signal in fired if signal.kind != "nonfinite_state"]
        if fired:
            before = self.rollbacks
            self._roll_back(trainer, fired[0])
            if self.rollbacks > before:
                board.forget_batch_logs(trainer)  # computed on the state replaced, as a skipped step's are
        elif steps > 0 and not skipped and not board.signals and not board.trials.active:
            self._count_healthy(trainer, steps)  # healthy steps only: never a snapshot inside a spike or a trial
        self._hold_unscored_saves(trainer)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._guard is not None and self._guard.saving:
            return  # checked (and rolled back) by the guard before this checkpoint was assembled
        self._refuse_if_nonfinite(trainer, checkpoint)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            # Only the suite's errors are raised on every rank together; a foreign one (a KeyboardInterrupt, the
            # module's own error) may come from one rank only, and the restore's collective would wait for ranks that
            # never enter it. In one process the weights a foreign error left inf/NaN are restored too.
            ours = isinstance(exception, _SUITE_ERRORS)
            if (ours or trainer.world_size == 1) and self._with_last_resort():
                try:
                    self._restore_if_nonfinite(trainer, type(exception).__name__)
                except Exception as failed:
                    if ours:
                        raise
                    # The module's own error is the one to see: a check that fails on the state it left says so
                    self._warnings.warn("exit_restore", f"Rollback: on the way out of {type(exception).__name__} the "
                                        f"state could not be checked or restored ({failed}); nothing was restored")
        finally:
            super().on_exception(trainer, pl_module, exception)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._guard is not None and stage == "fit":
            self._guard.remove()
            self._guard = None
        super().teardown(trainer, pl_module, stage)

    # ---- the start of a fit, the steps --------------------------------------------------------------------------
    def _begin_fit(self, trainer: pl.Trainer) -> None:
        """Start afresh (a resumed fit loads its state right after setup), check ``dirpath``, guard the saves."""
        self._reset()
        self._warnings.clear()
        self._prepare_files(trainer)
        if self._guard is not None:  # left on the trainer of a fit that failed (no teardown then)
            self._guard.remove()
        self._guard = CheckpointGuard(trainer, self._before_save)

    def _start(self, trainer: pl.Trainer) -> None:
        """Take the first snapshot: the state the fit starts from (its check records the buffers' constants).

        A resumed fit whose checkpoint lists snapshot files goes on with those: the rollback targets, the healthy
        steps counted towards the next snapshot and the decision state are those the uninterrupted run had, so it
        rolls back exactly as that run would. Its live state is still checked, and kept out of the ring, for the case
        that none of those files can be used (the memory snapshots of the interrupted process are gone)."""
        self._last_step = self._fit_start = int(trainer.global_step)
        resumed, self._resumed = self._resumed, False
        if not resumed:
            self._last_target, self._last_settings, self._retries = None, (), 0
        self._disk = [entry for entry in self._disk if entry["step"] <= trainer.global_step]
        listed = [Snapshot(entry["step"], None, file=entry["file"]) for entry in self._disk]
        self._before_restart = listed if self._files is not None and resumed else []
        refused = self._take(trainer, start=True, keep=bool(self._before_restart), counting=resumed)
        if refused is not None:
            self._warnings.warn("start", refused.reason)
        if resumed and self._files is None and self._fit_start > 0 and trainer.global_rank == 0:
            log.info(f"Rollback: this fit resumed at step {self._fit_start}; the snapshots of the fit it resumes were "
                     "kept in memory and are gone, so the oldest state a rollback can return to is the one it resumed "
                     "from. Rollback(dirpath=...) (default_callbacks(dirpath=...)) keeps them in files a resumed fit "
                     "reads.")

    def _count_healthy(self, trainer: pl.Trainer, steps: int) -> None:
        self._healthy += steps
        if self._healthy < self.every_n_steps:
            return
        self._take_or_answer(trainer)

    def _retake_if_reshaped(self, trainer: pl.Trainer) -> None:
        """A callback changed the model's layout at an epoch's boundary or at a validation's end (``ModelPruning``
        turns ``weight`` into ``weight_orig`` and ``weight_mask``; a parametrization moves a weight): the state is
        snapshot now, before a fault needs one. Snapshots from before pruning are carried into the new layout behind
        it; those of another layout change fit no more and are dropped when tried. The layout is the same on every
        rank, and so is the decision. Read first by the names alone (:func:`module_layout`): an epoch may be one step
        long."""
        newest = self._memory.snapshots[-1] if self._memory.snapshots else None
        if newest is None or self.board(trainer).trials.active:
            return
        module = trainer.lightning_module
        layout = module_layout(module)
        if layout == self._layout:
            return
        renamed = self._carry_across_pruning(module)
        # A snapshot of the state as the new layout holds it (its own mask), the carried ones older targets behind it.
        if renamed or restorable(trainer, newest.state):
            self._take_or_answer(trainer)
        else:
            self._layout = layout

    def _carry_across_pruning(self, module: pl.LightningModule) -> dict[str, str]:
        """Pruning kept each parameter and renamed it: the snapshots in memory are put in the new layout, so the
        states verified before it stay rollback targets (else the first snapshot after it, of whatever state the run
        was in, would be the only one). Asked where the layout is read (an epoch's start, after a validation), and
        before a snapshot is taken or restored (pruning inside an epoch, by the module's own code or a plain loop).
        A file is read in the layout it was written in, and is dropped if unfit. Returns what was renamed."""
        renamed = pruned_since(self._names, module)
        if not renamed:
            return renamed
        self._names = parameter_names(module)
        live = local_state(module.state_dict())
        for snapshot in [*self._memory.snapshots, self._restart]:
            if snapshot is None or snapshot.state is None:
                continue
            carried = across_pruning(snapshot.state["model"], renamed, live)
            if carried is not None:
                snapshot.state["model"] = carried
                snapshot.owners = {_renamed_path(path, renamed): rank for path, rank in snapshot.owners.items()}
        return renamed

    def _take_or_answer(self, trainer: pl.Trainer) -> None:
        refused = self._take(trainer)
        if refused is not None and refused.kind in self.triggers:
            self._roll_back(trainer, refused)
        elif refused is not None:
            self._warnings.warn("refused", refused.reason + " (shown once)")

    # ---- checks -----------------------------------------------------------------------------------------------
    def _check(
        self, trainer: pl.Trainer, model_state: Any, optimizer_states: Any, parity: torch.Tensor | None = None
    ) -> StateCheck:
        """The state check on every rank together (one all-reduce; ``parity``: compare the replicas too)."""

        def labels() -> list[list[str]]:
            return optimizer_labels(trainer.lightning_module, trainer.optimizers)

        device = trainer.strategy.root_device
        constants = self.board(trainer).constants(trainer)
        return check_state(model_state, optimizer_states, constants, device, labels, parity)

    def _check_live(self, trainer: pl.Trainer) -> StateCheck:
        state = live_state(trainer)
        return self._check(trainer, checked_weights(trainer, state), state["optimizers"])

    def _before_save(self, trainer: pl.Trainer) -> None:
        """Before every checkpoint (every rank): roll back first when the state is not finite, or refuse."""
        check = self._check_live(trainer)
        if check.finite:
            return
        if trainer.interrupted:
            if self._restore_for_exit(trainer, check, "an exception"):
                return
            self._refuse_checkpoint(trainer, check, "no snapshot verified finite is left to restore")
        if "nonfinite_state" not in self.triggers:
            self._refuse_checkpoint(trainer, check, "'nonfinite_state' is not among Rollback's triggers")
        self._roll_back_nonfinite(trainer, check, "when a checkpoint was to be written")

    def _before_scoring(self, trainer: pl.Trainer, when: str = "when validation was to score them") -> None:
        """Before validation scores the weights within a fit (every rank): roll back first when the state is not
        finite. The metrics it computes name and rank the checkpoints written next (``ModelCheckpoint``'s monitor):
        a rollback at the save instead would file the restored weights under the score of the ones replaced (a NaN in
        a parameter the loss never reads, an embedding's unused row, leaves the validation loss finite), and a
        checkpoint kept as the best would hold the fit's first weights."""
        if "nonfinite_state" not in self.triggers:
            return  # the checkpoint guard refuses such a save instead
        check = self._check_live(trainer)
        if not check.finite:
            self._roll_back_nonfinite(trainer, check, when)

    def _roll_back_nonfinite(self, trainer: pl.Trainer, check: StateCheck, when: str) -> None:
        """Roll back the live state that ``check`` found non-finite at a moment outside the step (``when``)."""
        reason = f"Rollback: the {check.what} held inf/NaN{_quote(check.names)} {when}"
        self._roll_back(trainer, Signal("nonfinite_state", int(trainer.global_step), reason, "Rollback"))
        self._restored_at = int(trainer.global_step)

    def _refuse_if_nonfinite(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        """A checkpoint assembled past the guard: refuse it when it holds inf/NaN (every rank)."""
        check = self._check(trainer, checkpoint.get("state_dict", {}), checkpoint.get("optimizer_states", []))
        if not check.finite:
            self._refuse_checkpoint(trainer, check, "it was assembled outside trainer.save_checkpoint")

    def _restore_if_nonfinite(self, trainer: pl.Trainer, cause: str) -> None:
        """On the way out of a fit stopped by an error (a suite error on every rank, any error in one process):
        restore when the state holds inf/NaN."""
        check = self._check_live(trainer)
        if not check.finite:
            self._restore_for_exit(trainer, check, cause)

    def _refuse_checkpoint(self, trainer: pl.Trainer, check: StateCheck, why: str) -> NoReturn:
        step = int(trainer.global_step)
        message = (
            f"Rollback: refused to write a checkpoint at step {step}: its {check.what} {check.contain} inf/NaN on "
            f"rank(s) {_ranks(check.ranks)}{_quote(check.names)}, and {why}; nothing was written."
        )
        hint = _checkpoint_hint(trainer, self.triggers)
        self._event(trainer, "checkpoint_refused", message, rank=min(check.ranks), parameters=check.names[:MAX_NAMES])
        raise NonFiniteError(
            f"{message} HINT: {hint}." if hint else message,
            kind="weight" if check.weight_ranks else "optimizer_state",
            step=step,
            ranks=check.ranks,
            parameters=check.names[:MAX_NAMES],
            hint=hint,
        )

    # ---- snapshots --------------------------------------------------------------------------------------------
    def _take(self, trainer: pl.Trainer, start: bool = False, keep: bool = False, counting: bool = False
              ) -> Signal | None:  # fmt: skip
        """Snapshot the live state if it is finite on every rank and, for replicas, the same on every rank. When
        it is not: journal it, return it as a signal (``nonfinite_state`` or ``replica_mismatch``).

        Args:
            start: the state the fit starts from.
            keep: only check it (a resumed fit that goes on with its snapshot files).
            counting: leave the healthy steps counted so far as they are (a resumed fit).
        """
        if not counting:
            self._healthy = 0
        state = live_state(trainer)
        replicas = trainer.world_size > 1 and _compat.replicated_strategy(trainer.strategy)
        parity = checksum(list(trainer.lightning_module.parameters())) if replicas else None
        check = self._check(trainer, checked_weights(trainer, state), state["optimizers"], parity)
        step = int(trainer.global_step)
        if not check.finite:
            target = "the fit starts from a non-finite state, which" if start else "this state"
            message = (
                f"Rollback: the {check.what} at step {step} {check.contain} inf/NaN on rank(s) {_ranks(check.ranks)}"
                f"{_quote(check.names)}; {target} is no rollback target"
            )
            self._event(trainer, "snapshot_refused", message, rank=min(check.ranks), tensors=check.names[:MAX_NAMES])
            return Signal("nonfinite_state", step, message, "Rollback")
        if check.replica_ranks:
            # Restored by a broadcast from each tensor's owner, such a snapshot would spread one rank's corruption.
            message = (
                f"Rollback: the weights of rank(s) {_ranks(check.replica_ranks)} differ from the other replicas' at "
                f"step {step}; {'the state the fit starts from' if start else 'this state'} is no rollback target"
            )
            self._event(trainer, "snapshot_refused", message, rank=min(check.replica_ranks),
                        ranks=list(check.replica_ranks))  # fmt: skip
            return Signal("replica_mismatch", step, message, "Rollback")
        extras = copy.deepcopy(self.board(trainer).snapshot_extras(trainer))
        held, owners = split_snapshot(trainer, state)
        if keep:  # the last resort of a resumed fit, out of the ring: its files are the targets the run had
            self._restart = Snapshot(step, take_snapshot(state, None, held), extras, owners=dict(owners))
            return None
        self._restart = None  # a snapshot of this fit's own from now on
        module = trainer.lightning_module
        layout = module_layout(module)
        if layout != self._layout:  # pruned inside an epoch: carried before the oldest's buffers take the new state
            self._carry_across_pruning(module)
        snapshot = self._memory.take(step, state, extras, held, owners)
        self._layout, self._names = layout, parameter_names(module)
        if not counting:  # a new target: no retry of it yet
            self._last_target, self._last_settings, self._retries = None, (), 0
        if self._files is not None:
            self._write(trainer, snapshot)
        return None

    def _prepare_files(self, trainer: pl.Trainer) -> None:
        """Check this rank's folder of ``dirpath`` on every rank and raise on every rank alike; remove killed writes'
        leftovers. On several ranks each writes the part of the state it holds, into ``<dirpath>/rank=<r>``."""
        if self._files is None:
            return
        writer = self._files.for_rank(trainer.global_rank) if trainer.world_size > 1 else self._files
        problem = writer.problem()
        (ranks,) = flags_by_rank([torch.tensor(float(bool(problem)))], trainer.strategy.root_device)
        if ranks:  # every rank raises, or none
            where = problem if problem else f"rank(s) {list(ranks)} cannot write to their folder there"
            raise ValueError(f"'dirpath' must be a directory Rollback can write to (got {self.dirpath!r}: {where})")
        writer.remove_temporaries()
        self._writer = writer

    def _write(self, trainer: pl.Trainer, snapshot: Snapshot) -> None:
        assert self._writer is not None
        name = snapshot_name(snapshot.step)
        payload = {"state": snapshot.state, "extras": snapshot.extras}
        if trainer.world_size > 1:  # a part of the state: whose, and how the parts fit together
            payload.update(rank=int(trainer.global_rank), world_size=int(trainer.world_size), owners=snapshot.owners)
        digest = None
        try:
            digest = self._writer.write(name, payload, step=snapshot.step)
        except Exception as err:  # a full disk must not stop training: the memory snapshot is intact
            self._writer.remove(name)  # an older file under this name holds another state
            message = (
                f"Rollback: could not write the snapshot of step {snapshot.step} to {self._writer.dirpath}: {err}; "
                f"the snapshot in memory is intact, and a resumed run will find no file for this step"
            )
            self._event(trainer, "snapshot_write_failed", message, file=name)
            self._warnings.warn("write", message + " (shown once)")
        # The bookkeeping goes on as on the other ranks, which cannot know that this one failed: every rank must
        # list the same rollback targets, or some would enter the collective of _load without the others.
        snapshot.file = name
        # Each rank's file's digest, in every rank's list (rank 0's state is the checkpoint's): a resumed run uses
        # only files it wrote itself, not another run's written over them in a shared dirpath.
        entry = {"step": snapshot.step, "file": name, "digests": objects_by_rank(digest)}
        self._disk = [e for e in self._disk if e["step"] != snapshot.step] + [entry]
        while len(self._disk) > self.keep:
            old = self._disk.pop(0)
            self._before_restart = [s for s in self._before_restart if s.file != old["file"]]
            self._writer.remove(old["file"])

    def _candidates(self) -> list[Snapshot]:
        """Rollback targets, newest first; a memory snapshot wins over a file of the same step."""
        steps = set(self._memory.steps)
        older = [s for s in self._before_restart if s.step not in steps]
        return sorted(self._memory.snapshots + older, key=lambda s: (s.step, s.state is not None), reverse=True)

    def _with_last_resort(self) -> list[Snapshot]:
        """The candidates, then the state a resumed fit started from, held for when none of its files can be used."""
        return self._candidates() + ([self._restart] if self._restart is not None else [])

    def _targets(
        self, settings: tuple[float, ...], onset: int | None, retry: bool = False
    ) -> tuple[list[Snapshot], Snapshot | None]:
        """The candidates in the order to try, and the one avoided. Never the same snapshot twice with the same
        settings: having diverged again from the last target (no newer snapshot since) with nothing changed (no
        backoff since), go one snapshot further back and keep that one only as a last resort. With a new LR scale,
        the newest snapshot is the best place to try again, once: diverging from it again after that, go further
        back too. When the evidence names the step the state began to degrade (``onset``), the snapshots from
        before it come first, newest first, then the later ones nearest the onset first. A ``retry`` (a follow-up
        trial's remedy at lower rates from the snapshot the last one started from) is no repeat."""
        candidates = self._candidates()
        if onset is not None:
            later = [c for c in candidates if c.step > onset]
            candidates = [c for c in candidates if c.step <= onset] + later[::-1]
        # A snapshot that diverged again after a retry at a new LR scale holds the fault itself: go further back.
        again = settings == self._last_settings or self._retries >= 1
        repeat = candidates and candidates[0].step == self._last_target and again and not retry
        if len(candidates) > 1 and repeat:
            return candidates[1:] + candidates[:1], candidates[0]
        return candidates, None

    # ---- trials -----------------------------------------------------------------------------------------------
    @override
    def _remedy_start(self, trainer: pl.Trainer, signal: Signal) -> Snapshot | None:
        """Restore the snapshot a rollback for ``signal`` would go to, quietly: the start of a trial's remedy. None
        when there is no snapshot, the budget is spent and nothing changed since the last rollback, or the suspicion
        restarts only once (``RESTART_ONCE``) and that snapshot is no newer than the one the run last restarted from."""
        settings = self.board(trainer).settings()
        if not self._budget_left(int(trainer.global_step), settings) or not self._candidates():
            return None
        candidates, _ = self._targets(settings, signal.onset, signal.retry)
        if signal.kind in RESTART_ONCE and self.history and candidates[0].step <= self.history[-1]["snapshot_step"]:
            return None  # back to or past the last restart: the remedy is a lower rate from where the run stands
        restored = self._restore_first(trainer, candidates, notify=False)
        return restored[0] if restored is not None else None

    @override
    def _after_trial(self, trainer: pl.Trainer, outcome: TrialOutcome) -> None:
        """A kept remedy that started from a snapshot is a rollback to it, counted and journaled as one; the snapshots
        taken since belong to the run it replaced. A discarded remedy changes nothing here."""
        remedy = outcome.remedy
        if not outcome.kept or remedy.snapshot_step is None:
            return
        for newer in [c for c in self._candidates() if c.step > remedy.snapshot_step]:
            self._forget(newer)
        trial = outcome.trial
        self._record_rollback(trainer, Signal(trial.kind, trial.step, trial.reason, trial.source), remedy.snapshot_step,
                              "trial")  # fmt: skip

    # ---- rolling back -----------------------------------------------------------------------------------------
    def _budget_left(self, step: int, settings: tuple[float, ...]) -> bool:
        """Whether a rollback with ``settings`` may be made at ``step``: a retry with new settings always may."""
        return self._progress(settings) or len(self._recent(step)) < self.max_rollbacks

    def _progress(self, settings: tuple[float, ...]) -> bool:
        """Whether a rollback with ``settings`` is progress (the LR backed off since the last rollback)."""
        return bool(self.history) and self._rollback_settings is not None and settings != self._rollback_settings

    def _recent(self, step: int) -> list[dict[str, Any]]:
        """The counted rollbacks within the window."""
        return [h for i, h in enumerate(self.history) if step - h["step"] < self.window and i not in self._free]

    def _roll_back(self, trainer: pl.Trainer, signal: Signal) -> None:
        step = int(trainer.global_step)
        settings = self.board(trainer).settings()
        if not self._budget_left(step, settings):
            if signal.kind in SUSPICION_SIGNALS:  # only what is certain may stop a run: a suspicion is left alone
                return
            self._stop(trainer, signal, self._recent(step))
        candidates, avoided = self._targets(settings, signal.onset)
        restored = self._restore_first(trainer, candidates)
        if restored is None and self._restart is not None:  # none of the files could be used
            restored = self._restore_first(trainer, [self._restart])
        if restored is None:
            self._no_snapshot(trainer, signal)
        target, source = restored
        if avoided is not None and target is not avoided:
            self._forget(avoided)
        if signal.onset is not None:  # the newer snapshots were taken as the state degraded: no target any more
            for newer in [c for c in self._candidates() if c.step > target.step]:
                self._forget(newer)
        self._record_rollback(trainer, signal, target.step, source)

    def _hold_unscored_saves(self, trainer: pl.Trainer) -> None:
        """After a rollback, while a metric of the training steps is that of the weights replaced, the checkpoint
        callbacks that rank by it write nothing (they save after this callback's hook): a file of the restored
        weights filed under it would be ranked by another state's loss, kept as the best (the fit's first weights,
        after a rollback to its start) and the trained one removed. One step's value (``train_loss_step``) is the
        replaced weights' at the rollback's step only; an epoch's mean of theirs, until the rollback's epoch ends. A
        validation metric is computed on the restored weights: its checkpoints are written."""
        unscored = self._unscored
        if unscored is None or unscored["epoch"] != trainer.current_epoch:
            return
        step = int(trainer.global_step)
        for callback in getattr(trainer, "checkpoint_callbacks", []):
            monitor = getattr(callback, "monitor", None)
            if monitor is None or not _compat.logged_in_training(trainer, monitor):
                continue
            one_step = _compat.monitors_one_step(trainer, monitor)
            if one_step and step != unscored["step"]:
                continue  # logged by the restored weights' own steps since
            _compat.hold_checkpoint_saves(callback, step)
            if id(callback) in self._held:
                continue
            self._held.add(id(callback))
            until = "from the next step, logged of their own" if one_step else "once the epoch of the rollback ends"
            self._event(
                trainer, "checkpoint_skipped",
                f"Rollback: {type(callback).__name__}(monitor={monitor!r}) wrote no checkpoint at step {step}: "
                f"{monitor!r} is logged by the training steps, and its value is that of the weights the rollback at "
                f"step {unscored['step']} replaced; the restored weights (the snapshot of step {unscored['target']}) "
                f"get checkpoints ranked by it {until}",
                monitor=monitor, rollback_step=unscored["step"], snapshot_step=unscored["target"],
            )  # fmt: skip

    def _record_rollback(self, trainer: pl.Trainer, signal: Signal, target: int, source: str) -> None:
        """Count and journal a rollback to the snapshot of step ``target``, made at this step."""
        step = int(trainer.global_step)
        self._unscored = {"step": step, "epoch": trainer.current_epoch, "target": target}
        self._held = set()
        settings = self.board(trainer).settings()
        # A retry with new settings (the LR backed off since the last rollback) is progress, bounded by the backoff's
        # floor: only the retries that changed nothing spend the budget.
        progress = self._progress(settings)
        recent = self._recent(step)
        entry = {
            "step": step,
            "reason": signal.kind,
            "trigger_step": signal.step,
            "snapshot_step": target,
            "source": source,
        }
        if progress:
            self._free.add(len(self.history))
        self.history.append(entry)
        self._rollback_settings = settings
        self.rollbacks += 1
        self._retries = self._retries + 1 if target == self._last_target else 0
        self._last_target = target
        self._last_settings = settings
        self._healthy = 0
        left = max(0, self.max_rollbacks - len(recent) - (not progress))
        what = (
            f"a trial kept the remedy that started from the snapshot of step {target}, at step {step},"
            if source == "trial"
            else f"restored the snapshot of step {target} ({source}) at step {step}"
        )
        counted = (
            "The learning rate was backed off since the last rollback, so this one is not counted"
            if progress
            else "This one is counted"
        )
        message = (
            f"Rollback: {what} after {signal.kind} at step {signal.step} ({signal.reason}). {counted}: {left} "
            f"more allowed within {self.window} steps (max_rollbacks={self.max_rollbacks}; one that follows a backoff "
            f"of the learning rate is not counted)."
        )
        details = {key: value for key, value in entry.items() if key != "step"}  # the event's own step
        details["fit_start"] = self._fit_start  # whether the restore returned to the state the fit started from
        # The rates the run goes on with: the restored schedule's, as LRBackoff scaled them again.
        details["lrs"] = [group_rates(optimizer) for optimizer in trainer.optimizers]
        self._event(trainer, "rollback", message, **details, rollbacks=self.rollbacks, budget_left=left,
                    counted=not progress)  # fmt: skip

    def _forget(self, snapshot: Snapshot) -> None:
        """Never a rollback target again: out of memory, and its file removed, so a resumed run cannot find it."""
        self._memory.discard(snapshot)
        self._before_restart = [s for s in self._before_restart if s.step != snapshot.step]
        written = [entry for entry in self._disk if entry["step"] == snapshot.step]
        self._disk = [entry for entry in self._disk if entry["step"] != snapshot.step]
        if self._writer is not None:
            for entry in written:
                self._writer.remove(entry["file"])

    def _restore_first(
        self, trainer: pl.Trainer, candidates: list[Snapshot], notify: bool = True
    ) -> tuple[Snapshot, str] | None:
        """Restore the first usable candidate (a file is read and verified first): ``(it, "memory" or "disk")``, or
        ``None`` when none is usable. A candidate that cannot be used is journaled and dropped for good. ``notify``:
        tell the suite's callbacks of the restore (not for a trial's remedy, which is not the run's state yet)."""
        self._carry_across_pruning(trainer.lightning_module)
        for candidate in candidates:
            source, state = "memory", candidate.state
            if state is None:
                source, state = "disk", self._load(trainer, candidate)
            elif problem := restorable(trainer, state):
                self._unusable(trainer, candidate, f"the snapshot of step {candidate.step} in memory", problem)
                state = None
            if state is None:
                self._forget(candidate)
                continue
            restore_(trainer, state, candidate.owners)
            if notify:
                self.board(trainer).after_restore(trainer, candidate.extras)
            return candidate, source
        return None

    def _load(self, trainer: pl.Trainer, candidate: Snapshot) -> dict[str, Any] | None:
        """Read and verify a file from before the restart on every rank (each its own part on several ranks);
        ``None`` unless every rank could use its file."""
        assert self._writer is not None and candidate.file is not None
        # The digest the file had when this run wrote it (none listed in checkpoints of earlier releases; ``None``
        # for a rank whose write failed: whatever is there under that name is not this run's).
        digests = next((e.get("digests") for e in self._disk if e["file"] == candidate.file), None)
        mine = digests[trainer.global_rank] if digests is not None and len(digests) == trainer.world_size else ""
        if mine is None:
            state, rest, problem = None, {}, f"this run's write of the snapshot of step {candidate.step} failed"
        else:
            state, rest, problem = self._writer.read_checked(
                candidate.file, candidate.step, lambda payload: self._unfit(trainer, payload), mine or None
            )
        candidate.extras, candidate.owners = dict(rest.get("extras", {})), dict(rest.get("owners", {}))
        (unusable,) = flags_by_rank([torch.tensor(float(bool(problem)))], trainer.strategy.root_device)
        if not unusable:
            return state
        where = f"the snapshot file {self._writer.path(candidate.file)}"
        self._unusable(trainer, candidate, where, problem, ranks=unusable)
        return None

    def _unfit(self, trainer: pl.Trainer, payload: Any) -> str:
        """Why a snapshot file's payload cannot become the live state here: written by another rank or world size,
        another layout, or inf/NaN in the tensors it holds."""
        written = (int(payload.get("rank", 0)), int(payload.get("world_size", 1)))
        if written != (trainer.global_rank, trainer.world_size):
            here = (trainer.global_rank, trainer.world_size)
            return f"it was written by rank {written[0]} of {written[1]}, not rank {here[0]} of {here[1]}"
        state = payload["state"]
        problem = restorable(trainer, state)
        if problem:
            return problem
        held = without_placeholders(state)
        weights, states = nonfinite_parts(held["model"], held["optimizers"], self.board(trainer).constants(trainer))
        return f"it holds inf/NaN{_quote(weights + states)}" if weights or states else ""

    def _unusable(
        self, trainer: pl.Trainer, candidate: Snapshot, where: str, problem: str, ranks: tuple[int, ...] = ()
    ) -> None:
        on = f" on rank(s) {list(ranks)}" if ranks else ""
        message = f"Rollback: {where} cannot be used{on}" + (f": {problem}" if problem else "")
        message += "; it is dropped and the next snapshot is tried."
        self._dropped += 1
        self._event(trainer, "snapshot_unusable", message, file=candidate.file, snapshot_step=candidate.step,
                    problem=problem, ranks=list(ranks))  # fmt: skip
        self._warnings.warn(f"unusable:{candidate.file}:{candidate.step}", message)

    @override
    def _answer_at_end(self, trainer: pl.Trainer, check: StateCheck) -> bool:
        """The fit ends with inf/NaN in its state (a final update that wrote NaN, a buffer poisoned between checks):
        restore the last verified snapshot, without counting a rollback; journal and warn once."""
        if not self.restores_state:
            return False
        restored = self._restore_first(trainer, self._with_last_resort())
        ended = (
            f"Rollback: the fit ended at step {trainer.global_step} with inf/NaN in its {check.what} on rank(s) "
            f"{_ranks(check.ranks)}{_quote(check.names)}"
        )
        if restored is None:
            message = f"{ended}, and no snapshot verified finite could be restored: the model returned holds them."
            self._event(trainer, "exit_restore", message, error="end of fit", snapshot_step=None)
        else:
            target, source = restored
            message = (
                f"{ended}; restored the snapshot of step {target.step} ({source}): the model returned holds finite "
                f"values, and the steps since that snapshot are lost."
            )
            self._event(trainer, "exit_restore", message, error="end of fit", snapshot_step=target.step, source=source)
        self._warnings.warn("end", message)
        return True

    def _restore_for_exit(self, trainer: pl.Trainer, check: StateCheck, cause: str) -> bool:
        """On the way out of a failed fit: restore the last verified snapshot, without counting a rollback (the
        budget and ``history`` stay). Whether one was restored."""
        restored = self._restore_first(trainer, self._with_last_resort())
        step = int(trainer.global_step)
        stopped = f"Rollback: the fit stopped at step {step} ({cause}) with inf/NaN in its {check.what} on rank(s) "
        if restored is None:
            message = f"{stopped}{_ranks(check.ranks)}, and no snapshot verified finite could be restored."
            self._event(trainer, "exit_restore", message, error=cause, snapshot_step=None)
            return False
        target, source = restored
        message = (
            f"{stopped}{_ranks(check.ranks)}; restored the snapshot of step {target.step} ({source}), so the model in "
            f"memory and any checkpoint written on the way out hold finite values. The error itself propagates."
        )
        self._event(trainer, "exit_restore", message, error=cause, snapshot_step=target.step, source=source)
        return True

    def _no_snapshot(self, trainer: pl.Trainer, signal: Signal) -> NoReturn:
        if self._dropped:
            why = f"is left: {self._dropped} could not be used in this fit (the journal's snapshot_unusable says why)"
            hint = (
                "resume from a checkpoint written before the divergence (checkpoints written while Rollback is in the "
                "callbacks are finite); with dirpath set, a resumed run can also return to the snapshot files listed "
                "in its checkpoint"
            )
        else:
            why = "exists: the state the fit started from was already non-finite and no later state passed the check"
            hint = (
                "the state held inf/NaN before the fit's first update, which no learning rate or rollback can mend: "
                "look at what set it (the model's initialisation, one computed from the data such as a mean of "
                "targets holding inf/NaN, or the checkpoint or weights it was loaded from)"
            )
        message = (
            f"Rollback: a rollback was needed at step {trainer.global_step} ({signal.kind} at step {signal.step}: "
            f"{signal.reason}) but no snapshot verified finite {why}. Nothing was restored. HINT: {hint}."
        )
        self._event(trainer, "abort", message, reason=signal.kind)
        raise RollbackError(message, step=int(trainer.global_step))

    def _stop(self, trainer: pl.Trainer, signal: Signal, recent: list[dict[str, Any]]) -> NoReturn:
        step = int(trainer.global_step)
        restored = self._restore_first(trainer, self._with_last_resort())
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
        board = self.board(trainer)
        message = (
            f"Rollback: the run diverged again at step {step} on rank {trainer.global_rank} (every rank stops "
            f"together) ({signal.kind} at step {signal.step}: {signal.reason}) after {len(recent)} rollback(s) within "
            f"{self.window} steps (max_rollbacks={self.max_rollbacks}). Rollbacks: {listed}. {note} HINT: "
            f"{divergence_hint(board.present(), board.cause)}; {HINT}."
        )
        self._event(trainer, "abort", message, reason=signal.kind, rollbacks=[dict(h) for h in recent])
        raise DivergenceError(message, step=step, history=recent)

    # ---- counters and state -----------------------------------------------------------------------------------
    @override
    def _counters(self) -> dict[str, float]:
        return {"overflow/rollbacks": self.rollbacks}

    @override
    def state_dict(self) -> dict[str, Any]:
        return versioned({
            "rollbacks": self.rollbacks,
            "history": [dict(h) for h in self.history],
            "healthy_steps": self._healthy,
            "disk": [dict(e) for e in self._disk],
            "free": sorted(self._free),  # the rollbacks of history that spent no budget (progress)
            # What the choice of the next target rests on: the last target, the settings then, the retries of it.
            "last_target": self._last_target,
            "last_settings": list(self._last_settings),
            "retries": self._retries,
            "rollback_settings": None if self._rollback_settings is None else list(self._rollback_settings),
            "trial": self._trial_state(),
        })  # fmt: skip

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Version 1 (0.2) knew no decision state: a resumed run of it chooses its next target afresh.
        state = StateReader(
            "Rollback", state_dict,
            since={"last_target": 2, "last_settings": 2, "retries": 2, "rollback_settings": 2, "trial": 2},
        )  # fmt: skip
        self.rollbacks = state.get("rollbacks", int)
        self.history = state.get("history", lambda v: [dict(h) for h in v])
        self._healthy = state.get("healthy_steps", int)
        self._disk = state.get("disk", lambda v: [{"step": int(e["step"]), "file": str(e["file"]),
                                                    "digests": e.get("digests")} for e in v])  # fmt: skip
        self._free = state.get("free", lambda v: _indices(v, len(self.history)))
        self._last_target = state.get("last_target", _optional_int, old=None)
        self._last_settings = state.get("last_settings", _floats, old=())
        self._retries = state.get("retries", int, old=0)
        self._rollback_settings = state.get("rollback_settings", lambda v: None if v is None else _floats(v), old=None)
        self._resumed = True
        self._load_trial_state(state.get("trial", lambda v: v, old=None))
        state.finish(ignored=("skipped_steps", "skip_left"))  # skip_batches', written by earlier releases


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _floats(values: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _indices(values: Any, size: int) -> set[int]:
    """History indices, each within the history."""
    indices = {int(i) for i in values}
    if any(not 0 <= i < size for i in indices):
        raise ValueError(f"an index lies outside the {size} rollbacks of 'history'")
    return indices


# ---- messages and refusals --------------------------------------------------------------------------------------
def _checkpoint_hint(trainer: pl.Trainer, triggers: tuple[str, ...]) -> str:
    """What would let Rollback restore a finite state before a save, naming only what the trainer lacks."""
    hints = []
    if "nonfinite_state" not in triggers:
        hints.append("add 'nonfinite_state' to Rollback's triggers, so that it rolls back before a save")
    if not _has_callback(trainer, "NonFiniteDetector"):
        hints.append("add NonFiniteDetector, so that inf/NaN is found at the step it appears")
    return "; ".join(hints)


def _has_callback(trainer: pl.Trainer, class_name: str) -> bool:
    callbacks = getattr(trainer, "callbacks", [])
    return any(cls.__name__ == class_name for cb in callbacks for cls in type(cb).__mro__)


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks))


def _quote(names: list[str]) -> str:
    if not names:
        return ""
    more = f" (+{len(names) - MAX_NAMES} more)" if len(names) > MAX_NAMES else ""
    return f" (in {', '.join(names[:MAX_NAMES])}{more})"


def _refuse_sharded(strategy: Any) -> None:
    """Refuse a sharded strategy other than FSDP2's (the suite refuses FSDP1, XLA's FSDP and DeepSpeed itself)."""
    name = _compat.sharded_strategy(strategy)
    if name is not None and name not in _compat.SUPPORTED_SHARDED_STRATEGIES:
        raise NotImplementedError(_sharded_message(name))


def _refuse_sharded_optimizers(optimizers: list[torch.optim.Optimizer]) -> None:
    name = unrestorable_optimizer(optimizers)
    if name is not None:
        raise NotImplementedError(_sharded_message(name))


_REFUSED = {
    "ZeroRedundancyOptimizer": "it keeps each rank's part of the optimizer state in a layout of its own, which "
    "Rollback cannot snapshot and restore in place",
}


def _sharded_message(name: str) -> str:
    reason = _REFUSED.get(name, "Rollback has not been run under it, and its ranks may hold parts of the state")
    return (
        f"Rollback does not support {name}: {reason}. Use strategy='ddp', or ModelParallelStrategy with fully_shard "
        f"in configure_model (FSDP2), with a plain torch optimizer, or remove Rollback from the callbacks."
    )


def _renamed_path(path: str, renamed: dict[str, str]) -> str:
    """A split snapshot's tensor path (``model.<key>``) after pruning renamed its key."""
    key = path.removeprefix("model.")
    return f"model.{renamed[key]}" if path.startswith("model.") and key in renamed else path
