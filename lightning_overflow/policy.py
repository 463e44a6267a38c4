"""What the suite does about a step and about a batch, decided in one place: certain faults act at once, suspicions
are tried.

The policy (signal -> action), with the reason for each rule:

======================================  =====================================  =========================================
what happened (signal)                  what the suite does                    why
======================================  =====================================  =========================================
a non-finite loss or gradient           skip the step, at once                 a skipped step changes nothing: nothing
(``nonfinite``)                         (NonFiniteDetector)                    can be lost by it
a gradient-norm outlier                 clip it, at once (AutoClip)            the step without the outlier is the step
non-finite weights, moments or          restore the last verified snapshot,    inf/NaN state never heals: doing nothing
buffers (``nonfinite_state``); DDP      at once, and back the learning rate    cannot be better (replicas that differ
replicas that differ                    off (Rollback, LRBackoff)              are no fault of the learning rate: no
(``replica_mismatch``)                                                         backoff)
steps that keep failing: non-finite     back off and restore, at once; when    a state whose steps fail is not training
on clean batches, or most of the        nothing is left to try,
recent steps skipped                    ``DivergenceError``
(``nonfinite_persistent``)
a suspicion: the loss level, a trend,   a trial (:mod:`lightning_overflow.     only a measurement on unseen batches
runaway weights, a GradScaler that      trial`): the last verified snapshot    tells a divergence from a harmless
keeps overflowing                       at the backed-off rate against the     change (new data, a harder task, input
(``loss_divergence``, ``loss_trend``,   run as it is, ``steps`` steps on the   spikes); a tie goes to the run as it is,
``weight_growth``,                      same batches; the better one beyond    so a false alarm costs compute, never
``scaler_collapse``)                    noise goes on                          the result
a run that does not learn: the loss     a trial, twice as long: the last       a learning rate too high that never
level has not come down to half its     verified snapshot from before the      overflows leaves no best to diverge
starting level and made no progress     last progress (for a run that never    from, and damages the state it holds
in ``NO_PROGRESS_STEPS`` healthy steps  learned, the fit's first) at the       (a lower rate from there does not
(``no_progress``)                       backed-off rate against the run as     learn either); a slow starter about
                                        it is                                  to learn ties, and goes on as it is
none, every ``every_n_steps``           a trial of the backed-off rate from    a rate too high for a run that did
(opt-in)                                the current state                      learn (it plateaus above what a lower
                                                                               rate reaches) raises no suspicion
the fit ends during a trial, the run    the remedy finite on those batches     no later step is left to answer the
as it is inf/NaN on trial batches       takes over (else the verdict so far)   overflow, and a skipped step keeps the
where a remedy was finite                                                      state that overflowed (the demo's
                                                                               transformer: validation NaN otherwise)
======================================  =====================================  =========================================

A suspicion is acted on at once, as a certain fault is, where no trial can run: trials off (``trial=None``), or a
fit whose steps a second candidate cannot repeat (manual optimization, several optimizers, a closure optimizer such
as LBFGS, a sharded strategy), paced as false alarms are. While a trial runs, further suspicions wait for its
verdict; a false alarm makes the same suspicion wait twice as long as last time before it may open a trial again, and
the detector re-learns the run's level. The remedies are bounded: ``LRBackoff`` by its floor (``min_scale``),
``Rollback`` by ``max_rollbacks`` retries with nothing changed; a certain fault with nothing left to try stops the run
with :class:`~lightning_overflow.DivergenceError`, a suspicion never does (it is left alone there).
``no_progress`` is in no default trigger: where no trial can run it is journaled only, since backing off a slow
starter blind could cost its result.

Each suite callback judges the same final step record and may return a :class:`Verdict`: a reason to skip the
step, a proposed clip, or both. :func:`decide_step` turns all of them into one :class:`StepAction`, applied once by
the pipeline. The rules, in order:

==========================================  ====================================================================
rule                                        reason
==========================================  ====================================================================
any skip request wins                       a step that a detector found non-finite must not move the weights,
                                            whatever a clipper proposed for it
the first skip request (pipeline order)     one skip is journaled and counted once, by the participant that
is the one recorded                         asked first (detectors come before interventions)
without a skip, every clip is applied       each clipper owns its own optimizer's gradients (two ``AutoClip``
                                            on two optimizers never meet on one step)
==========================================  ====================================================================

Free of Lightning: the pipeline (:mod:`lightning_overflow.health`) calls it with plain values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

__all__ = [
    "CERTAIN_SIGNALS",
    "DEFAULT_BACKOFF_TRIGGERS",
    "DEFAULT_ROLLBACK_TRIGGERS",
    "DIVERGENCE_SIGNALS",
    "NO_PROGRESS_LEVEL",
    "NO_PROGRESS_MARGIN",
    "NO_PROGRESS_STEPS",
    "REGROWTH",
    "SCHEDULED",
    "SIGNAL_KINDS",
    "SUSPICION_SIGNALS",
    "TRIAL_STEPS_FACTOR",
    "UPDATE_BOUND",
    "ClipPlan",
    "Signal",
    "StepAction",
    "Verdict",
    "decide_step",
]

SIGNAL_KINDS = (
    "nonfinite",
    "nonfinite_burst",
    "nonfinite_persistent",
    "nonfinite_state",
    "scaler_collapse",
    "loss_spike",
    "grad_spike",
    "loss_divergence",
    "loss_trend",
    "loss_plateau",
    "no_progress",
    "weight_growth",
    "replica_mismatch",
)
"""Every signal a detector can raise: the vocabulary of ``triggers`` (see the ladder above)."""

DIVERGENCE_SIGNALS = (
    "nonfinite_persistent",
    "nonfinite_state",
    "scaler_collapse",
    "loss_divergence",
    "loss_trend",
    "weight_growth",
)
"""The signals that are evidence that the training state itself degrades."""

CERTAIN_SIGNALS = ("nonfinite_persistent", "nonfinite_state", "replica_mismatch")
"""Faults that need no verdict: the state cannot train, or is corrupt. Answered at once."""

SUSPICION_SIGNALS = (
    "loss_divergence", "loss_trend", "loss_plateau", "no_progress", "weight_growth", "scaler_collapse"
)
"""Evidence that the state may diverge, or may not learn at its rate: tried where a trial can run, answered at once
where none can (by the interventions whose triggers name it)."""

TRIAL_STEPS_FACTOR = {"no_progress": 2}
"""Suspicions whose first trial runs this many times ``TrialConfig.steps``: its remedy starts from before the run
stopped making progress, often the fit's start, and needs longer to show where it goes (a post-norm transformer at 8x
its stable rate, started again at half of it: 3% lower losses than the run as it is over steps 10-20, 13% over
40-50)."""

NO_PROGRESS_STEPS = 50
"""Healthy steps without progress that make a run suspected of not learning: a run that learns makes a new low by the
margin twice or more within it (a post-norm transformer at its stable rate: one every 25 steps or fewer), and a run that
never learned keeps most of its budget for the lower rate. A slow starter flat for longer ties its trial, at the cost
of its steps (the rescue benchmark's, flat for 150 of 400 steps: one trial, 80 extra steps)."""

NO_PROGRESS_MARGIN = 0.05
"""Progress: a new low of the loss level by this share of the starting level; the level of a run stalled at a high
rate still creeps down (1-2% of its start in 50 steps), one that learns falls 10% or more."""

NO_PROGRESS_LEVEL = 0.5
"""Once the loss level has come down to this share of its starting level, the run has learned: the test stops for
good, so a converged run (at a tenth of its start, or a harder task after a change of data) is never suspected."""

SCHEDULED = "scheduled"
"""The kind of a trial opened without a signal (``TrialConfig(every_n_steps=...)``)."""

REGROWTH = "regrowth"
"""The kind of a trial of a higher learning rate, opened by ``LRBackoff`` once a backed-off rate has held."""

DEFAULT_BACKOFF_TRIGGERS = DIVERGENCE_SIGNALS
"""LRBackoff's default triggers."""

DEFAULT_ROLLBACK_TRIGGERS = (*DIVERGENCE_SIGNALS, "replica_mismatch")
"""Rollback's default triggers: divergence, and DDP replicas whose weights differ (no LR is to blame for those)."""

UPDATE_BOUND = "update_bound"
"""The signal that takes the backoffs of a restored state back: that state diverged again right after each restore,
at a lower learning rate each time, so its gradients are out of scale, not the rate; ``AutoClip`` bounds every
update from now on. No trigger: ``LRBackoff`` returns to the learning rate of the snapshot."""


@dataclass(frozen=True)
class Signal:
    """A detector's report for this training batch, identical on every rank.

    Attributes:
        kind: one of :data:`SIGNAL_KINDS`.
        step: the ``global_step`` of the optimizer step concerned.
        reason: a sentence for messages and the journal.
        source: the callback that raised it.
        optimizer_index: the optimizer concerned.
        onset: the first step whose state the evidence implicates (``None``: the step of the signal); a rollback
            goes to a snapshot taken at or before it.
    """

    kind: str
    step: int
    reason: str
    source: str
    optimizer_index: int = 0
    onset: int | None = None


@dataclass
class ClipPlan:
    """Gradients to scale, and by what: ``(tensors, coefficient)`` pairs, where a coefficient is a host float (one
    for all the tensors of the pair) or a device tensor of per-tensor factors.

    Attributes:
        scales: the scaling operations, applied in order.
        coef: the overall coefficient for telemetry (1.0 = untouched).
        threshold: the threshold applied (for telemetry).
    """

    scales: list[tuple[list[Tensor], float | list[Tensor]]]
    coef: float
    threshold: float


@dataclass(frozen=True)
class Verdict:
    """One participant's judgement of one optimizer step.

    Attributes:
        skip: why the step must be a no-op (``None``: no objection).
        clip: a proposed clip of the gradients (``None``: none).
    """

    skip: str | None = None
    clip: ClipPlan | None = None


@dataclass
class StepAction:
    """The decision for one optimizer step.

    Attributes:
        skip_reason: why the step is skipped (``None``: it goes ahead).
        skipped_by: the participant whose request is recorded (``None`` when not skipped).
        clips: the clips to apply, with the participant that proposed each (empty when skipped).
    """

    skip_reason: str | None = None
    skipped_by: Any = None
    clips: list[tuple[Any, ClipPlan]] = field(default_factory=list)

    @property
    def skipped(self) -> bool:
        return self.skip_reason is not None

    def clip_of(self, participant: Any) -> ClipPlan | None:
        """The clip applied on behalf of ``participant`` (``None`` if it proposed none or the step was skipped)."""
        for owner, plan in self.clips:
            if owner is participant:
                return plan
        return None


def decide_step(verdicts: Sequence[tuple[Any, Verdict | None]]) -> StepAction:
    """One action from the verdicts of every participant, given in pipeline order."""
    for participant, verdict in verdicts:
        if verdict is not None and verdict.skip is not None:
            return StepAction(skip_reason=verdict.skip, skipped_by=participant)
    clips = [(p, v.clip) for p, v in verdicts if v is not None and v.clip is not None]
    return StepAction(clips=clips)
