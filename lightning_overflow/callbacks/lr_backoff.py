"""LRBackoff: multiply the learning rate by ``factor`` on divergence, make it stick, grow it back when stable."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import pytorch_lightning as pl
from typing_extensions import override

from lightning_overflow import _compat
from lightning_overflow._validation import check_choices, check_float, check_int, check_type, refuse_removed
from lightning_overflow.callback_state import StateReader, versioned
from lightning_overflow.candidate import RateHold
from lightning_overflow.callbacks._base import BACKOFF, SuiteCallback
from lightning_overflow.diagnosis.hints import divergence_hint
from lightning_overflow.events import log
from lightning_overflow.exceptions import DivergenceError
from lightning_overflow.fit_summary import opened_because
from lightning_overflow.health import StepHealth
from lightning_overflow.numerics.lr_scaling import HELD, group_rates, scale_group, scale_lr, schedules
from lightning_overflow.policy import (
    DEFAULT_BACKOFF_TRIGGERS,
    REGROWTH,
    REMOVED_SETTINGS,
    SIGNAL_KINDS,
    SUSPICION_SIGNALS,
    UPDATE_BOUND,
    WINDOW_GROWTH,
    Signal,
    at_floor,
)
from lightning_overflow.snapshot_store import Snapshot
from lightning_overflow.trial import DEFAULT_TRIAL, TrialConfig
from lightning_overflow.trials import TrialOutcome

__all__ = ["DEFAULT_TRIGGERS", "LRBackoff"]


DEFAULT_TRIGGERS = DEFAULT_BACKOFF_TRIGGERS
"""The signals that mean divergence (see the ladder in :mod:`lightning_overflow.policy`): a lone non-finite step,
a burst of them on bad data, or a single spike never costs the LR."""


class LRBackoff(SuiteCallback):
    """Multiply the learning rate by ``factor`` when the run diverges; grow it back after a stable stretch.

    An intervention. What it changes: the learning rate of every param group of the optimizer concerned, together
    with every reference the LR schedulers recompute it from (the groups' ``initial_lr`` / ``max_lr`` / ``min_lr``;
    the schedulers' ``base_lrs``, ``max_lrs``, ``eta_min``, ``min_lrs``, walking ``SequentialLR`` and
    ``ChainedScheduler`` children; see :func:`~lightning_overflow.numerics.lr_scaling.scale_lr`). Halving only
    ``param_group["lr"]`` would be undone on the next step by ``LambdaLR``, ``OneCycleLR``, ``CyclicLR``,
    ``CosineAnnealingWarmRestarts``, cosine past ``T_max`` and ``SequentialLR`` milestones; scaled this way the
    schedule continues at exactly ``scale`` times the one configured, whatever torch scheduler runs it. All of it
    lives in the optimizer and scheduler state, so it is in every checkpoint; a resumed run continues with the same
    scale and nothing is applied twice. Only the schedulers Lightning knows (``configure_optimizers``) are scaled.

    When it acts: at the end of each training batch (``on_train_batch_end``, after schedulers held for a skipped step
    are put back, before checkpoint callbacks save), on the detectors' signals of that batch whose kind is in
    ``triggers``. Every rank sees the same signals, so every rank backs off at the same step.

    - **Backoff**: ``scale *= factor``. Further triggers within ``cooldown`` optimizer steps of a backoff belong to
      the same burst and are ignored.
    - **Floor**: the scale never goes below ``min_scale``; a trigger once the scale sits on the floor raises
      :class:`DivergenceError` with the history of every backoff.
    - **Regrowth**: after ``regrow_after`` optimizer steps without a trigger, ``scale /= factor`` (at most 1: never
      above the configured schedule), as ``GradScaler`` grows its loss scale. A backoff within the growth window
      after a regrowth means the regrowth came too early: the window is multiplied by ``WINDOW_GROWTH`` (2; metaseq's
      adaptive loss-scale window), so the run does not oscillate between two learning rates.
    - **Undo**: once ``AutoClip`` bounds every update (``update_bound``) and a kept remedy returned to its snapshot,
      the backoffs made since that snapshot are taken back: they answered gradients out of scale, not the rate.

    Steps are ``global_step`` steps: under manual optimization every optimizer's step counts.

    Args:
        factor: the multiplier applied on each backoff, in (0, 1) (default 0.5).
        triggers: the signal kinds that mean divergence (default :data:`DEFAULT_TRIGGERS`:
            ``nonfinite_persistent``, ``nonfinite_state``, ``scaler_collapse``, ``loss_divergence``, ``loss_trend``,
            ``weight_growth``: evidence that the training state degrades). A non-finite step that
            ``NonFiniteDetector`` skipped, a burst of them on bad data and a single spike are not; add
            ``"nonfinite_burst"`` or ``"loss_spike"`` to back off on those too.
        cooldown: optimizer steps after a backoff during which further triggers are part of the same burst
            (default 10: a burst of non-finite steps or a spike lasting a few steps costs one backoff, while a
            divergence that goes on after it gets the next one soon).
        min_scale: the smallest scale, in (0, 1] (default 1e-3, about ten halvings).
        regrow_after: optimizer steps without a trigger before the scale grows back by ``1 / factor`` (default
            1000; ``None`` never regrows).

    Attributes:
        scales: the current LR multiplier of each optimizer (1.0 = as configured).
        history: one dict per backoff, regrowth and undo (``step``, ``action``, ``optimizer``, ``reason``,
            ``kinds``, ``scale``), oldest first.

    Raises:
        DivergenceError: a trigger arrived while the scale was already at its floor.

    Logged keys (``overflow/lr_scale_opt<i>`` for each optimizer when there are several):

    =====================  ================================================
    key                    meaning
    =====================  ================================================
    ``overflow/lr_scale``  current LR multiplier (1.0 = as configured)
    =====================  ================================================

    ``LearningRateMonitor`` shows the backed-off learning rate. Each backoff, regrowth and undo is one
    ``"backoff"`` / ``"regrowth"`` / ``"undo"`` line in the journal.

    A rate your own code writes into the param groups (a warm-up in ``optimizer_step``, as Lightning's docs show one,
    or in a hook) is held too: while the scale is below 1, a rate that changed since the suite or a scheduler last
    set it is multiplied by the scale before the optimizer reads it, and the first such rate of a fit is told once
    (``"lr_rewritten"``). What the suite left, and the scale, are an entry of each param group
    (``"lightning_overflow_held"``: ``[rate, scale]``), so they travel with the optimizer state: into checkpoints
    (a resumed run holds the first rate it writes), snapshots and a trial's candidates (each is held at its own
    scale). A rate held as a tensor is left as your code writes it.

    Example:
        >>> import pytorch_lightning as pl
        >>> from lightning_overflow import LossSpikeDetector, NonFiniteDetector
        >>> callbacks = [NonFiniteDetector(), LossSpikeDetector(), LRBackoff(factor=0.5)]
        >>> trainer = pl.Trainer(callbacks=callbacks, logger=False)
    """

    stage = BACKOFF
    one_per_trainer = True  # acts on the whole run: a second one would act twice (refused at setup)
    window_growth = WINDOW_GROWTH

    def __init__(
        self,
        factor: float = 0.5,
        triggers: Sequence[str] = DEFAULT_TRIGGERS,
        cooldown: int = 10,
        min_scale: float = 1e-3,
        regrow_after: int | None = 1000,
        trial: TrialConfig | None = DEFAULT_TRIAL,
        **removed: Any,
    ) -> None:
        refuse_removed(LRBackoff, removed, REMOVED_SETTINGS["LRBackoff"])
        self.factor = check_float("factor", factor, low=0.0, high=1.0, low_open=True, high_open=True)
        self.triggers = check_choices("triggers", triggers, SIGNAL_KINDS, what="signal kinds")
        self.cooldown = check_int("cooldown", cooldown, minimum=0)
        self.min_scale = check_float("min_scale", min_scale, low=0.0, high=1.0, low_open=True)
        self.regrow_after = check_int("regrow_after", regrow_after, minimum=1, optional=True)
        self.trial = check_type("trial", trial, TrialConfig, "a TrialConfig", optional=True)
        self._reset()

    def _reset(self) -> None:
        self._rewrites_told = False
        self.scales: list[float] = []
        self._cooldown_until: list[int] = []
        self._stable_since: list[int] = []
        self._windows: list[int] = []
        self._last_regrowth: list[int] = []
        self.history: list[dict[str, Any]] = []
        self._swa_lrs: dict[int, Any] = {}  # StochasticWeightAveraging's swa_lrs as given, by callback id
        self._first_step = 0  # the step the fit started (or resumed) at
        self._written: dict[int, float] = {}  # by group of optimizer 0: the rate its code last wrote, before the scale

    @property
    def state_key(self) -> str:
        try:
            return self._state_key  # built once: Lightning reads it often, its arguments never change
        except AttributeError:
            # per_optimizer=True: the key of earlier releases, whose backoff could act on every optimizer together
            self._state_key: str = self._generate_state_key(factor=self.factor, per_optimizer=True)
            return self._state_key

    # ---- wiring -----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":  # a new fit starts at the configured LR; a resumed one loads its state right after this
            self._reset()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After a resume's optimizer state is loaded, before the board starts (its first snapshot copies the groups):
        # every group holds the scale this callback holds (a new fit, a checkpoint of an earlier release, an optimizer
        # state loaded by hand or beside another LRBackoff's state carry none, or another). Not while a resumed trial
        # runs: the live state is then a candidate, whose entries came with it.
        self._first_step = int(trainer.global_step)
        self._track(len(trainer.optimizers), self._first_step)
        if not self.board(trainer).trials.active:
            for index, optimizer in enumerate(trainer.optimizers):
                if any((group.get(HELD) or (None, None))[1] != self.scales[index] for group in optimizer.param_groups):
                    _hold(optimizer, self.scales[index])
        super().on_train_start(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``StochasticWeightAveraging`` sets the rates from its ``swa_lrs``, and ``BackboneFinetuning`` the backbone's
        from its memory, as their epochs begin, after every callback's epoch end: they follow the scale the run holds
        (not a trial's, which is the candidate's alone)."""
        if self.scales and (self._swa_lrs or self.scales[0] != 1.0):
            _compat.scale_swa_lrs(trainer, self.scales[0], self._swa_lrs)
        if self.history and trainer.optimizers:
            _compat.follow_backbone_rates(trainer, trainer.optimizers[0])

    @override
    def _after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        step = int(trainer.global_step)
        self._track(len(trainer.optimizers), step)
        signals = self.board(trainer).signals
        if not signals and (self.regrow_after is None or all(scale >= 1.0 for scale in self.scales)):
            return  # nothing fired, and no learning rate below its schedule to grow back
        fired = self._fired(signals, len(self.scales))
        due: dict[int, list[Signal]] = {}
        for index, signals in fired.items():
            self._stable_since[index] = step  # not a stable step, even inside the cooldown
            if min(s.step for s in signals) >= self._cooldown_until[index]:
                due[index] = signals
        if due:
            self._back_off(trainer, due)
        if self.board(trainer).trials.active:
            return  # the learning rate under trial stays as it is until the verdict
        for index in range(len(self.scales)):
            if index in fired or not self._regrowth_due(index, step):
                continue
            trials = self.board(trainer).trials
            if trials.runs:  # measured, not blind: a trial of the higher rate against the rate that held
                self._stable_since[index] = step
                trials.open_regrowth(trainer, self.board(trainer))
            else:
                self._regrow(trainer, index, step)

    def _fired(self, signals: Sequence[Signal], n_optimizers: int) -> dict[int, list[Signal]]:
        """The trigger signals of this batch, by the optimizer they concern: each optimizer backs off on its own
        signals (a GAN's discriminator diverging leaves the generator's rate alone). A state found inf/NaN before the
        fit's first update is none of the rate's doing (an initialisation, the checkpoint it resumed from)."""
        relevant = [s for s in signals if s.kind in self.triggers and s.optimizer_index < n_optimizers
                    and not (s.kind == "nonfinite_state" and s.step <= self._first_step)]  # fmt: skip
        fired: dict[int, list[Signal]] = {}
        for signal in relevant:
            fired.setdefault(signal.optimizer_index, []).append(signal)
        return fired

    # ---- backoff ----------------------------------------------------------------------------------------------
    def _back_off(self, trainer: pl.Trainer, due: dict[int, list[Signal]]) -> None:
        # A suspicion at the floor is left alone: only what is certain may stop a run (a suspicion that is answered
        # at once, where no trial can run, has no verdict to stop it on).
        floored = {index for index in due if at_floor(self.scales[index], self.min_scale)}
        due = {index: signals for index, signals in due.items()
               if index not in floored or any(s.kind not in SUSPICION_SIGNALS for s in signals)}  # fmt: skip
        # Check every floor first: either every optimizer concerned backs off or the run stops, never half of it.
        for index, signals in due.items():
            if index in floored:
                raise self._diverged(trainer, index, signals)
        for index, signals in due.items():
            old = self.scales[index]
            first = min(signals, key=lambda s: s.step)
            new = max(old * self.factor, self.min_scale)
            self._apply(trainer, index, new / old, new)
            self.scales[index] = new
            self._cooldown_until[index] = first.step + self.cooldown
            last_regrowth = self._last_regrowth[index]
            if last_regrowth >= 0 and first.step - last_regrowth <= self._windows[index]:
                self._windows[index] = math.ceil(self._windows[index] * self.window_growth)
            entry = self._remember("backoff", first.step, index, _kinds(signals), first.reason, new)
            message = (
                f"LRBackoff: {entry['kinds']} at step {first.step}: the learning rate of optimizer {index} is now "
                f"{new:.4g} x its schedule (was {old:.4g} x; group LRs {_shown_lrs(trainer, index)}). "
                f"Cause: {first.reason}"
            )
            self._event(
                trainer, "backoff", message, step=first.step, **_details(entry), previous_scale=old,
                lrs=_lrs(trainer, index), floor=self.min_scale,
            )
            if trainer.global_rank == 0:
                log.info(message)

    # ---- undo -------------------------------------------------------------------------------------------------
    def _take_back(self, trainer: pl.Trainer, index: int, scale: float, bound: Signal) -> None:
        """Return to the scale of the snapshot just restored: every update is bounded now (``update_bound``), and the
        backoffs made since answered gradients out of scale, not the rate."""
        old = self.scales[index]
        self.scales[index] = scale
        message = (
            f"LRBackoff: AutoClip bounds every update of optimizer {index} from step {bound.step}: the backoffs since "
            f"the snapshot just restored are taken back, and its learning rate is {scale:.4g} x its schedule again "
            f"(was {old:.4g} x; group LRs {_shown_lrs(trainer, index)})."
        )
        self._journal_undo(trainer, index, bound, old, message)

    def _journal_undo(
        self, trainer: pl.Trainer, index: int, signal: Signal, old: float, message: str, **details: Any
    ) -> None:
        """Remember, journal and log backoffs taken back (``undo``) on ``signal``; the new scale is in place."""
        entry = self._remember("undo", signal.step, index, signal.kind, signal.reason, self.scales[index])
        self._event(trainer, "undo", message, step=signal.step, **_details(entry), previous_scale=old,
                    lrs=_lrs(trainer, index), floor=self.min_scale, **details)  # fmt: skip
        if trainer.global_rank == 0:
            log.info(message)

    def _diverged(self, trainer: pl.Trainer, index: int, signals: list[Signal]) -> DivergenceError:
        first = min(signals, key=lambda s: s.step)
        entry = self._remember("abort", first.step, index, _kinds(signals), first.reason, self.scales[index])
        backoffs = [h for h in self.history if h["action"] == "backoff"]
        done = "; ".join(f"step {h['step']} ({h['kinds']}) -> {h['scale']:.4g}" for h in backoffs) or "none"
        board = self.board(trainer)
        message = (
            f"LRBackoff: {entry['kinds']} at step {first.step} on rank {trainer.global_rank} (every rank stops "
            f"together) while the learning rate of optimizer {index} was already at its floor "
            f"({self.scales[index]:.4g} x its schedule; min_scale={self.min_scale:g}). Backoffs so far: {done}. "
            f"Cause: {first.reason} HINT: {divergence_hint(board.present(), board.cause)}."
        )
        self._event(trainer, "abort", message, step=first.step, **_details(entry))
        return DivergenceError(message, step=first.step, history=self.history)

    # ---- regrowth ---------------------------------------------------------------------------------------------
    def _regrowth_due(self, index: int, step: int) -> bool:
        if self.regrow_after is None or self.scales[index] >= 1.0:
            return False
        return step - self._stable_since[index] >= self._windows[index]

    def _regrow(self, trainer: pl.Trainer, index: int, step: int) -> None:
        old = self.scales[index]
        new = min(1.0, old / self.factor)
        self._apply(trainer, index, new / old, new)
        self.scales[index] = new
        self._stable_since[index] = step
        self._last_regrowth[index] = step
        reason = f"{self._windows[index]} steps without divergence"
        entry = self._remember("regrowth", step, index, "", reason, new)
        message = (
            f"LRBackoff: {self._windows[index]} stable steps up to step {step}: the learning rate of optimizer "
            f"{index} grows back to {new:.4g} x its schedule (was {old:.4g} x; group LRs {_shown_lrs(trainer, index)})."
        )
        self._event(
            trainer, "regrowth", message, step=step, **_details(entry), previous_scale=old, lrs=_lrs(trainer, index)
        )

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _track(self, n_optimizers: int, step: int) -> None:
        """Bookkeeping for every optimizer of the run (the count is known once optimizers exist)."""
        while len(self.scales) < n_optimizers:
            self.scales.append(1.0)
            self._cooldown_until.append(-1)
            self._stable_since.append(step)
            self._windows.append(self.regrow_after or 0)
            self._last_regrowth.append(-1)

    def _apply(
        self, trainer: pl.Trainer, index: int, ratio: float, scale: float, restored: float | None = None
    ) -> None:
        """Multiply optimizer ``index``'s rates (and its schedule) by ``ratio``; the state then holds ``scale``. In the
        live state, a rate the module wrote since the step (a warm-up written after ``optimizer.step``) gets the scale
        it was written under first: ``ratio`` moves a held rate, not a raw one; so does one in a state just
        ``restored`` from a snapshot taken at that scale (:meth:`_settle_restored`)."""
        if restored is None:
            self._settle(trainer, index)
        else:
            self._settle_restored(trainer, index, restored)
        if ratio != 1.0:
            scale_lr(trainer.optimizers[index], ratio, _schedulers(trainer, index))
        _hold(trainer.optimizers[index], scale)

    # ---- rates written by the module's own code -----------------------------------------------------------------
    @override
    def _contribute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: StepHealth) -> None:
        """Before the optimizer reads its rates (this stage runs ahead of the update): a rate that changed since the
        suite or a scheduler last set it was written by the module's own code (a warm-up in ``optimizer_step``, as
        Lightning's docs write one, or a loop's own schedule), which knows nothing of the backoff: the scale the state
        holds is applied to it. The entry that says which rate the suite left, and at which scale, lives in the param
        group (:data:`HELD`): it goes wherever the state goes (a snapshot, a trial's candidate, a checkpoint), so the
        live state is always held at its own scale, from the first step after a resume or a trial."""
        written = self._settle(trainer, record.optimizer_index)
        if written and not self._rewrites_told:
            self._rewrites_told = True
            groups, rates, scale = [g for g, _, _ in written], [r for _, r, _ in written], written[0][2]
            self._event(
                trainer, "lr_rewritten",
                f"LRBackoff: at step {record.step} the learning rate of optimizer {record.optimizer_index} (group(s) "
                f"{', '.join(map(str, groups))}) was set to {_numbers(rates)} by code outside its schedulers (your own "
                f"warm-up or schedule, written into the param groups): the backoff holds, so every rate written this "
                f"way is multiplied by {scale:.4g} (now {_numbers([r * scale for r in rates])}). To have the suite "
                "scale your schedule without this, set the rate through an LR scheduler.",
                optimizer=record.optimizer_index, groups=groups, written=rates, scale=scale,
            )  # fmt: skip

    def _candidate_rates(self, trainer: pl.Trainer) -> RateHold:
        """For a trial's candidates on this batch (optimizer 0: a trial compares one): the rate of each param group
        as the loop's code last wrote it, before any scale (a litgpt-style loop writes its schedule before each
        step; ``None`` where a scheduler sets the rate, or no code wrote one), which each candidate takes as its own,
        and what holds the rates written at the candidate's own scale (its param groups carry it) once it is swapped
        in, as :meth:`_contribute` holds the loop's."""
        optimizer = trainer.optimizers[0]
        scheduled = self._set_by_schedulers(trainer, 0)
        written: list[float | None] = []
        for g, group in enumerate(optimizer.param_groups):
            held, now = group.get(HELD), _as_number(group.get("lr"))
            if held is None or now is None or _set_by_one(scheduled, g, now):
                written.append(None)  # a scheduler's: the candidate's own schedulers set its rate
            elif held[1] == 1.0 or now != held[0]:
                written.append(now)  # as the loop has it: unscaled
            else:
                written.append(self._written.get(g))  # held at the scale since: the rate as the code wrote it
        return RateHold(written, functools.partial(self._settle, trainer, 0, record=False))

    def _settle(self, trainer: pl.Trainer, index: int, record: bool = True) -> list[tuple[int, float, float]]:
        """Hold the rates of optimizer ``index`` that its module's code wrote since the suite or a scheduler last set
        them: each is multiplied by the scale its group holds. Returns ``(group, rate written, scale)`` of each. A
        group added since (``add_param_group``) takes the scale of the optimizer's other groups from its next rate.
        ``record``: remember the rates as written, for a trial's candidates (the run's own, not a candidate's)."""
        optimizer = trainer.optimizers[index]
        written: list[tuple[int, float, float]] = []
        scheduled: list[list[float | None]] | None = None
        known: float | None = None  # the scale the optimizer's groups hold, read only for a group added since
        for g, group in enumerate(optimizer.param_groups):
            held = group.get(HELD)
            if held is None:
                if known is None:
                    holding = (other[HELD][1] for other in optimizer.param_groups if HELD in other)
                    known = next(holding, self._scale(index))
                if known != 1.0:
                    if g == len(optimizer.param_groups) - 1 and _compat.backbone_rate_given(trainer, group):
                        scale_group(group, known)  # a rate given as is, not derived from the held ones
                        _compat.follow_backbone_rates(trainer, optimizer)
                    _hold_group(group, known)  # a new group: its rate as added, held from the next one it is given
                continue
            now = _as_number(group.get("lr"))
            if now is None or now == held[0]:
                continue
            if held[1] == 1.0:  # nothing to hold; the entry keeps the rate used, a trial's candidates read the next
                group[HELD] = [now, 1.0]
                if index == 0 and record:
                    self._written[g] = now
                continue
            if scheduled is None:
                scheduled = self._set_by_schedulers(trainer, index)
            if not _set_by_one(scheduled, g, now):
                written.append((g, now, held[1]))
                if index == 0 and record:
                    self._written[g] = now
                group["lr"] = now = now * held[1]
            group[HELD] = [now, held[1]]
        return written

    @staticmethod
    def _set_by_schedulers(trainer: pl.Trainer, index: int) -> list[list[float | None]]:
        """The rates optimizer ``index``'s schedulers set last, by group, and BackboneFinetuning's for the last group
        (derived from held rates): none of them written by the module's code."""
        last = len(trainer.optimizers[index].param_groups) - 1
        backbone = [[None] * last + [rate] for rate in _compat.backbone_rates(trainer)]
        return [*_scheduled(trainer, index), *backbone]

    def _settle_restored(self, trainer: pl.Trainer, index: int, scale: float) -> None:
        """Hold optimizer ``index``'s state just restored from a snapshot taken at ``scale``. A rate its module wrote
        after the step (a warm-up in ``optimizer_step``) is in the snapshot taken at the batch's end as written: it
        takes the snapshot's scale first, as the live state would have at its next step. Entries of another scale
        than the snapshot's predate the state (a snapshot written before the entries were): its rates are taken as
        they are."""
        optimizer = trainer.optimizers[index]
        for group in optimizer.param_groups:
            held = group.get(HELD)
            if held is not None and held[1] != scale and _as_number(group.get("lr")) == held[0]:
                # A group the restore left as it was (added since the snapshot): its rate is the live one, at the
                # scale it holds. At the snapshot's scale first, the ratio that brings the state to the current
                # scale leaves it where it was (it was halved twice: BackboneFinetuning's group after a rollback).
                scale_group(group, scale / held[1])
                _hold_group(group, scale)
        if all((group.get(HELD) or (None, scale))[1] == scale for group in optimizer.param_groups):
            self._settle(trainer, index)
        _hold(optimizer, scale)

    def _scale(self, index: int) -> float:
        return self.scales[index] if index < len(self.scales) else 1.0

    def _remember(self, action: str, step: int, index: int, kinds: str, reason: str, scale: float) -> dict[str, Any]:
        entry = {"step": step, "action": action, "optimizer": index, "kinds": kinds, "reason": reason, "scale": scale}
        self.history.append(entry)
        return entry

    # ---- trials -----------------------------------------------------------------------------------------------
    @override
    def _remedy_lr(
        self, trainer: pl.Trainer, snapshot: Snapshot | None, signal: Signal | None, power: int
    ) -> tuple[list[float], float] | None:
        """The remedy's learning rate: ``factor ** power`` times the current scale of the optimizer concerned (all
        of them for a trial opened without a signal), never below the floor. The live state is the snapshot just
        restored (its own scale then) or the current state."""
        step = int(trainer.global_step)
        self._track(len(trainer.optimizers), step)
        concerned = range(len(self.scales))
        if signal is not None:
            concerned = range(signal.optimizer_index, signal.optimizer_index + 1)
        then = [float(s) for s in snapshot.extras.get(self.state_key, {}).get("scales", [])] if snapshot else []
        scales = list(self.scales)
        for index in concerned:  # a negative power grows the rate back, never above the schedule
            scales[index] = min(1.0, max(self.scales[index] * self.factor**power, self.min_scale))
        for index, scale in enumerate(scales):
            was = then[index] if index < len(then) else (1.0 if snapshot is not None else self.scales[index])
            self._apply(trainer, index, scale / was, scale, restored=was if snapshot is not None else None)
        changed = [index for index in concerned if scales[index] != self.scales[index]]
        factor = scales[changed[0]] / self.scales[changed[0]] if changed else 1.0
        return scales, factor

    @override
    def _after_trial(self, trainer: pl.Trainer, outcome: TrialOutcome) -> None:
        """A kept remedy's learning rate is the run's now: a backoff, journaled as one. A discarded one changes
        nothing (the incumbent kept its own)."""
        scales = outcome.remedy.scales
        step = outcome.step
        trial = outcome.trial
        if not outcome.kept and trial.kind == REGROWTH:  # the higher rate did no better: wait twice as long
            for index in range(len(self.scales)):
                self._windows[index] = math.ceil(self._windows[index] * self.window_growth)
                self._stable_since[index] = step
        if not outcome.kept or scales is None:
            return
        for index, (old, new) in enumerate(zip(list(self.scales), scales)):
            if new == old:
                continue
            self.scales[index] = new
            self._stable_since[index] = step
            if new > old:
                self._last_regrowth[index] = step
            else:
                self._cooldown_until[index] = step
            reason = f"a trial opened {opened_because(trial.kind, trial.step)} kept the remedy: {outcome.why}"
            entry = self._remember("regrowth" if new > old else "backoff", step, index, trial.kind, reason, new)
            message = (
                f"LRBackoff: the learning rate of optimizer {index} is now {new:.4g} x its schedule (was {old:.4g} x; "
                f"group LRs {_shown_lrs(trainer, index)}): {reason}."
            )
            self._event(trainer, entry["action"], message, step=step, **_details(entry), previous_scale=old,
                        lrs=_lrs(trainer, index), trial=True, floor=self.min_scale)  # fmt: skip
            if trainer.global_rank == 0:
                log.info(message)
        self._unless_bounded(trainer, outcome.remedy.extras.get(self.state_key, {}))

    def _unless_bounded(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        """The remedy kept returned to its snapshot once more and AutoClip (which heard of it first) now bounds
        every update (``update_bound``): the backoffs since that snapshot answered gradients out of scale, not the
        rate, and are taken back, as after a rollback."""
        bounds = [s for s in self.board(trainer).signals if s.kind == UPDATE_BOUND]
        snapshot = [float(s) for s in extra.get("scales", [])]
        for index, scale in enumerate(list(self.scales)):
            then = snapshot[index] if index < len(snapshot) else 1.0
            bound = [s for s in bounds if s.optimizer_index == index]
            if bound and then > scale:
                self._apply(trainer, index, then / scale, then)
                self._take_back(trainer, index, then, bound[0])

    # ---- counters, rollback and state -------------------------------------------------------------------------
    @override
    def _counters(self) -> dict[str, float]:
        if len(self.scales) <= 1:
            return {"overflow/lr_scale": self.scales[0] if self.scales else 1.0}
        return {f"overflow/lr_scale_opt{i}": scale for i, scale in enumerate(self.scales)}

    @override
    def _wants_record(self) -> bool:
        return False  # it acts on the detectors' signals at batch end, never on a step's values

    @override
    def _settings(self) -> tuple[float, ...]:
        return tuple(self.scales)

    @override
    def _snapshot_extra(self) -> dict[str, Any]:
        return {"scales": list(self.scales)}

    @override
    def _after_restore(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        """The optimizer and scheduler state just restored carry the scale of their snapshot: bring them to the
        current scale, so that a rollback never undoes a backoff (whichever of the two callbacks runs first)."""
        step = int(trainer.global_step)
        self._track(len(trainer.optimizers), step)
        snapshot = [float(s) for s in extra.get("scales", [])]
        # AutoClip, a clipper, heard of this restore before LRBackoff (pipeline order) and may have bounded the updates.
        bounds = [s for s in self.board(trainer).signals if s.kind == UPDATE_BOUND]
        for index, scale in enumerate(self.scales):
            then = snapshot[index] if index < len(snapshot) else 1.0
            bound = [s for s in bounds if s.optimizer_index == index]
            if bound and then > scale:
                self._take_back(trainer, index, then, bound[0])  # the restored state carries the snapshot's rate
                self._settle_restored(trainer, index, then)
            else:
                self._apply(trainer, index, scale / then, scale, restored=then)
            # The state that diverged is undone: a divergence of the restored state at this scale is new evidence,
            # and backs off further at once rather than waiting out the cooldown of the backoff just made.
            self._cooldown_until[index] = min(self._cooldown_until[index], step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return versioned({
            "scales": list(self.scales),
            "cooldown_until": list(self._cooldown_until),
            "stable_since": list(self._stable_since),
            "windows": list(self._windows),
            "last_regrowth": list(self._last_regrowth),
            "history": [dict(h) for h in self.history],
            "trial": self._trial_state(),
        })  # fmt: skip

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Only the bookkeeping: the optimizer and scheduler state restored beside it already carry the scale.
        state = StateReader("LRBackoff", state_dict, since={"trial": 2})
        self.scales = state.get("scales", lambda v: [float(s) for s in v])
        n = len(self.scales)

        def per_optimizer(values: Any) -> list[int]:
            counts = [int(v) for v in values]
            if len(counts) != n:
                raise ValueError(f"{len(counts)} values for the {n} optimizers of 'scales'")
            return counts

        self._cooldown_until = state.get("cooldown_until", per_optimizer)
        self._stable_since = state.get("stable_since", per_optimizer)
        self._windows = state.get("windows", per_optimizer)
        self._last_regrowth = state.get("last_regrowth", per_optimizer)
        self.history = state.get("history", lambda v: [dict(h) for h in v])
        self._load_trial_state(state.get("trial", lambda v: v, old=None))
        state.finish(ignored=("restored_at",))  # the escalation's, written by earlier releases


def _schedulers(trainer: pl.Trainer, index: int) -> list[Any]:
    """The Lightning-configured schedulers of optimizer ``index``."""
    optimizer = trainer.optimizers[index]
    return [
        config.scheduler
        for config in trainer.lr_scheduler_configs
        if getattr(config.scheduler, "optimizer", None) is not None and schedules(config.scheduler, optimizer)
    ]


def _hold(optimizer: Any, scale: float) -> None:
    """Note in each param group the rate it has now and the scale the state holds (tensor rates are never held)."""
    for group in optimizer.param_groups:
        _hold_group(group, scale)


def _hold_group(group: dict[str, Any], scale: float) -> None:
    rate = _as_number(group.get("lr"))
    if rate is not None:
        group[HELD] = [rate, scale]


def _scheduled(trainer: pl.Trainer, index: int) -> list[list[float | None]]:
    """The rates each scheduler of optimizer ``index`` set last (``_last_lr``)."""
    lasts = [getattr(scheduler, "_last_lr", None) for scheduler in _schedulers(trainer, index)]
    return [_as_numbers(last) for last in lasts if isinstance(last, list)]


def _set_by_one(scheduled: list[list[float | None]], group: int, rate: float) -> bool:
    """Whether ``rate`` is the one a scheduler set last in param group ``group`` (:meth:`LRBackoff._set_by_schedulers`
    lists them)."""
    return any(group < len(rates) and rates[group] == rate for rates in scheduled)


def _as_number(rate: Any) -> float | None:
    """A rate as a number; ``None`` for a tensor rate, never compared: reading it would cost a host read."""
    return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else None


def _as_numbers(rates: Iterable[Any]) -> list[float | None]:
    return [_as_number(rate) for rate in rates]


def _numbers(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.4g}" for v in values)


def _details(entry: dict[str, Any]) -> dict[str, Any]:
    """A history entry as journal details; its step dates the event instead (``global_step`` has moved on)."""
    return {k: v for k, v in entry.items() if k != "step"}


def _kinds(signals: Sequence[Signal]) -> str:
    return ", ".join(dict.fromkeys(s.kind for s in signals))


def _lrs(trainer: pl.Trainer, index: int) -> list[float]:
    return group_rates(trainer.optimizers[index])


def _shown_lrs(trainer: pl.Trainer, index: int) -> str:
    """The param groups' rates for a message, to 4 significant digits (``[0.004455, 0.0005]``)."""
    return f"[{', '.join(f'{rate:.4g}' for rate in _lrs(trainer, index))}]"
