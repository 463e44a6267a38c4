"""NonFiniteDetector: find inf/NaN in the loss, gradients, weights and optimizer state; skip, warn or raise; say
where it came from; warn before the run reaches the FP32 limit."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NoReturn

import pytorch_lightning as pl
import torch
from typing_extensions import override

from lightning_overflow import _compat
from lightning_overflow._validation import check_bool, check_choice, check_int, refuse_removed
from lightning_overflow.callback_state import StateReader, versioned
from lightning_overflow.callbacks._base import DETECTOR, SuiteCallback
from lightning_overflow.diagnosis.headroom import Headroom, HeadroomProbe
from lightning_overflow.diagnosis.hints import detection_hint, divergence_hint
from lightning_overflow.diagnosis.records import Diagnosis, Replay
from lightning_overflow.diagnosis.replay import BatchStats, KeptBatch, batch_stats, diagnose_step, holds_bad_values
from lightning_overflow.distributed import flags_by_rank, named_on_any_rank, objects_by_rank, world
from lightning_overflow.events import WarningCache
from lightning_overflow.exceptions import DivergenceError, NonFiniteError
from lightning_overflow.faulted_steps import (
    FaultedStep,
    answer_detached,
    answer_error,
    raises_without_bad_values,
    stand_in_loss,
)
from lightning_overflow.health import (
    MAX_NAMES,
    StepHealth,
    finite_checked_monitors,
    inspect_state,
    nonfinite_at_end,
    skipped_loss_route,
    state_flags,
)
from lightning_overflow.numerics import FP32_MAX, parameters_of
from lightning_overflow.numerics.snapshots import nonfinite_flag
from lightning_overflow.policy import (
    BURST_COUNT,
    BURST_WINDOW,
    DEFAULT_LOSS_SCALE,
    HEADROOM_WARN_DECADES,
    MAX_SCALER_OVERFLOWS,
    MAX_SKIPPED_SHARE,
    MIN_LOSS_SCALE,
    PERSIST_AFTER,
    REMOVED_SETTINGS,
    SKIP_WINDOW,
    StepAction,
    Verdict,
)
from lightning_overflow.preserve import batch_copy, capture_rng, side_run
from lightning_overflow.replicas import checksum, compare, differing_parameters
from lightning_overflow.training_state import StateCheck, restore_hint, unrestorable_optimizer
from lightning_overflow.training_step import loss_of

__all__ = ["NonFiniteDetector"]

Action = Literal["skip", "raise", "warn"]



@dataclass
class Finding:
    """A detection on one optimizer step, identical on every rank."""

    kind: str  # loss | grad | buffer | weight | optimizer_state
    ranks: tuple[int, ...]
    names: list[str] = field(default_factory=list)
    overflow: bool = False
    hint_key: str = ""
    detail: str = ""
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    diagnosis: Diagnosis | None = None
    data_fault: bool = False


class NonFiniteDetector(SuiteCallback):
    """Find inf/NaN in the loss, the gradients, the weights and the optimizer state; skip the step, warn or raise.

    Where it looks: the loss of every backward pass (``on_before_backward``, per rank); the gradients before the
    optimizer step (pre-clip, after unscaling, all-reduced under DDP); every ``check_weights_every_n_steps`` the
    weights and the optimizer's floating-point state. All of it reaches the host in the suite's one read per step,
    and the verdict is identical on every rank.

    A ``training_step`` that a bad value broke before it produced a loss (``torch.distributions`` raises
    ``ValueError`` on a NaN argument; a loss comes back cut from the graph) is answered as an inf/NaN loss when its
    batch or the weights hold inf/NaN, or the batch values beyond 1e15: for the fit, the module's ``training_step`` is
    its own behind :func:`guarded_training_step` (:mod:`lightning_overflow.faulted_steps`). Any other error passes
    unchanged, and so does every error under a sharded strategy (FSDP).

    Under ``16-mixed`` the GradScaler overflows routinely while it calibrates its scale; such steps are left to the
    scaler. Only ``MAX_SCALER_OVERFLOWS`` (20) consecutive overflows, or a scale below ``MIN_LOSS_SCALE`` (1e-4),
    count; overflows at a scale above ``DEFAULT_LOSS_SCALE`` (GradScaler's default 65536: a scaler started higher
    halves down to it first) are calibration, not counted.

    An intervention when ``action="skip"``: a non-finite step becomes a true no-op (``zero_grad(set_to_none=True)``:
    weights, moments, weight decay and the optimizer's step counts untouched) and the step-interval LR schedulers
    are held where they were. ``global_step`` still advances (Lightning counts the attempt). The buffers the step's
    forward passes wrote (BatchNorm's running statistics) are put back too; under manual optimization, where a batch
    steps several optimizers and one's forward writes buffers another's step relies on, only those that hold inf/NaN.

    Args:
        action: ``"skip"`` (default) skips the step and goes on; ``"raise"`` raises :class:`NonFiniteError` at the
            first detection; ``"warn"`` warns once per kind of finding and lets the step happen (the detector
            itself then changes nothing, but its signals still reach LRBackoff and Rollback when they are in the
            list).
        max_consecutive_skips: with ``action="skip"``, raise :class:`NonFiniteError` after this many consecutive
            non-finite steps (skipped, or left to Rollback when the weights themselves are non-finite; default 20:
            enough to ride out a bad stretch of data, few enough that a dead run stops before it wastes its
            schedule).
        check_replicas_every_n_steps: under DDP, compare a checksum of the weights across the replicas every this
            many steps (default ``None``: off; ``default_callbacks()`` turns it on at its snapshot interval). A rank
            whose weights differ (silent data corruption, a rank-local write) is named with the parameters that
            differ, journaled as ``replica_mismatch`` and signalled: ``Rollback`` then restores every rank to the
            same verified snapshot. Cost: one read of the weights per check, inside the step's one all-reduce.
        check_weights_every_n_steps: check weights and optimizer state every this many steps (default 100; ``None``
            or 0 disables). They are also checked whenever the loss or the gradients are non-finite, to name the
            cause.
        diagnose: on a non-finite loss or gradient, replay the step's batch with hooks on every module and op
            (the idea of fairseq's ``NanDetector``) and ask whether it reproduces (the idea of Megatron-LM's rerun
            machinery): the first module and op whose output (forward) or gradient (backward) became inf/NaN, its
            input and output magnitudes, NaN or inf or a finite norm beyond FP32, transient or persistent, the rank
            that saw it first, and a hint from the cause. Default ``True``. A replay costs about five training
            steps, once per detection; a healthy step pays a reference to the batch and a copy of the torch random
            state (about 4 us). The replay leaves the parameters, ``.grad``, the optimizer, the random streams,
            BatchNorm statistics and metric states as they were; see :mod:`lightning_overflow.diagnosis.replay`.
            Not replayed, and said so: manual optimization, a ``training_step`` that takes the ``dataloader_iter``,
            sharded strategies.
        headroom_every_n_steps: every this many optimizer steps (default 100; ``None`` or 0 disables), measure how
            many decades separate the largest magnitude of the step (loss, gradient norm, and activations sampled
            with forward hooks on that step only) from the FP32 limit, and log it.

    The rest is the policy's (constants of :mod:`lightning_overflow.policy`, no settings):

    - ``BURST_COUNT`` detections within ``BURST_WINDOW`` optimizer steps (3 in 50) are a burst, which
      interventions treat as divergence when their triggers name ``nonfinite_burst``. An isolated detection is
      absorbed by the skip alone: one corrupt sample must not cost the learning rate.
    - ``PERSIST_AFTER`` (3) consecutive non-finite steps on batches that hold no inf/NaN (nor values above 1e15):
      the state itself, not the data, produces them: signal ``nonfinite_persistent``, which the default
      interventions treat as divergence. Batches that do hold them are data faults: skipped, journaled as
      ``data_fault`` events (the batch's index in its epoch, the rows that hold them), and never held against the
      state, however often they recur (this needs ``diagnose=True``, which measures the batch).
    - The skip budget: when more than ``MAX_SKIPPED_SHARE`` of the last ``SKIP_WINDOW`` optimizer steps (half of the
      last 20) were skipped, by any suite callback, for any reason but a data fault, the run is not training,
      whether its skips come in a row or not: signal ``nonfinite_persistent`` (so ``LRBackoff`` and ``Rollback``
      back off and restore at once, and raise :class:`~lightning_overflow.DivergenceError` once nothing is left to
      try), and count afresh. With no callback that answers that signal, raise
      :class:`~lightning_overflow.DivergenceError` here, naming the step, the ranks, the counts and what to try.
    - Headroom: a warning, once, naming the module with the largest activation, when the headroom falls below
      ``HEADROOM_WARN_DECADES`` (20: below about 19.3 decades any square of the value, as in a variance, an L2 norm
      or an MSE, overflows FP32).

    Signals (read by interventions): ``nonfinite`` on every detection, ``nonfinite_burst`` on a burst,
    ``nonfinite_persistent`` when the state keeps producing non-finite steps, ``replica_mismatch`` when the DDP
    replicas' weights differ,
    ``nonfinite_state`` for inf/NaN weights or optimizer state, ``scaler_collapse`` for a failing GradScaler.

    Attributes:
        skipped_steps: optimizer steps skipped so far.
        nonfinite_events: detections so far.
        last_diagnosis: the :class:`~lightning_overflow.diagnosis.Diagnosis` of the last detection that was
            diagnosed (``None`` before). Also in the journal (``details["diagnosis"]``) and on
            :class:`NonFiniteError` (``.diagnosis``).
        last_headroom: the :class:`~lightning_overflow.diagnosis.headroom.Headroom` of the last sampled step.

    Raises:
        NonFiniteError: with ``action="raise"``; after ``max_consecutive_skips``; when the weights or optimizer
            state are non-finite and no callback in the list can restore them (``action="warn"`` never raises).

    Logged keys:

    ==========================================  ===============================================================
    key                                         meaning
    ==========================================  ===============================================================
    ``overflow/skipped_steps``                  cumulative optimizer steps skipped
    ``overflow/nonfinite_events``               cumulative non-finite detections
    ``overflow/headroom_decades``               decades between the step's largest magnitude and 3.4e38
    ``overflow/headroom_loss_decades``          the same for the loss alone
    ``overflow/headroom_grad_decades``          the same for the total gradient norm alone
    ``overflow/headroom_activation_decades``    the same for the largest activation of any module
    ==========================================  ===============================================================

    The headroom keys are logged every ``headroom_every_n_steps`` on healthy steps.

    Example:
        >>> import pytorch_lightning as pl
        >>> trainer = pl.Trainer(callbacks=[NonFiniteDetector(action="skip")], logger=False)
    """

    stage = DETECTOR

    max_scaler_overflows = MAX_SCALER_OVERFLOWS
    min_loss_scale = MIN_LOSS_SCALE
    burst_count, burst_window = BURST_COUNT, BURST_WINDOW
    persist_after = PERSIST_AFTER
    max_skipped_share, skip_window = MAX_SKIPPED_SHARE, SKIP_WINDOW
    headroom_warn_decades = HEADROOM_WARN_DECADES

    def __init__(
        self,
        action: Action = "skip",
        max_consecutive_skips: int = 20,
        check_weights_every_n_steps: int | None = 100,
        check_replicas_every_n_steps: int | None = None,
        diagnose: bool = True,
        headroom_every_n_steps: int | None = 100,
        **removed: Any,
    ) -> None:
        refuse_removed(NonFiniteDetector, removed, REMOVED_SETTINGS["NonFiniteDetector"])
        self.action = check_choice("action", action, ("skip", "raise", "warn"))
        self.max_consecutive_skips = check_int("max_consecutive_skips", max_consecutive_skips, minimum=1)
        self.check_weights_every_n_steps = (
            check_int("check_weights_every_n_steps", check_weights_every_n_steps, minimum=0, optional=True) or None
        )
        self.check_replicas_every_n_steps = (
            check_int("check_replicas_every_n_steps", check_replicas_every_n_steps, minimum=0, optional=True) or None
        )
        self.diagnose = check_bool("diagnose", diagnose)
        self.headroom_every_n_steps = (
            check_int("headroom_every_n_steps", headroom_every_n_steps, minimum=0, optional=True) or None
        )
        self.last_diagnosis: Diagnosis | None = None
        self.last_headroom: Headroom | None = None
        self._kept: KeptBatch | None = None
        self._batch: Any = None  # this batch, until its end
        self._step_guard: tuple[torch.nn.Module, Any, Any] | None = None  # (module, guard, previous)
        self._faulted: FaultedStep | None = None  # how this step's training_step failed, answered as a NaN loss
        self._batch_idx: int | None = None  # the index of this step's batch in its epoch
        # The micro-batches of this optimizer step before the current one (gradient accumulation, by the Trainer or
        # by the module's own code): their index and whether they hold bad values (a device flag), and the last one
        # until the next begins (flagged then: a step that steps every batch flags none).
        self._window: list[tuple[int, torch.Tensor | None]] = []
        self._held: tuple[int, Any] | None = None
        self._stepped = False  # an optimizer step was judged in this batch
        self._shown = False  # the step's batches were handed over (Guard.step(loss, batch=...)): their words count
        self._updated = False  # an optimizer step moved the weights since they were drawn (a resumed fit's did)
        self._monitors_to_place: list[str] = []  # what EarlyStopping(check_finite=True) monitors, until placed
        self._epoch_started = False
        self._finding: Finding | None = None
        every = self.headroom_every_n_steps
        self._headroom = HeadroomProbe(every, f"{type(self).__name__}.{id(self)}.headroom") if every else None
        self._headroom_warned = False
        self._recent: list[int] = []
        self._skips: list[bool] = []  # whether each of the last ``skip_window`` optimizer steps was skipped
        self.skipped_steps = 0
        self.nonfinite_events = 0
        self._consecutive = 0
        self._persistent = 0
        self._scaler_overflows = 0
        self._warnings = WarningCache()

    @property
    def state_key(self) -> str:
        try:
            return self._state_key  # built once: Lightning reads it often, its arguments never change
        except AttributeError:
            self._state_key: str = self._generate_state_key(action=self.action)
            return self._state_key

    # ---- wiring -----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            # A new fit starts at global_step 0: a previous fit's streaks and counts would mean nothing (a resumed
            # fit loads its own state after setup).
            self.skipped_steps = self.nonfinite_events = self._consecutive = self._scaler_overflows = 0
            self._persistent = 0
            self._headroom_warned = False
            self._recent = []
            self._skips = []
            self._warnings.clear()
            self._monitors_to_place = finite_checked_monitors(trainer)
            self._epoch_started = False
            _warn_about_spike_detection(trainer, self._warnings)
            self._guard_training_step(trainer, pl_module)
        if self._headroom is not None:
            self._headroom.reset()

    def _guard_training_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Answer a ``training_step`` broken by a bad value as an inf/NaN loss (:mod:`faulted_steps`)."""
        if self._step_guard is not None or not isinstance(pl_module, torch.nn.Module):
            return  # already guarded; the plain loop's module runs no training_step of its own
        if not pl_module.automatic_optimization and trainer.world_size > 1:
            # The optimizers step inside training_step: the steps of one rank's answer could not be sure to meet the
            # collectives of the other ranks' own steps in the same order.
            return
        if not _compat.replicated_strategy(trainer.strategy):
            # FSDP reduces each layer's gradients from hooks on the layers' outputs: a stand-in loss that skips the
            # layers on one rank would leave the other ranks waiting in those collectives.
            return
        guarded = guarded_training_step(pl_module, self._hear_faulted, self._hear_batch)
        self._step_guard = (pl_module, guarded, _compat.replace_method(pl_module, "training_step", guarded))

    def _hear_batch(self, batch: Any) -> None:
        """The batch as ``training_step`` receives it, its containers copied (tensors shared): after the module's own
        ``on_train_batch_start``, which may put new values into it, and before the step, which may write into it."""
        self._batch = batch_copy(batch)
        if self._kept is not None:
            self._kept = replace(self._kept, batch=self._batch)

    def _hear_faulted(self, faulted: FaultedStep) -> bool:
        """Whether a step that raised on bad values is answered as an inf/NaN loss: not when answering it would end
        the fit anyway (``action="raise"``, or the last of ``max_consecutive_skips``): the module's own error then
        ends it, as it would without the suite, told what was tried. Under DDP it is answered on every rank alike and
        the error is raised after the step's collective (:meth:`_end_with`), so that no rank is left waiting."""
        self._faulted = faulted
        board = self._board
        if faulted.error is None or board is None or world()[1] > 1:
            return True
        if self.action != "raise" and self._consecutive + 1 < self.max_consecutive_skips:
            return True
        trainer = board.owner
        step = int(trainer.global_step)
        why = ("action='raise'" if self.action == "raise" else
               f"{self.max_consecutive_skips} consecutive optimizer steps were non-finite, this one included")
        message = (f"NonFiniteDetector: at step {step} on rank(s) 0 {_step_code(trainer)} {faulted.failure} while "
                   f"{faulted.cause}; the fit ends with that error ({why}).")  # fmt: skip
        self._event(trainer, "abort", message)
        _note(faulted.error, f"lightning_overflow: {message}")
        return False

    def _end_with(self, error: NonFiniteError) -> NoReturn:
        """Raise ``error``; or, when this step raised on bad values, the module's own error from it (its type is
        the one the fit would have ended with without the suite)."""
        raised = self._faulted.error if self._faulted is not None else None
        if raised is None:
            raise error
        _note(raised, f"lightning_overflow: {error}")
        raise raised from error

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._updated = int(trainer.global_step) > 0
        _warn_about_anomaly_detection(self._warnings)
        _warn_about_vanishing_eps(trainer, self._warnings)

    @override
    def _before_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx
        # For the words of a data fault (manual optimization too), and for the replay, which runs before the batch is
        # released (one copy serves both: the words are read only on a step without a replay): its containers copied,
        # its tensors shared (a model may write its outputs into its input dict), by the guarded training_step as the
        # step receives it (_hear_batch); here where no guard is in place.
        self._batch = batch if self._step_guard is not None else batch_copy(batch)
        if self._held is not None:  # the batch before went into the step to come: no optimizer step since
            self._window.append((self._held[0], holds_bad_values(self._held[1])))
            self._held = None
        self._stepped = False
        if self.diagnose and pl_module.automatic_optimization:
            self._kept = KeptBatch(self._batch, batch_idx, capture_rng())
        if self._headroom is not None:
            self._headroom.on_batch_start(pl_module, int(trainer.global_step))

    @override
    def _after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        if not self._stepped and self._batch is not None:  # its gradients wait for a later batch's step
            self._held = (self._batch_idx if self._batch_idx is not None else -1, self._batch)
        self._kept = self._faulted = self._batch = None
        if self._monitors_to_place:  # a batch has logged what training_step logs
            self._monitors_to_place = _warn_about_early_stopping(trainer, self._monitors_to_place, self._warnings)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A metric logged from a training hook shows in the first epoch's results: at a batch, or (logged by the
        # module's on_train_epoch_end, which runs after this callback's) when the next epoch starts.
        if self._monitors_to_place and self._epoch_started:
            _warn_about_early_stopping(trainer, self._monitors_to_place, self._warnings)
            self._monitors_to_place = []
        self._epoch_started = True
        if self._headroom is not None and self._headroom.sampler.active:  # hooked for a sampled step
            self._headroom.on_batch_end(int(trainer.global_step))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self._release()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._release()

    @override
    def _answer_at_end(self, trainer: pl.Trainer, check: StateCheck) -> bool:
        """No callback restored the state the fit ends with: raise (``action="raise"``) or warn once, naming the
        tensors and the step."""
        message = nonfinite_at_end(trainer, check, who="NonFiniteDetector")
        self._event(trainer, "nonfinite_at_end", message, rank=min(check.ranks), parameters=check.names[:MAX_NAMES])
        if self.action == "raise":
            raise NonFiniteError(message, kind="weight" if check.weight_ranks else "optimizer_state",
                                 step=int(trainer.global_step), ranks=check.ranks, parameters=check.names[:MAX_NAMES],
                                 hint=restore_hint(unrestorable_optimizer(trainer.optimizers)))  # fmt: skip
        self._warnings.warn("end", message)
        return True

    def _release(self) -> None:
        self._kept = self._faulted = self._batch = None
        if self._step_guard is not None:
            module, guard, previous = self._step_guard
            if vars(module).get("training_step") is guard:  # not wrapped again since by someone else
                _compat.restore_method(module, "training_step", previous)
            self._step_guard = None
        if self._headroom is not None:
            self._headroom.release()

    @override
    def _contribute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: StepHealth) -> None:
        if self._headroom is not None:
            self._headroom.contribute(record)
        if self._replicas_due(trainer, record):
            sums = checksum(parameters_of(record.optimizer))
            record.add(self._key("replica_sum"), sums[0], per_rank=True)
            record.add(self._key("replica_sq"), sums[1], per_rank=True)
        board = self.board(trainer)
        if board.watches_buffers():  # what the forward passes wrote (BatchNorm's statistics): a skip puts it back
            # Per rank, and a slot on every rank alike (the module's layout decides, not what one forward wrote).
            # Only what this window wrote: a buffer already non-finite when it began is the state's check's (a skip,
            # which puts back that copy, could not mend it).
            constants, device = board.known_constants(), record.grad_norms.device
            written = board.buffers_written()
            now = nonfinite_flag([constants.without_constants(n, live) for n, live, _ in written], device)
            before = nonfinite_flag([constants.without_constants(n, saved) for n, _, saved in written], device)
            record.add(self._key("buffers"), now * (1 - before), per_rank=True)
        every = self.check_weights_every_n_steps
        if every is None or record.step % every:
            return
        # Per rank: one rank's weights can differ from the others' when something wrote to them locally.
        weights, moments = state_flags(trainer, record.optimizer)
        record.add(self._key(), torch.maximum(weights, moments), per_rank=True)

    def _key(self, what: str = "state") -> str:
        keys = self.__dict__.setdefault("_keys", {})  # built once each: asked several times a step
        key = keys.get(what)
        if key is None:
            key = keys[what] = f"{type(self).__name__}.{id(self)}.{what}"
        return key

    def _replicas_due(self, trainer: pl.Trainer, record: StepHealth) -> bool:
        every = self.check_replicas_every_n_steps
        return (
            every is not None
            and record.step % every == 0
            and record.world_size > 1
            and _compat.replicated_strategy(trainer.strategy)
        )

    def _check_replicas(self, trainer: pl.Trainer, record: StepHealth) -> None:
        """Compare the replicas' checksums (identical host values on every rank); on a mismatch name the ranks and
        the parameters (a second collective, entered by every rank), journal and signal it."""
        if not record.has(self._key("replica_sum")):
            return
        slots = record.value(self._key("replica_sum")) + record.value(self._key("replica_sq"))
        mismatch = compare(slots, record.world_size)
        if mismatch is None:
            return
        module = trainer.lightning_module
        names = differing_parameters(list(module.named_parameters()), record.grad_norms.device)
        ranks = ", ".join(map(str, mismatch.ranks))
        more = f" (+{len(names) - MAX_NAMES} more)" if len(names) > MAX_NAMES else ""
        message = (
            f"NonFiniteDetector: the weights of rank(s) {ranks} differ from the other replicas' at step {record.step} "
            f"(in {', '.join(names[:MAX_NAMES]) or 'no single parameter'}{more}): silent data corruption or a "
            f"rank-local write. "
            + _replicas_hint(trainer)
        )
        self._event(trainer, "replica_mismatch", message, rank=min(mismatch.ranks), ranks=list(mismatch.ranks),
                    parameters=names[:MAX_NAMES])  # fmt: skip
        self._signal(trainer, "replica_mismatch", message, record.optimizer_index)
        if not _state_recovery_in(trainer):
            self._warnings.warn("replicas", message)

    # ---- the decision -----------------------------------------------------------------------------------------
    @override
    def _judge(self, trainer: pl.Trainer, record: StepHealth) -> Verdict | None:
        self._check_replicas(trainer, record)
        self._finding = finding = self._find(trainer, record)
        if finding is None:
            self._consecutive = self._persistent = 0
            self._report_headroom(trainer, record)
            return None
        return self._act(trainer, record, finding)

    def _find(self, trainer: pl.Trainer, record: StepHealth) -> Finding | None:
        """What, if anything, is non-finite on this step. Only values identical on every rank are used."""
        state_flagged = record.has(self._key()) and any(record.value(self._key()))
        buffer_ranks = tuple(r for r, v in enumerate(record.value(self._key("buffers")))
                             if v) if record.has(self._key("buffers")) else ()  # fmt: skip
        if record.healthy and not state_flagged:
            self._scaler_overflows = 0
            return self._buffer_finding(trainer, buffer_ranks) if buffer_ranks else None
        if record.loss_finite and record.loss_scale is not None and not record.grads_finite and not state_flagged:
            if record.grad_ranks:  # some ranks' only: every rank's scaler skips and lowers its scale alike
                _compat.scaler_found_inf(_compat.scaler_of(trainer), record.optimizer)
            return self._judge_scaler(record)  # inf/NaN gradients: the scaler skips the step itself
        state = inspect_state(trainer, record)
        if state.weight_ranks:
            return Finding("weight", state.weight_ranks, list(state.weight_names), hint_key="weight")
        if state.state_ranks:
            return Finding("optimizer_state", state.state_ranks, list(state.state_names), hint_key="optimizer_state")
        if not record.loss_finite:
            return Finding("loss", record.loss_nonfinite_ranks, hint_key="loss")
        if record.grads_finite and not record.grads_beyond_fp32:
            # A fast-path flag that the exact check cleared (FP32 overflow of finite values).
            return self._buffer_finding(trainer, buffer_ranks) if buffer_ranks else None
        return self._grad_finding(record)

    def _buffer_finding(self, trainer: pl.Trainer, ranks: tuple[int, ...]) -> Finding:
        """The forward passes wrote inf/NaN into buffers (a batch that overflows BatchNorm's variance): the step is
        skipped, which puts them back. The names are this rank's (one read, on this path only)."""
        constants = self.board(trainer).known_constants()
        written = self.board(trainer).buffers_written()
        names = [name for name, t, _ in written
                 if not bool(torch.isfinite(constants.without_constants(name, t)).all())]  # fmt: skip
        return Finding("buffer", ranks, names, hint_key="buffer")

    def _judge_scaler(self, record: StepHealth) -> Finding | None:
        """Routine GradScaler overflow is calibration, not divergence, unless it persists or the scale collapses."""
        scale = record.loss_scale or 0.0
        if scale > DEFAULT_LOSS_SCALE:  # a scaler started higher halves down to the default first: not counted
            return None
        self._scaler_overflows += 1
        if self._scaler_overflows <= self.max_scaler_overflows and scale >= self.min_loss_scale:
            return None
        finding = self._grad_finding(record)
        finding.hint_key = "scaler"
        finding.detail = f"; {self._scaler_overflows} consecutive GradScaler overflows, loss scale {scale:g}"
        return finding

    def _grad_finding(self, record: StepHealth) -> Finding:
        offending = record.offending_grads()
        if record.grads_finite:
            names = [name for name, _, _ in offending]
            return Finding("grad", tuple(range(record.world_size)), names, overflow=True, hint_key="overflow")
        names = [name for name, _, status in offending if status == "nonfinite"]
        if record.grad_ranks:  # only some ranks' gradients: every rank names what they found (a collective of all)
            (names,) = named_on_any_rank(names)
            return Finding("grad", record.grad_ranks, names, hint_key="grad")
        return Finding("grad", tuple(range(record.world_size)), names, hint_key="grad")

    # ---- the action -------------------------------------------------------------------------------------------
    def _act(self, trainer: pl.Trainer, record: StepHealth, finding: Finding) -> Verdict | None:
        """Count, diagnose, journal and signal a finding; raise where the action says so; ask for the skip."""
        self.nonfinite_events += 1
        self._consecutive += 1
        diagnosis = self._diagnose(trainer, record, finding)
        message = self._describe(trainer, record, finding)
        if diagnosis is not None:
            message = f"{message} {diagnosis.message}"
            if diagnosis.hint:  # whatever error ends the fit later carries it
                self.board(trainer).note_cause(diagnosis.message, diagnosis.hint)
        finding.message, finding.diagnosis = message, diagnosis
        finding.details = {
            "where": finding.kind,
            "ranks": list(finding.ranks),
            "parameters": finding.names[:MAX_NAMES],
            "overflow": finding.overflow,
            "grad_norm": record.total_norm,
            "loss_scale": record.loss_scale,
            "optimizer": record.optimizer_index,
        }
        faulted = self._faulted
        if faulted is not None:  # the fit summary counts such steps
            finding.details["faulted"] = f"{_step_code(trainer)} {faulted.brief}"
        replayed = diagnosis is not None and diagnosis.replayed
        # Manual optimization has no replay, nor has a plain loop: the batch itself says whether it brought the
        # inf/NaN (below). Without it, NaN rows in consecutive batches read as a state whose steps fail on clean
        # batches, and were rolled back.
        reads_the_batch = (not replayed and faulted is None and finding.kind in ("loss", "grad")
                           and (self._shown or not trainer.lightning_module.automatic_optimization))  # fmt: skip
        if diagnosis is not None:
            finding.data_fault = _bad_batch(diagnosis)
            finding.details.update(_batch_details(diagnosis) if finding.data_fault else {})
            if not finding.data_fault and diagnosis.verdict != "persistent" and self._window and not reads_the_batch:
                # The replay of the last micro-batch did not reproduce the fault: the earlier ones may hold its cause.
                message = self._blame_an_earlier_batch(trainer, finding, message)
            # The sentence is the event's message already: written once.
            finding.details["diagnosis"] = {k: v for k, v in diagnosis.to_dict().items() if k != "message"}
        elif finding.kind == "buffer":  # no replay: the outputs and gradients stay finite; the batch says why
            data, where = self._extreme_batch(trainer)
            # A decision (a data fault is never held against the state): every rank's batch counts, one all-reduce.
            (ranks,) = flags_by_rank([torch.tensor(float(bool(data)))], trainer.strategy.root_device)
            finding.data_fault = bool(ranks)
            finding.details.update(where)
            if data:
                message = finding.message = f"{message} The batch: {data}."
        if not replayed and faulted is not None and faulted.batch is not None and record.world_size == 1:
            # Not replayed (manual optimization): the step that raised was answered for its batch's bad values.
            data, where = _batch_words(faulted.batch, self._batch_idx, int(trainer.global_rank))
            finding.data_fault = bool(data)
            finding.details.update(where)
        elif reads_the_batch:
            # Every rank's words (off the hot path: a fault step): the decision and the journal are every rank's.
            found = [w for w in objects_by_rank(_batch_words(batch_stats(self._batch), self._batch_idx,
                                                             int(trainer.global_rank))) if w[0]]  # fmt: skip
            finding.data_fault = bool(found)
            if found:
                finding.details.update({**found[0][1], "data_ranks": [r for w in found for r in w[1]["data_ranks"]]})
                message = finding.message = _with_data_fault(message, found[0][0])
            elif self._window:  # the batches accumulated into this step before this one
                message = self._blame_an_earlier_batch(trainer, finding, message)
        kind = "data_fault" if finding.data_fault else "nonfinite"
        self._event(trainer, kind, message, rank=min(finding.ranks, default=0), **finding.details)
        self._raise_signals(trainer, record, finding, message)
        state_broken = finding.kind in ("weight", "optimizer_state")
        if self.action == "warn":
            self._warnings.warn(f"{finding.kind}:{finding.hint_key}", message + " (shown once)")
            return None
        if self.action == "raise" or (state_broken and not _state_recovery_in(trainer)):
            self._end_with(self._error(trainer, message, record, finding, diagnosis))
        return None if state_broken else Verdict(skip=f"non-finite {finding.kind}")

    def hear_step_batches(self, batches: list[Any], batch_idx: int) -> None:
        """The batches of the step about to be judged, as a plain loop hands them over (``Guard.step(loss,
        batch=...)``, where nothing is replayed): the last one is this step's batch, the earlier ones accumulated
        into it, all under the step's index (a plain loop numbers its steps, not its micro-batches). Flags only: read
        if the step turns out inf/NaN."""
        self._window = [(batch_idx, holds_bad_values(b)) for b in batches[:-1]]
        self._batch, self._batch_idx, self._shown = batch_copy(batches[-1]), batch_idx, True

    def _blame_an_earlier_batch(self, trainer: pl.Trainer, finding: Finding, message: str) -> str:
        """``message``, and the finding made a data fault, when an earlier micro-batch of the step holds bad values
        (:meth:`_earlier_bad_batch`); ``message`` as it is otherwise."""
        earlier = self._earlier_bad_batch(trainer)
        if not earlier:
            return message
        finding.data_fault = True
        finding.details.update(earlier)
        finding.message = _with_data_fault(message, earlier["data"])
        return finding.message

    def _earlier_bad_batch(self, trainer: pl.Trainer) -> dict[str, Any]:
        """A data fault's details when a micro-batch of this accumulation window before the last (the one the
        replay saw) holds inf/NaN or values beyond 1e15 on some rank; ``{}`` otherwise. Their gradients are in the
        step as much as the last one's: without this, NaN rows outside the last micro-batch read as a state whose
        steps fail on clean batches, and the run was backed off and rolled back. Every rank enters it."""
        flags = [(index, flag) for index, flag in self._window if flag is not None]
        device = trainer.strategy.root_device
        bad = torch.stack([flag.to(device) for _, flag in flags]).tolist() if flags else []  # the one host read
        (ranks,) = flags_by_rank([torch.tensor(float(any(bad)))], device)
        if not ranks:
            return {}
        first = next((index for (index, _), held in zip(flags, bad) if held), None)
        index = next(i for i in (objects_by_rank(first)[r] for r in ranks) if i is not None)
        return {"batch": index, "rows": [], "data_ranks": list(ranks),
                "data": f"batch {index} holds inf/NaN or values beyond 1e15 (a micro-batch accumulated into the "
                        "step before its last)"}  # fmt: skip

    @override
    def _after_step(self, trainer: pl.Trainer, record: StepHealth, action: StepAction) -> None:
        self._window, self._held, self._stepped, self._shown = [], None, True, False
        self._updated = self._updated or not action.skipped
        finding, self._finding = self._finding, None
        if finding is not None and self.action == "skip":
            self._account(trainer, record, action, finding)
        self._weigh_skips(trainer, record, action, data_fault=finding is not None and finding.data_fault)

    def _account(self, trainer: pl.Trainer, record: StepHealth, action: StepAction, finding: Finding) -> None:
        """Count and journal a skip of this detector's; stop after ``max_consecutive_skips``."""
        if action.skipped_by is self:
            self.skipped_steps += 1
            found = "data_fault" if finding.data_fault else "nonfinite"
            # The finding's own event (same step) holds the diagnosis; the skip refers to it.
            self._event(trainer, "skip", f"skipped optimizer step {record.step}: non-finite {finding.kind}"
                        + (" (a data fault)" if finding.data_fault else ""), where=finding.kind, finding=found,
                        ranks=list(finding.ranks), optimizer=record.optimizer_index)  # fmt: skip
        if self._consecutive >= self.max_consecutive_skips:
            message = (
                f"NonFiniteDetector: {self._consecutive} consecutive optimizer steps were non-finite, the last at step "
                f"{record.step}. Last finding: {finding.message}"
            )
            finding.hint_key = "consecutive"
            self._event(trainer, "abort", message, **finding.details)
            self._end_with(self._error(trainer, message, record, finding, finding.diagnosis))

    def _weigh_skips(self, trainer: pl.Trainer, record: StepHealth, action: StepAction, data_fault: bool) -> None:
        """The skip budget: a run whose recent steps were mostly skipped is not training (see ``max_skipped_share``).
        A step skipped for a data fault is not counted: bad batches say nothing about the state, and a lower rate or
        an earlier state cannot mend them (one missing value in a series poisons every window that holds it)."""
        self._skips = [*self._skips[-(self.skip_window - 1) :], action.skipped and not data_fault]
        skipped = sum(self._skips)
        if skipped <= self.max_skipped_share * self.skip_window:
            return
        self._skips = []
        message = (
            f"NonFiniteDetector: {skipped} of the last {self.skip_window} optimizer steps were skipped, the last at "
            f"step {record.step} ({action.skip_reason}): the run is not training."
        )
        if self.board(trainer).answers("nonfinite_persistent"):
            self._event(trainer, "skip_budget", f"{message} Answered as steps that keep failing (nonfinite_persistent).",
                        skipped=skipped, window=self.skip_window, optimizer=record.optimizer_index)  # fmt: skip
            self._signal(trainer, "nonfinite_persistent", message, record.optimizer_index)
            return
        board = self.board(trainer)
        cause = f" {board.cause[0]}" if board.cause is not None else ""  # "Diagnosis: the first non-finite ..."
        error = (
            f"{message[:-1]} on rank(s) {', '.join(map(str, range(record.world_size)))}, and no callback in the list "
            f"can restore the state or lower the learning rate: skipping each step was all that was tried.{cause} "
            f"HINT: {divergence_hint(board.present(), board.cause)}."
        )
        self._event(trainer, "abort", error, skipped=skipped, window=self.skip_window)
        raise DivergenceError(error, step=record.step, history=[{"step": record.step, "reason": "skip_budget",
                                                                 "skipped": skipped, "window": self.skip_window}])

    def _raise_signals(self, trainer: pl.Trainer, record: StepHealth, finding: Finding, message: str) -> None:
        index = record.optimizer_index
        self._signal(trainer, "nonfinite", message, index)
        # A batch that itself holds inf/NaN or absurd values is a data fault: skipped, never held against the state.
        self._persistent = 0 if finding.data_fault else self._persistent + 1
        if self._persistent == self.persist_after:
            batches = "on batches whose inf/NaN, if any, were not the cause (set to 0, the step failed all the same)" \
                if self._batch is not None else (
                "on batches it was not shown (Guard.step(loss) sees no batch: guard.step(loss, batch=batch) "
                "tells bad data apart)")  # fmt: skip
            persistent = f"{self._persistent} consecutive optimizer steps were non-finite {batches} ({message})"
            self._signal(trainer, "nonfinite_persistent", persistent, index)
        if finding.kind in ("weight", "optimizer_state"):
            self._signal(trainer, "nonfinite_state", message, index)
        if finding.hint_key == "scaler":
            self._signal(trainer, "scaler_collapse", message, index)
        self._recent = [s for s in self._recent if record.step - s < self.burst_window] + [record.step]
        if len(self._recent) >= self.burst_count:
            burst = f"{len(self._recent)} non-finite steps within {self.burst_window} steps ({message})"
            self._signal(trainer, "nonfinite_burst", burst, index)

    def _describe(self, trainer: pl.Trainer, record: StepHealth, finding: Finding) -> str:
        ranks = ", ".join(str(r) for r in finding.ranks)
        what = {
            "loss": "the loss was inf/NaN",
            "grad": "the gradients were finite but their norm lies beyond the FP32 range"
            if finding.overflow
            else "the gradients contained inf/NaN",
            "weight": "the weights contained inf/NaN",
            "buffer": "the forward pass wrote inf/NaN into buffers",
            "optimizer_state": "the optimizer state contained inf/NaN",
        }[finding.kind]
        names = ""
        if finding.names:
            more = len(finding.names) - MAX_NAMES
            names = f" in {', '.join(finding.names[:MAX_NAMES])}" + (f" (+{more} more)" if more > 0 else "")
        norm = f" (gradient norm {record.total_norm:.4g})" if finding.kind == "grad" else ""
        verb = {"skip": "The optimizer step was skipped.", "warn": "The optimizer step went ahead.", "raise": ""}
        done = "" if finding.kind in ("weight", "optimizer_state") else verb[self.action]
        faulted = self._faulted.describe(_step_code(trainer)) if self._faulted is not None else ""
        return (
            f"NonFiniteDetector: {what}{names}{norm} at step {record.step} (epoch {trainer.current_epoch}) on rank(s) "
            f"{ranks}{finding.detail}{faulted}. {done}".rstrip()
        )

    def _diagnose(self, trainer: pl.Trainer, record: StepHealth, finding: Finding) -> Diagnosis | None:
        """Replay the batch on every rank (the finding is identical on every rank, so all of them get here)."""
        if not self.diagnose or finding.kind not in ("loss", "grad"):
            return None
        with _buffers_as_the_step_read_them(self.board(trainer).buffers_written()):
            diagnosis = diagnose_step(trainer, trainer.lightning_module, self._kept, record.step, finding.ranks,
                                      updated=self._updated)  # fmt: skip
        self.last_diagnosis = diagnosis
        return diagnosis

    def _error(
        self,
        trainer: pl.Trainer,
        message: str,
        record: StepHealth,
        finding: Finding,
        diagnosis: Diagnosis | None = None,
    ) -> NonFiniteError:
        if diagnosis is not None and diagnosis.hint:
            hint = diagnosis.hint
        else:
            hint = detection_hint(finding.hint_key, self.board(trainer).present(),
                                  unrestorable_optimizer(trainer.optimizers))
        return NonFiniteError(
            f"{message} HINT: {hint}.",
            kind=finding.kind,
            step=record.step,
            ranks=finding.ranks,
            parameters=finding.names[:MAX_NAMES],
            overflow=finding.overflow,
            hint=hint,
            diagnosis=diagnosis,
        )

    # ---- headroom ---------------------------------------------------------------------------------------------
    def _report_headroom(self, trainer: pl.Trainer, record: StepHealth) -> None:
        reading = self._headroom.read(record) if self._headroom is not None else None
        if reading is None:
            return
        self.last_headroom = reading
        self._log(trainer, reading.metrics(), record.log_step)
        if reading.decades >= self.headroom_warn_decades:
            return
        near = (
            f"the step's largest magnitude is only {reading.decades:.1f} powers of ten (decades) below the "
            f"{'float64 limit 1.8e308' if reading.limit > FP32_MAX else 'FP32 limit 3.4e38'} at step {reading.step}: "
            f"{reading.describe(trainer.world_size > 1)}"
        )
        data, where = self._extreme_batch(trainer)
        if data:  # the values came in with the data: no learning rate made them
            message = (
                f"NonFiniteDetector: {data} (no normalised input holds such values: a data fault), and {near}. "
                "HINT: find that sample in the data pipeline (padding, a sentinel value, a unit error) and normalise "
                "or filter it; until then the suite skips or clips the steps it overflows (shown once)."
            )
        else:
            message = (
                f"NonFiniteDetector: {near}. The run is approaching overflow (warning below "
                f"{self.headroom_warn_decades:g} decades; shown once). HINT: "
                f"{detection_hint('headroom', self.board(trainer).present())}."
            )
        if not self._headroom_warned:
            self._headroom_warned = True
            self._event(trainer, "data_fault" if data else "headroom", message, rank=reading.rank or 0,
                        step=reading.step, decades=reading.decades, source=reading.source, module=reading.module,
                        magnitude=reading.magnitude, **where)  # fmt: skip
        if trainer.global_rank == 0:
            self._warnings.warn("headroom", message)

    def _extreme_batch(self, trainer: pl.Trainer) -> tuple[str, dict[str, Any]]:
        """This rank's batch, in words and as a data fault's details, when it holds values no normalised input has
        (``"batch 0 holds values up to 1e+30 in row 3"``); ``("", {})`` otherwise. Read only when the headroom warns."""
        if self._batch is None:
            return "", {}
        return _batch_words(batch_stats(self._batch), self._batch_idx, int(trainer.global_rank))

    # ---- counters and state -----------------------------------------------------------------------------------
    @override
    def _counters(self) -> dict[str, float]:
        return {"overflow/skipped_steps": self.skipped_steps, "overflow/nonfinite_events": self.nonfinite_events}

    @override
    def state_dict(self) -> dict[str, Any]:
        return versioned({
            "skipped_steps": self.skipped_steps,
            "nonfinite_events": self.nonfinite_events,
            "consecutive": self._consecutive,
            "persistent": self._persistent,
            "scaler_overflows": self._scaler_overflows,
            "recent": list(self._recent),
            "skips": list(self._skips),
        })  # fmt: skip

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = StateReader("NonFiniteDetector", state_dict, since={"skips": 2})
        self.skipped_steps = state.get("skipped_steps", int)
        self.nonfinite_events = state.get("nonfinite_events", int)
        self._consecutive = state.get("consecutive", int)
        self._persistent = state.get("persistent", int)
        self._scaler_overflows = state.get("scaler_overflows", int)
        self._recent = state.get("recent", lambda v: [int(s) for s in v])
        self._skips = state.get("skips", lambda v: [bool(s) for s in v], old=[])  # 0.2 had no skip budget
        state.finish()

    @override
    def _after_restore(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        # The state that produced the streak is gone; count afresh from the restored one.
        self._consecutive = self._persistent = 0
        self._scaler_overflows = 0
        self._skips = []

    @override
    def _detach(self, state: dict[str, Any]) -> None:
        state["_kept"] = state["_faulted"] = state["_batch"] = None  # a batch and the random state belong to one step
        state["_window"], state["_held"] = [], None  # the micro-batches of one step: a checkpoint holds no batch
        state["_step_guard"] = None  # the live module's training_step: a copy guards no module
        state.pop("_keys", None)  # they name this instance (a copy is another)


def guarded_training_step(module: torch.nn.Module, on_faulted: Any, on_batch: Any = None) -> types.MethodType:
    """The module's ``training_step`` for a fit: its own, with a step that a bad value broke (it raised, or returned a
    loss cut from the graph) answered as an inf/NaN loss (:mod:`lightning_overflow.faulted_steps`). On the run's own
    steps (not a trial's or a replay's), ``on_faulted`` hears of each one and says whether to answer it, and
    ``on_batch`` hears of each batch as ``training_step`` receives it (after the module's own batch hooks).

    A method bound to the module, so that it reads as the module's own wherever Lightning looks: ``__wrapped__`` is
    what the method was (Lightning unwraps once to read its code and its arguments, ``batch_idx`` and
    ``dataloader_iter``), ``__signature__`` its signature, self included, for a wrapper of this method (a fault
    injector). A copy of the module (``copy.deepcopy``, an EMA's) runs its own class's ``training_step``, and a
    pickled one gets that back (a bound method pickles by name).
    """
    own = module.training_step  # a wrapper set on the instance before, or the class's method
    inner = inspect.unwrap(own)  # the module's method below every wrapper
    function = getattr(inner, "__func__", inner)
    live = module

    def training_step(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self is not live:  # a copy of the module, taken during the fit
            return type(self).training_step(self, *args, **kwargs)
        if on_batch is not None and side_run() is None:
            on_batch(args[0] if args else kwargs.get("batch"))
        if not getattr(self, "automatic_optimization", True):
            return answered_manually(lambda: own(*args, **kwargs), self, (args, kwargs), _answers)
        return answered_call(lambda: own(*args, **kwargs), self, (args, kwargs), _answers)

    def _answers(faulted: FaultedStep) -> bool:
        return side_run() is not None or bool(on_faulted(faulted))

    functools.update_wrapper(training_step, function)
    training_step.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
    return types.MethodType(training_step, module)


def answered_call(call: Callable[[], Any], module: torch.nn.Module, inputs: Any,
                  answers: Callable[[FaultedStep], bool]) -> Any:  # fmt: skip
    """``call()`` (a ``training_step``, a plain loop's ``loss_fn``), with a step that a bad value broke (it raised,
    or returned a loss cut from the graph) answered by the stand-in loss of :mod:`lightning_overflow.faulted_steps`
    where ``answers`` agrees; otherwise its error stands. A healthy step costs one attribute read."""
    try:
        output = call()
    except Exception as error:  # answer_error passes on what no bad value causes
        answer = answer_error(error, module, inputs)
        if answer is None:
            raise
        if answer[1].batch is not None and raises_without_bad_values(call, module, inputs):
            raise  # the batch's bad values did not break it: the error is the module's own
        if not answers(answer[1]):
            raise
        return answer[0]
    loss = loss_of(output)
    if loss is not None and not loss.requires_grad:
        answer = answer_detached(loss, module, inputs)
        if answer is not None and answers(answer[1]):
            return {**output, "loss": answer[0]} if isinstance(output, dict) else answer[0]
    return output


def answered_manually(call: Callable[[], Any], module: Any, inputs: Any,
                      answers: Callable[[FaultedStep], bool]) -> Any:  # fmt: skip
    """``call()``, a ``training_step`` under manual optimization, where the optimizers step inside it: a step that a
    bad value broke (it raised) is answered by a step of each optimizer on the stand-in loss, through
    ``manual_backward``, so that the suite sees an inf/NaN loss and NaN gradients on each and skips them as any (a
    step the ``training_step`` took before it raised stands). The gradients are cleared after each. Its step is not
    run again to test the batch (:func:`answered_call` does): a rerun would step the optimizers. Only the optimizers
    that had not stepped yet are answered: a second step of one (a GAN's generator, stepped before the discriminator's
    loss raised) counted one more optimizer step and split the batch in the summary."""
    listed = module.optimizers()
    optimizers = listed if isinstance(listed, list) else [listed]
    stepped: set[int] = set()
    hooks = [getattr(o, "optimizer", o).register_step_pre_hook(lambda *_, i=i: stepped.add(i))
             for i, o in enumerate(optimizers)]  # fmt: skip
    try:
        return call()
    except Exception as error:  # answer_error passes on what no bad value causes
        answer = answer_error(error, module, inputs)
        if answer is None or not answers(answer[1]):
            raise
    finally:
        for hook in hooks:
            hook.remove()
    for count, optimizer in enumerate(o for i, o in enumerate(optimizers) if i not in stepped):
        module.manual_backward(answer[0] if count == 0 else stand_in_loss(module))
        optimizer.step()
        optimizer.zero_grad()
    return None


def _step_code(trainer: pl.Trainer) -> str:
    """What a message calls the code that computes the loss: ``training_step``, or a plain loop's ``loss_fn``."""
    return getattr(trainer.lightning_module, "replay_step_code", "") or "training_step"


def _note(error: BaseException, text: str) -> None:
    """Add ``text`` under the error's traceback (Python 3.11+; on 3.10 the journal and the fit summary say it)."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(text)


def _state_recovery_in(trainer: pl.Trainer) -> bool:
    """Whether a callback in the list restores weights and optimizer state (Rollback)."""
    return any(getattr(cb, "restores_state", False) for cb in trainer.callbacks)  # type: ignore[attr-defined]


def _replicas_hint(trainer: pl.Trainer) -> str:
    if _state_recovery_in(trainer):
        return "Rollback restores every rank to the same verified snapshot."
    unrestorable = unrestorable_optimizer(trainer.optimizers)
    if unrestorable is not None:
        return f"HINT: {restore_hint(unrestorable)}."
    return "HINT: add Rollback to restore every rank to the same verified snapshot."


def _warn_about_early_stopping(trainer: pl.Trainer, monitors: list[str], warnings: WarningCache) -> list[str]:
    """A skipped step's loss is NaN. Logged as a tensor with ``self.log(..., on_epoch=True)`` from a hook of the batch,
    it is taken out of the epoch's mean again, and a torchmetrics ``Metric`` the module holds gets its state back
    (:func:`~lightning_overflow.skip.skip_step`; under manual optimization, where a batch steps several optimizers,
    the sums and states the batch made inf/NaN go back at its end); logged per step only, or kept in state of the
    user's own (a value computed at the epoch's end), it makes the value checked NaN
    (:func:`~lightning_overflow.health.skipped_loss_route`), and ``EarlyStopping(check_finite=True)`` (its default)
    then ends the rescued run. Decided from where Lightning says the
    monitored metric was logged, not from its name: a validation metric (``val_loss``, neuralforecast's
    ``ptl/val_loss``) never holds a skipped training step's NaN. Returns the monitors no training hook logged so far."""
    waiting = []
    for monitor in monitors:
        if not _compat.logged_in_training(trainer, monitor):
            waiting.append(monitor)
            continue
        how = skipped_loss_route(trainer, monitor)
        if how is None:
            continue
        warnings.warn(
            "early_stopping",
            f"NonFiniteDetector: EarlyStopping(monitor={monitor!r}, check_finite=True) stops the fit when "
            f"{monitor!r} is not finite, and {monitor!r} is logged from a training hook {how}. A step this detector "
            "skips has an inf/NaN loss; kept there, the value EarlyStopping checks is inf/NaN and the run is stopped "
            "although it was rescued. Log the loss tensor itself with self.log(..., on_epoch=True), or a torchmetrics "
            "Metric held by the module (a skipped step's value is left out of either), log only finite losses, "
            "monitor a validation metric, or pass EarlyStopping(check_finite=False).",
        )
    return waiting


def _warn_about_spike_detection(trainer: pl.Trainer, warnings: WarningCache) -> None:
    """Lightning's ``SpikeDetection`` raises on the first step whose loss is NaN, which is a step this detector
    skips: the run it rescues is stopped anyway."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if type(callback).__name__ != "SpikeDetection":
            continue
        warnings.warn(
            "spike_detection",
            "NonFiniteDetector: Lightning's SpikeDetection is in the callbacks. It raises TrainingSpikeException at "
            "the first step whose loss is NaN (or spikes), the very step this detector skips: a run the suite would "
            "rescue is stopped there. Remove SpikeDetection: LossSpikeDetector finds the spikes, and the suite skips "
            "the non-finite steps and tries the remedies of the rest.",
        )


@contextmanager
def _buffers_as_the_step_read_them(written: list[tuple[str, torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """The buffers the step's forward wrote, as the window found them, for the replays of the step: a forward that
    wrote its batch's NaN into a buffer (DINO's centre, a memory bank of negatives) would make the replay with the
    batch's bad values set to 0 come out NaN all the same, and blame the model for the data. Put back after."""
    now = [(live, live.detach().clone()) for _, live, _ in written]
    with torch.no_grad():
        for _, live, saved in written:
            live.copy_(saved)
    try:
        yield
    finally:
        with torch.no_grad():
            for live, value in now:
                live.copy_(value)


def _warn_about_vanishing_eps(trainer: pl.Trainer, warnings: WarningCache) -> None:
    """An optimizer whose ``eps`` rounds to 0 in its parameters' dtype (Adam's 1e-8 in float16, under
    ``precision="16-true"``) divides by 0 wherever a second moment is 0: every update writes inf/NaN, at any learning
    rate. The backoffs and rollbacks that follow cannot help, and their hint (a lower rate) would mislead."""
    for index, optimizer in enumerate(trainer.optimizers):
        for group in optimizer.param_groups:
            eps = group.get("eps")
            dtypes = {p.dtype for p in group["params"] if p.is_floating_point()}
            vanishing = [d for d in dtypes if d.itemsize < 4 and isinstance(eps, float) and 0 < eps
                         and float(torch.tensor(eps, dtype=d)) == 0.0]  # fmt: skip
            if vanishing:
                warnings.warn(
                    "eps",
                    f"NonFiniteDetector: optimizer {index} ({type(optimizer).__name__}) has eps={eps:g}, which is 0 "
                    f"in {str(vanishing[0]).replace('torch.', '')}, its parameters' dtype: its update divides by the "
                    "root of a second moment plus eps, inf/NaN wherever that moment is 0, at any learning rate. Train "
                    "in precision='bf16-true' or '16-mixed' (float32 weights), or pass a larger eps (1e-4).",
                )
                return


def _warn_about_anomaly_detection(warnings: WarningCache) -> None:
    """``Trainer(detect_anomaly=True)`` (torch's anomaly mode, on while the fit trains) raises in the backward pass of
    the first step that computes inf/NaN, before this detector sees that step."""
    if not torch.is_anomaly_enabled():
        return
    warnings.warn(
        "detect_anomaly",
        "NonFiniteDetector: Trainer(detect_anomaly=True) is on. torch's anomaly mode raises RuntimeError in the "
        "backward pass of the first step that computes inf/NaN, before this detector sees the step: a step it would "
        "skip ends the fit instead. Turn it off to let the suite skip the step; its replay names the module and the "
        "op as the anomaly mode would.",
    )


def _with_data_fault(message: str, words: str) -> str:
    """``message``, then the batch's words as a sentence of their own (``"... Batch 9 holds NaN in row 3: a data
    fault."``)."""
    return f"{message} {words[:1].upper()}{words[1:]}: a data fault."


def _batch_words(stats: BatchStats, batch_idx: int | None, rank: int) -> tuple[str, dict[str, Any]]:
    """A batch's bad values in words (``"batch 0 holds values up to 1e+30 in row 3"``) and as a data fault's
    details; ``("", {})`` when it holds none."""
    data = Replay(rank, replayed=False, batch_idx=batch_idx, batch_magnitude=stats.magnitude,
                  batch_nonfinite=stats.nan + stats.inf, batch_nan=stats.nan, batch_rows=stats.rows).describe_batch()
    if not data:
        return "", {}
    return data, {"batch": batch_idx, "rows": list(stats.rows), "data": data, "data_ranks": [rank]}


def _bad_batch(diagnosis: Diagnosis) -> bool:
    """Whether a rank's batch itself holds inf/NaN or values no normalised input has, and they broke the step."""
    return any(r.blames_batch for r in diagnosis.replays)


def _batch_details(diagnosis: Diagnosis) -> dict[str, Any]:
    """Where the bad data is: the first bad batch's index in its epoch, its rows, and what they hold, per rank."""
    bad = [r for r in diagnosis.replays if r.blames_batch]
    first = bad[0]
    return {"batch": first.batch_idx, "rows": list(first.batch_rows), "data": first.describe_batch(),
            "data_ranks": [r.rank for r in bad]}  # fmt: skip
