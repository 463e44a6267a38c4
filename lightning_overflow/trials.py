"""Trials in a Lightning fit: open one on a suspicion, run both candidates on the loop's batches, act on the verdict.

The pure part (the paired scores and the verdict) is :mod:`lightning_overflow.trial`; the second candidate, trained
beside the loop, is :mod:`lightning_overflow.candidate`. This module wires them to the board's batch: every suite
callback of a trainer shares one :class:`TrialRunner` (on its :class:`~lightning_overflow.health.HealthBoard`).

One trial, in order:

1. **Open** (``on_train_batch_end`` of the batch whose detectors raised a suspicion, or of a scheduled step): the
   live state, the incumbent, is copied aside; the live state becomes the remedy (``Rollback`` restores the last
   verified snapshot from before the suspicion's onset, ``LRBackoff`` multiplies its learning rate by its
   ``factor``); in ``"ab"`` mode the two are swapped, so the loop goes on training the incumbent and the remedy is
   the candidate on the side. With neither callback there is no remedy, and no trial.
2. **Run** for ``steps`` optimizer steps: at the start of each batch the candidate on the side trains on it (or, in
   ``"frozen"`` mode, the frozen incumbent is scored on it); the loop then trains the live state. Each optimizer
   step gives one pair of scores, the two losses before the step.
3. **Verdict** (``on_train_batch_end`` of the last step): the remedy is kept only when it did better beyond the noise
   of the paired differences; the loser is discarded. Every suite callback hears the outcome
   (``_after_trial``): a kept remedy is journaled as the backoff and the rollback it is, a discarded one as a false
   alarm, after which the detector re-learns the run's level and the same suspicion may open a trial again only
   after twice as long a pause as the last.

A certain fault during a trial (inf/NaN weights, steps that keep failing) ends it at once: the remedy, which trained
on the same batches, is kept when its own losses were finite, and the fault is then answered as usual otherwise.
The remedy starts from a verified snapshot but its own end state is not yet verified: the snapshot stays the
restore point until ``Rollback`` takes the next one after ``every_n_steps`` healthy steps.

Every rank runs the same trial: the decisions come from values identical on every rank (under DDP the candidate's
gradients are averaged across ranks, and its loss rides on the step's one all-reduce).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_overflow import _compat
from lightning_overflow.candidate import Candidate, CandidateStep, trainable
from lightning_overflow.fit_summary import named
from lightning_overflow.policy import (
    CERTAIN_SIGNALS,
    REGROWTH,
    REMEDY_RISE,
    SCHEDULED,
    SUSPICION_SIGNALS,
    TAKEOVER_LOSSES,
    TRIAL_STEPS_FACTOR,
    Signal,
)
from lightning_overflow.preserve import batch_copy
from lightning_overflow.trial import DEFAULT_TRIAL, Trial, TrialConfig, TrialVerdict

if TYPE_CHECKING:
    import pytorch_lightning as pl


class _Record(Protocol):
    """What a trial reads of the step record (:class:`~lightning_overflow.health.StepHealth`)."""

    world_size: int
    loss_mean: float
    grad_norms: torch.Tensor

    @property
    def loss_finite(self) -> bool: ...

    def add(self, name: str, value: torch.Tensor, *, per_rank: bool = False, summed: bool = False) -> None: ...

    def has(self, name: str) -> bool: ...

    def value(self, name: str) -> list[float]: ...


class _Board(Protocol):
    """What a trial asks of the board (:class:`~lightning_overflow.health.HealthBoard`)."""

    signals: list[Signal]
    current: Any

    def prepare_remedy(self, trainer: pl.Trainer, signal: Signal | None, power: int) -> Remedy | None: ...

    def journal_trial(self, trainer: pl.Trainer, outcome: TrialOutcome, extra_steps: int) -> None: ...

    def after_trial(self, trainer: pl.Trainer, outcome: TrialOutcome) -> None: ...

__all__ = ["Remedy", "TrialOutcome", "TrialRunner"]


@dataclass
class Remedy:
    """What the remedy of a trial is.

    Attributes:
        snapshot_step: the step of the snapshot it starts from (``None``: the current state).
        extras: what the suite's callbacks kept beside that snapshot, by state key.
        scales: the learning rate scales it trains at, by optimizer (``None``: unchanged).
        factor: the factor its learning rate was multiplied by (1.0: unchanged).
    """

    snapshot_step: int | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    scales: list[float] | None = None
    factor: float = 1.0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Remedy:
        scales = state["scales"]
        step = state["snapshot_step"]
        return cls(None if step is None else int(step), dict(state["extras"]),
                   None if scales is None else [float(v) for v in scales], float(state["factor"]))  # fmt: skip


@dataclass(frozen=True)
class TrialOutcome:
    """How a trial ended, as every suite callback hears it.

    Attributes:
        trial: the trial, with its scores.
        kept: whether the remedy is now the live state.
        remedy: what the remedy was.
        step: the optimizer step at which it ended.
        verdict: the verdict (``None`` when a certain fault, or a change of the model's layout, ended the trial).
        why: a sentence for messages.
        layout_change: how the model's parameters changed, when that ended the trial.
    """

    trial: Trial
    kept: bool
    remedy: Remedy
    step: int
    verdict: TrialVerdict | None
    why: str
    layout_change: str = ""

    @property
    def false_alarm(self) -> bool:
        """A suspicion the trial did not confirm (a scheduled trial that keeps the current rate is none, nor a lower
        rung of a ladder whose first rung confirmed it, nor a trial a certain fault ended before any verdict)."""
        return (not self.kept and self.verdict is not None and self.trial.kind not in (SCHEDULED, REGROWTH)
                and self.trial.rung == 1)  # fmt: skip


class TrialRunner:
    """The trials of one trainer's fit (see the module docstring). Held by the board."""

    def __init__(self) -> None:
        self.config: TrialConfig | None = None
        self.trial: Trial | None = None
        self.remedies: list[Remedy] = []
        self.sides: list[Candidate] = []  # the candidates on the side: the remedies ("ab") or the incumbent ("frozen")
        self.unavailable = ""  # why no candidate can be trained in this fit (then suspicions act at once)
        self._side_states: list[dict[str, Any]] = []  # a checkpoint's candidates, until the fit can hold them
        self._pending: list[CandidateStep] = []  # each side candidate's step on this batch
        self._false_alarms: dict[str, int] = {}
        self._answered: dict[str, int] = {}  # suspicions answered at once (where no trial can run), by kind
        self._barred_until: dict[str, int] = {}
        self._spent = 0  # optimizer steps spent in trials opened by suspicions
        self._last_end = 0  # the step the last trial ended at (for scheduled trials)
        self.trials = 0
        self.kept = 0

    @property
    def active(self) -> bool:
        return self.trial is not None

    @property
    def runs(self) -> bool:
        """Whether this fit tries suspicions (settings given, and a candidate can train beside the loop)."""
        return self.config is not None and not self.unavailable

    @property
    def _frozen(self) -> bool:
        return self.config is not None and self.config.mode == "frozen"

    def configure(self, config: TrialConfig | None, trainer: pl.Trainer) -> str:
        """The fit's trial settings (``None``: suspicions are not tried), whether a candidate can train here, and
        the candidates of a trial a resumed checkpoint was saved in. That trial goes on under its own settings,
        unless this fit runs none or another mode (which holds other states live and on the side): it is then
        withdrawn, and the run as it was goes on; the sentence that says so is returned (``""`` otherwise)."""
        self.config = config
        self.unavailable = trainable(trainer) if config is not None else ""
        saved, self._side_states = self._side_states, []
        if saved:
            self.sides = [Candidate.from_state(state, trainer) for state in saved]
        trial = self.trial
        if trial is None or (self.runs and config is not None and config.mode == trial.config.mode):
            return ""
        if trial.config.mode == "frozen" and self.sides:  # the live state is its remedy: the incumbent comes back
            self.sides[0].swap(trainer)
        self.trial, self.sides, self.remedies = None, [], []
        self.trials -= 1
        now = "runs no trials" if not self.runs else f"runs them in {config.mode!r} mode"  # type: ignore[union-attr]
        return (f"the trial the checkpoint was saved in (opened at step {trial.step}, {trial.config.mode!r} mode) is "
                f"withdrawn: this fit {now}, so the run goes on as it was before it opened")  # fmt: skip

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    # ---- the batch ------------------------------------------------------------------------------------------------
    def begin_batch(self, trainer: pl.Trainer, board: _Board, batch: Any, batch_idx: int) -> None:
        """Before the loop trains on ``batch``: each candidate on the side trains on it (or is scored on it), its
        step judged, clipped and its rates held as the suite does the loop's."""
        if not self.sides or self._end_on_layout_change(trainer, board):
            return
        steps = _compat.optimizer_steps_this_batch(trainer)
        # Each side run on a copy of the batch's containers: a model that writes its outputs into its input dict
        # (schnetpack) gave the next candidate, and the loop, its predictions for targets.
        if self._frozen:
            self._pending = [side.score_on(trainer, batch_copy(batch), batch_idx, steps) for side in self.sides]
            return
        clip, rates = board.candidate_clip(trainer), board.candidate_rates(trainer)
        self._pending = [side.train_on(trainer, batch_copy(batch), batch_idx, steps, clip, rates)
                         for side in self.sides]  # fmt: skip

    def contribute(self, record: _Record) -> None:
        """Under DDP, each side candidate's loss on this rank rides on the step's one all-reduce."""
        if record.world_size == 1:
            return
        device = record.grad_norms.device
        for index, pending in enumerate(self._pending):
            if not pending.stepped:
                continue
            finite = math.isfinite(pending.loss)
            loss = torch.tensor(pending.loss if finite else 0.0, dtype=torch.float64, device=device)
            record.add(f"trial_loss_{index}", loss, summed=True)
            record.add(f"trial_bad_{index}", torch.tensor(float(not finite), dtype=torch.float64, device=device),
                       summed=True)  # fmt: skip

    def note_schedule(self, steps: list[int]) -> None:
        """The loop stepped each scheduler ``steps`` times in this batch: each remedy on the side steps its own as
        often, unless its own step was skipped."""
        if self._frozen:
            return
        for side, pending in zip(self.sides, self._pending):
            if pending.stepped:
                side.note_schedule(steps, pending.skipped)

    def note_epoch_schedule(self) -> None:
        """The loop stepped its scheduler as an epoch ended, outside every batch (a plain loop's ``end_epoch``): each
        remedy on the side steps its own as often, before its next step."""
        if self._frozen:
            return
        for side in self.sides:
            side.note_schedule([1], skipped=False)

    def note_plateau(self, values_by_scheduler: list[list[float]]) -> None:
        """The loop's plateau schedulers stepped on these values (each scheduler's, in order): each remedy on the side
        steps its own on the same values before its next step."""
        if self._frozen:
            return
        for side in self.sides:
            side.note_plateau(values_by_scheduler)

    def end_batch(self, trainer: pl.Trainer, board: _Board) -> None:
        """At the end of the batch, before the interventions act: score the step, end a trial or open one.

        Where trials run, the suspicions of the batch are the trials' business and are taken off the board's list
        (tried, or waiting: a trial under way, a pause after a false alarm, the share spent); where none can run,
        they stay for the interventions to answer at once. Nothing signalled, under way or scheduled: nothing to do.
        """
        scheduled = self.config is not None and self.config.every_n_steps is not None
        if not (board.signals or self.trial is not None or self.sides or scheduled):
            return
        pending, self._pending = self._pending, []
        step = int(trainer.global_step)
        if not self.runs:
            self._pace_at_once(board, step)
            return
        suspicions = [s for s in board.signals if s.kind in SUSPICION_SIGNALS]
        for signal in suspicions:
            board.signals.remove(signal)
        certain = [s for s in board.signals if s.kind in CERTAIN_SIGNALS]
        if self.trial is not None:
            if pending and pending[0].stepped:
                self._score(board.current, pending)
            if certain:
                self._end_on_fault(trainer, board, certain[0], step)
            elif self.trial.done:
                self._conclude(trainer, board, step)
            return
        if certain:
            return  # answered at once by the interventions
        waiting = [s for s in suspicions if step >= self._barred_until.get(s.kind, 0)]
        if waiting:
            self._open(trainer, board, waiting[0].kind, step, waiting[0])
        elif not suspicions and self._scheduled(board, step):
            self._open(trainer, board, SCHEDULED, step, None)

    def _pace_at_once(self, board: _Board, step: int) -> None:
        """Where no trial can run, a suspicion is answered at once, without a verdict; so it is paced as a trial's
        false alarm would be: once answered, the same suspicion waits ``steps x 2^n`` steps (``n``: the times it was
        answered) and is dropped meanwhile. A run that stays at a new level after a remedy (a new task, not a
        divergence) is then backed off once or twice, not every few steps down to the floor."""
        window = (self.config or DEFAULT_TRIAL).steps
        for signal in [s for s in board.signals if s.kind in SUSPICION_SIGNALS]:
            if step < self._barred_until.get(signal.kind, 0):
                board.signals.remove(signal)
                continue
            self._bar(signal.kind, self._answered, step, window)

    def _bar(self, kind: str, counts: dict[str, int], step: int, steps: int) -> None:
        """Count one more unconfirmed answer to the suspicion ``kind`` in ``counts``; it then waits ``steps x 2^n``
        steps (``n``: the count) before it may act again."""
        counts[kind] = counts.get(kind, 0) + 1
        self._barred_until[kind] = step + steps * 2 ** counts[kind]

    def end_fit(self, trainer: pl.Trainer, board: _Board) -> None:
        """The fit ends with a trial under way: judged on the steps so far (too few keep the incumbent). One opened
        on the last batch (a follow-up of a trial that ended there) has no step: it is withdrawn, unjournaled."""
        if self.trial is None or self._end_on_layout_change(trainer, board):
            return
        if not self.trial.incumbent:
            if self._frozen:  # the live state is the remedy: the incumbent, frozen on the side, comes back
                self.sides[0].swap(trainer)
            self.trial, self.sides, self.remedies = None, [], []
            self.trials -= 1
            return
        self._conclude(trainer, board, int(trainer.global_step), early=True)

    # ---- opening --------------------------------------------------------------------------------------------------
    def _scheduled(self, board: _Board, step: int) -> bool:
        every = self.config.every_n_steps if self.config is not None else None
        return (every is not None and not board.signals and step > 0 and step - self._last_end >= every
                and step >= self._barred_until.get(SCHEDULED, 0))

    def _affordable(self, step: int) -> bool:
        """Trials opened by suspicions take at most ``max_share`` of the steps so far (the first always may)."""
        assert self.config is not None
        return self._spent <= self.config.max_share * step

    def open_regrowth(self, trainer: pl.Trainer, board: _Board) -> None:
        """A backed-off learning rate that held for a while: try it one factor higher against itself (``LRBackoff``
        asks, instead of growing it back blind)."""
        if self.runs and self.trial is None:
            self._open(trainer, board, REGROWTH, int(trainer.global_step), None, powers=(-1,))

    def _open(
        self, trainer: pl.Trainer, board: _Board, kind: str, step: int, signal: Signal | None, rung: int = 1,
        powers: tuple[int, ...] | None = None, restart: bool = False,
    ) -> None:
        """Build the remedies from the live state and set them beside it (see the module docstring). ``powers``: of
        the backoff factor, one remedy each (default ``1, 3, ...``, one per ``remedies``)."""
        assert self.config is not None
        if rung == 1 and kind not in (SCHEDULED, REGROWTH) and not self._affordable(step):
            return
        incumbent = Candidate.capture(trainer)
        remedies: list[Remedy] = []
        sides: list[Candidate] = []
        # The first rung starts from the verified snapshot a rollback would go to; a lower rung, from the remedy just
        # kept (the question is then only whether a lower rate does better still), or from its snapshot again where
        # it diverged too (``restart``).
        start = signal if rung == 1 or restart else None
        for power in powers or range(1, 2 * self.config.remedy_count, 2):  # factor, factor**3, ...
            remedy = board.prepare_remedy(trainer, start, power)  # the live state is the remedy now
            if remedy is None or any(r.factor == remedy.factor for r in remedies):
                incumbent.copy_to_live(trainer)
                break
            remedies.append(remedy)
            sides.append(Candidate.capture(trainer))
            incumbent.copy_to_live(trainer)
        if not remedies:  # nothing to try: the live state is the incumbent, as it was
            # Wait before asking again rather than copying the state every batch: a scheduled trial its interval, a
            # suspicion a trial's length.
            self._last_end = step
            if kind not in (SCHEDULED, REGROWTH):
                self._barred_until[kind] = step + self.config.steps
            return
        if self._frozen:  # the loop trains the remedy; the incumbent, frozen, is scored on the side
            sides[0].swap(trainer)
            sides = [incumbent]
        self.remedies, self.sides = remedies, sides
        # Some suspicions' remedies start from far back (TRIAL_STEPS_FACTOR): their first trial runs longer.
        factor = TRIAL_STEPS_FACTOR.get(kind, 1) if rung == 1 else 1
        self.trial = Trial(
            kind=kind,
            step=signal.step if signal is not None else step,
            config=self.config if factor == 1 else replace(self.config, steps=self.config.steps * factor),
            reason=signal.reason if signal is not None else _REASONS[kind],
            source=signal.source if signal is not None else "",
            snapshot_step=remedies[0].snapshot_step,
            lr_factors=[r.factor for r in remedies],
            rung=rung,
        )
        self.trials += 1

    # ---- scoring and ending ---------------------------------------------------------------------------------------
    def _score(self, record: _Record | None, pending: list[CandidateStep]) -> None:
        assert self.trial is not None
        live = record.loss_mean if record is not None and record.loss_finite else math.nan
        sides = [p.loss for p in pending]
        if record is not None and record.world_size > 1:
            sides = [
                record.value(f"trial_loss_{i}")[0] / record.world_size
                if record.value(f"trial_bad_{i}")[0] == 0
                else math.nan
                for i in range(len(pending))
            ]
        if self.trial.kind not in (SCHEDULED, REGROWTH) and self.trial.rung == 1:  # the share suspicions may take
            self._spent += 1
        if self._frozen:
            self.trial.add(sides[0], live)
        else:
            self.trial.add(live, *sides)

    def _conclude(self, trainer: pl.Trainer, board: _Board, step: int, early: bool = False) -> None:
        assert self.trial is not None
        verdict = self.trial.verdict()
        ended = f" (the fit ended after {len(self.trial.incumbent)} of {self.trial.config.steps} steps)" if early else ""
        winner, why = verdict.winner, verdict.reason + ended
        if early and winner is None and not self._frozen:
            winner, why = self._finite_where_the_run_was_not(why)
        self._finish(trainer, board, step, winner, verdict, why, last=early)

    def _finite_where_the_run_was_not(self, why: str) -> tuple[int | None, str]:
        """At the fit's end, with no winner yet: the weights the fit returns must not be those that gave inf/NaN
        losses where a remedy, on the same batches, gave finite ones (a skipped step keeps the state that overflowed;
        no later step is left to answer it). The remedy finite on all of those batches, and lowest over its last
        ``TAKEOVER_LOSSES``, takes over; otherwise the run as it was stays."""
        assert self.trial is not None
        incumbent = self.trial.incumbent
        failed = [i for i, loss in enumerate(incumbent) if not math.isfinite(loss)]
        if not failed:
            return None, why
        winner = self._healthiest_remedy(also_finite_at=failed)
        if winner is None:
            return None, why
        return winner, (
            f"{why}; but the run as it was had inf/NaN losses on {len(failed)} of its {len(incumbent)} trial batches "
            f"where the learning rate x{self.trial.lr_factors[winner]:g} had finite ones, and the fit ends here: "
            "that remedy takes over"
        )

    def _end_on_fault(self, trainer: pl.Trainer, board: _Board, fault: Signal, step: int) -> None:
        """A certain fault of the live state ends the trial. In ``"ab"`` mode the live state is the incumbent: the
        remedy whose last losses were finite and lowest, which trained on the same batches, takes over (the fault is
        answered by it); without one, the fault is answered at once. In ``"frozen"`` mode the live state is the
        remedy: the incumbent, which the fault never touched, comes back."""
        assert self.trial is not None
        winner: int | None = None
        if not self._frozen:
            winner = self._healthiest_remedy()
        if self._frozen or winner is not None:
            board.signals.remove(fault)
        if self._frozen:
            then = "the frozen incumbent, which it never touched, comes back"
        elif winner is not None:
            then = (f"the remedy at the learning rate x{self.trial.lr_factors[winner]:g}, which trained on the same "
                    "batches with finite losses, takes over")  # fmt: skip
        else:
            then = "no remedy's own losses were finite either: the fault is answered at once"
        self._finish(trainer, board, step, winner, None, f"{named(fault.kind)} at step {fault.step} ended the trial: {then}")

    def _end_on_layout_change(self, trainer: pl.Trainer, board: _Board) -> bool:
        """A model whose layout changed during the trial (``ModelPruning`` at an epoch's or a validation's end, or
        making its pruning permanent as the fit ends) has no place for the candidates on the side, nor has one pruned
        again (new masks, the same layout: a candidate swapped in would bring back what was pruned): the trial ends
        with the live state as it is (in ``"frozen"`` mode the remedy, since the incumbent cannot come back)."""
        if self.trial is None:
            return False
        change = self.sides[0].layout_change(trainer.lightning_module)
        if not change:
            return False
        step = int(trainer.global_step)
        live = "the remedy, live, stays" if self._frozen else "the run goes on as it is"
        why = (f"the model's parameters changed during the trial (now {change}): the state on the side no longer "
               f"fits the model, and {live}")  # fmt: skip
        if change.startswith("pruned again"):
            why = f"the model was {change} during the trial: the state on the side prunes less, and {live}"
        self._finish(trainer, board, step, 0 if self._frozen else None, None, why, last=True, layout_change=change)
        return True

    def _healthiest_remedy(self, also_finite_at: Sequence[int] = ()) -> int | None:
        """The remedy whose last ``TAKEOVER_LOSSES`` losses were finite and lowest (and finite on the batches
        ``also_finite_at``); ``None`` when none was."""
        assert self.trial is not None
        remedies, last = self.trial.remedies, TAKEOVER_LOSSES
        healthy = [j for j, scores in enumerate(remedies)
                   if scores[-last:] and all(map(math.isfinite, scores[-last:]))
                   and all(math.isfinite(scores[i]) for i in also_finite_at)]  # fmt: skip
        return min(healthy, key=lambda j: sum(remedies[j][-last:]), default=None)

    def _finish(
        self, trainer: pl.Trainer, board: _Board, step: int, winner: int | None, verdict: TrialVerdict | None,
        why: str, last: bool = False, layout_change: str = "",
    ) -> None:
        """End the trial with ``winner`` live (``None``: the run as it was); ``last``: the fit ends here, so no next
        rung opens."""
        assert self.trial is not None and self.config is not None
        trial = self.trial
        if self._frozen:
            if winner is None:  # the incumbent, frozen on the side, comes back
                self.sides[0].swap(trainer)
        elif winner is not None:  # the remedy on the side becomes the live state
            self.sides[winner].catch_up(trainer)
            self.sides[winner].swap(trainer)
        remedy = self.remedies[0 if self._frozen else winner] if winner is not None else Remedy()
        self.trial, self.sides, self.remedies = None, [], []
        self._last_end = step
        outcome = TrialOutcome(trial, winner is not None, remedy, step, verdict, why, layout_change)
        if outcome.kept:
            self.kept += 1
            self._false_alarms.pop(trial.kind, None)
        elif outcome.false_alarm:
            self._bar(trial.kind, self._false_alarms, step, trial.config.steps)
        elif trial.kind == SCHEDULED and verdict is not None and trial.config.every_n_steps is not None:
            # A lower rate did no better: the next scheduled trial waits twice as long as the last (a healthy run pays
            # for a few over its whole fit, not one per interval).
            self._bar(SCHEDULED, self._false_alarms, step, trial.config.every_n_steps)
        board.journal_trial(trainer, outcome, extra_steps=len(trial.incumbent) * len(trial.remedies))
        board.after_trial(trainer, outcome)
        if outcome.kept and not last and trial.kind not in (SCHEDULED, REGROWTH) and remedy.factor < 1.0:
            # A remedy was better; is a lower rate better still? The next rung: the remedy just kept at the next lower
            # rates against itself. The ladder stops at the first rung the run as it is wins.
            rise = trial.rise(winner) if winner is not None and trial.snapshot_step is not None else math.nan
            restart = rise >= REMEDY_RISE  # it diverged too: the lower rates start again from where it started
            where = f" rose {rise:.3g}x over its trial, tried again from its snapshot" if restart else \
                ", tried once more from there"
            follow = Signal(trial.kind, step, f"the remedy kept at step {step}{where}", trial.source,
                            onset=trial.snapshot_step if restart else None, retry=restart)  # fmt: skip
            self._open(trainer, board, trial.kind, step, follow, rung=trial.rung + 1, restart=restart)

    # ---- state ----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The trial under way (its candidates' tensors on the host) and the pacing of the next ones."""
        return {
            "version": 2,
            "trial": self.trial.state_dict() if self.trial is not None else None,
            "sides": [side.state_dict() for side in self.sides],
            "remedies": [remedy.state_dict() for remedy in self.remedies],
            "false_alarms": dict(self._false_alarms),
            "answered": dict(self._answered),
            "barred_until": dict(self._barred_until),
            "spent": self._spent,
            "last_end": self._last_end,
            "trials": self.trials,
            "kept": self.kept,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the state of a checkpoint; the candidates are put on the live state's devices once the fit's model
        and optimizers exist (:meth:`configure`)."""
        if state.get("version") not in (1, 2):
            raise ValueError(f"the trial state in this checkpoint has version {state.get('version')!r}; this release "
                             f"reads versions 1 and 2")  # fmt: skip
        self.trial = Trial.from_state(state["trial"]) if state["trial"] is not None else None
        self._side_states = list(state["sides"])
        self.remedies = [Remedy.from_state(r) for r in state["remedies"]]
        self._false_alarms = {str(k): int(v) for k, v in state["false_alarms"].items()}
        # Version 1 (before suspicions answered at once were paced) has no "answered": none were counted.
        self._answered = {str(k): int(v) for k, v in state["answered"].items()} if state["version"] >= 2 else {}
        self._barred_until = {str(k): int(v) for k, v in state["barred_until"].items()}
        self._spent = int(state["spent"])
        self._last_end = int(state["last_end"])
        self.trials = int(state["trials"])
        self.kept = int(state["kept"])


_REASONS = {
    SCHEDULED: "a scheduled test of a lower learning rate",
    REGROWTH: "the backed-off learning rate held: a test of a higher one",
}
