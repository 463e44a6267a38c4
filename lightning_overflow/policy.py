"""What the suite does about a step and about a batch, decided in one place: the escalation ladder.

The ladder (signal -> rung), with the reason for each rule:

=========================  ==========================================  ============================================
signal (who raises it)     rung of the default interventions           why
=========================  ==========================================  ============================================
``nonfinite``              skip the step (NonFiniteDetector)           one bad batch: a true no-op costs nothing
(NonFiniteDetector)                                                    else; never the LR, never the weights
``nonfinite_burst``        none by default                             a corrupt sample that comes back every short
                                                                       epoch is a burst and still only data
``nonfinite_persistent``   back off the LR and roll back               steps stay non-finite on clean batches: the
                                                                       state, not the data, produces them
``nonfinite_state``        back off and roll back                      inf/NaN weights or moments never heal
``scaler_collapse``        back off and roll back                      the GradScaler cannot find a finite scale
``loss_spike``,            none by default (journaled)                 one spike is one batch, or a clip already
``grad_spike``                                                         neutralised it
``loss_divergence``        back off and roll back to a snapshot from   the loss stays above its reference (its
(LossSpikeDetector)        before the losses judged (later ones        statistics, or an absolute anchor) for
                           dropped)                                    several steps: the state degrades
``loss_divergence``        back off and roll back to a snapshot from   the level of the healthy losses settled far
(level test)               before the losses its level averages        above the best level the run reached (2x it
                           (later ones dropped)                        and half the progress given back), or at 2x
                                                                       the first losses, beyond 3 standard errors of
                                                                       the losses' scatter, and in most of the
                                                                       confirming losses too: a collapsed state does
                                                                       not come back at this LR (a state restored
                                                                       above the bound is judged against the first
                                                                       loss until it trained back within)
``loss_trend``             back off and roll back to a snapshot from   a slow rise with no spike and no NaN
                           before the window (later ones dropped)
``weight_growth``          back off and roll back to a snapshot from   the weight norm grew 2x within 50 steps while
(LossSpikeDetector)        before the growth (later ones dropped)      the loss did not fall and stood above its
                                                                       best, or single losses ran beyond 10x the
                                                                       anchor: updates that overshoot without
                                                                       overflowing; weights that grow as the loss
                                                                       falls (a small initialisation) are learning
``replica_mismatch``       roll back (every rank to the same           DDP replicas whose weights differ: silent
(NonFiniteDetector)        snapshot)                                   data corruption, no fault of the LR
``data_shift``             undo the backoff made for the divergence;   after a rollback for a loss divergence, the
(LossSpikeDetector)        the loss statistics start again             restored weights (kept while the loss was
                                                                       low) are as bad on the next batches, measured
                                                                       without a step: the data changed, not the
                                                                       state
``update_bound``           clip every update to 1% of the weight norm  the same snapshot, restored twice, diverged
(AutoClip)                 (halved at each further return); take the   again within 10 steps each time, at a lower LR,
                           backoffs since the snapshot back            after updates beyond 1% of its weight norm:
                                                                       its gradients are out of scale (a first
                                                                       gradient of 1e8), which no rate halving
                                                                       reaches; the bound holds every step, so the
                                                                       lower rate would only slow the run
=========================  ==========================================  ============================================

A divergence after a rollback is new evidence about the restored state: the rollback ends LRBackoff's cooldown,
so it backs off again at once; in ``default_callbacks()`` a backoff within two snapshot intervals of the previous
one applies the factor twice (the backed-off LR did not hold: half of it was not enough). A rollback whose
settings differ from the previous rollback's (the LR backed off since) is progress and spends none of Rollback's
budget; only retries with nothing changed do. After ``max_rollbacks`` such retries within Rollback's window, or the
LR at LRBackoff's floor (``min_scale``, about ten halvings), the run stops with
:class:`~lightning_overflow.DivergenceError`.

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
    "DATA_SHIFT",
    "DEFAULT_BACKOFF_TRIGGERS",
    "DEFAULT_ROLLBACK_TRIGGERS",
    "DIVERGENCE_SIGNALS",
    "SIGNAL_KINDS",
    "UPDATE_BOUND",
    "ClipPlan",
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

DEFAULT_BACKOFF_TRIGGERS = DIVERGENCE_SIGNALS
"""LRBackoff's default triggers."""

DEFAULT_ROLLBACK_TRIGGERS = (*DIVERGENCE_SIGNALS, "replica_mismatch")
"""Rollback's default triggers: divergence, and DDP replicas whose weights differ (no LR is to blame for those)."""

DATA_SHIFT = "data_shift"
"""The signal that takes a divergence back: the weights restored from before it are as bad on the current data, so
the data changed, not the state. No trigger: ``LRBackoff`` undoes the backoff it made for the divergence."""

UPDATE_BOUND = "update_bound"
"""The signal that takes the backoffs of a restored state back: that state diverged again right after each restore,
at a lower learning rate each time, so its gradients are out of scale, not the rate; ``AutoClip`` bounds every
update from now on. No trigger: ``LRBackoff`` returns to the learning rate of the snapshot."""


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
