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
starting level, or has come back up     last progress (for a run that never    from, and damages the state it holds
to it since, and made no progress in    learned, the fit's first) at the       (a lower rate from there does not
``NO_PROGRESS_STEPS`` healthy steps     backed-off rate against the run as     learn either); a slow starter about
(``no_progress``)                       it is; once the run restarted from     to learn ties, and goes on as it is;
                                        there, the current state               a restarted run learned since; a
                                        (``RESTART_ONCE``)                     relapse lost what the run learned
none, every ``every_n_steps``           a trial of the backed-off rate from    a rate too high for a run that did
(opt-in), twice as long after each      the current state, kept only by a      learn (it plateaus above what a lower
trial that kept the rate                gain of ``SCHEDULED_MIN_GAIN``         rate reaches) raises no suspicion; a
                                                                               lower rate does a little better on
                                                                               healthy runs too (annealing)
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
    "AGC_EPS",
    "ANCHOR_STEPS",
    "BURST_COUNT",
    "BURST_WINDOW",
    "CERTAIN_SIGNALS",
    "CLIP_EVENT_BELOW",
    "CLIP_REBASELINE_AFTER",
    "CONFIRM_STEPS",
    "DEFAULT_BACKOFF_TRIGGERS",
    "DEFAULT_LOSS_SCALE",
    "DEFAULT_ROLLBACK_TRIGGERS",
    "DIVERGENCE_SIGNALS",
    "GRAD_RATIO",
    "GROWTH_FACTOR",
    "GROWTH_PROGRESS",
    "GROWTH_RUNAWAY_FACTOR",
    "GROWTH_WINDOW",
    "HEADROOM_WARN_DECADES",
    "LEVEL_FACTOR",
    "LEVEL_SIGMAS",
    "LEVEL_WINDOW",
    "LOSS_RATIO",
    "MAX_SCALER_OVERFLOWS",
    "MAX_SKIPPED_SHARE",
    "MIN_LOSS_SCALE",
    "MIN_RISE",
    "NO_PROGRESS_LEVEL",
    "NO_PROGRESS_MARGIN",
    "NO_PROGRESS_STEPS",
    "PERCENTILE_WINDOW",
    "PERSIST_AFTER",
    "REGROWTH",
    "REMOVED_SETTINGS",
    "REMEDY_RISE",
    "RESTART_ONCE",
    "RESTART_STEPS",
    "ROLLBACK_WINDOW",
    "RUNAWAY_FACTOR",
    "SCHEDULED",
    "SCHEDULED_MIN_GAIN",
    "SIGNAL_KINDS",
    "SKIP_WINDOW",
    "SPIKE_REBASELINE_AFTER",
    "SUSPICION_SIGNALS",
    "TAKEOVER_LOSSES",
    "TREND_MARGIN",
    "TREND_PROBABILITY",
    "TREND_WINDOW",
    "TRIAL_JUDGED_SHARE",
    "TRIAL_MIN_GAIN",
    "TRIAL_SIGMAS",
    "TRIAL_STEPS_FACTOR",
    "UPDATE_BOUND",
    "UPDATE_RATIO",
    "WARMUP_ANCHOR_FACTOR",
    "WARMUP_ANCHOR_STEPS",
    "WINDOW_GROWTH",
    "ZSCORE_ALPHA",
    "ZSCORE_MIN_RATIO",
    "ClipPlan",
    "Signal",
    "StepAction",
    "Verdict",
    "at_floor",
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
    "loss_divergence", "loss_trend", "no_progress", "weight_growth", "scaler_collapse"
)
"""Evidence that the state may diverge, or may not learn at its rate: tried where a trial can run, answered at once
where none can (by the interventions whose triggers name it)."""

TRIAL_STEPS_FACTOR = {"no_progress": 2}
"""Suspicions whose first trial runs this many times ``TrialConfig.steps``: its remedy starts from before the run
stopped making progress, often the fit's start, and needs longer to show where it goes (a post-norm transformer at 8x
its stable rate, started again at half of it: 3% lower losses than the run as it is over steps 10-20, 13% over
40-50)."""

RESTART_ONCE = frozenset({"no_progress"})
"""Suspicions whose remedy restarts from a snapshot only once: where the snapshot it would start from is no newer
than the one the run last restarted from (a kept remedy or a rollback), the run has learned from there at a lower
rate, and a stall since is tried from the current state at a lower rate still. Going back again throws that learning
away: a post-norm transformer at 40x its stable rate, restarted at step 163 and stalled again at 232, tried again
from the fit's start ends at 2.2x its reference loss; tried from where it stood, at 1.6x (seeds 0-5 of every set of
the rescue benchmark, 492 runs: no run crossed its reference either way)."""

REMEDY_RISE = 2.0
"""A kept remedy that started from a snapshot and whose loss level rose this many times over its own trial (the median
of its last third of the trial's losses against that of its first third) diverged too, only less than the run it
replaced: the next rung of the ladder restarts from the same snapshot at the lower rates, instead of going on from the
state the remedy damaged. A deep ReLU net drawn at 1.7x Kaiming's scale ended at 3.26 and 3.24 (10x its reference)
without it, 0.73 and 0.54 with it (the held-out set of the rescue benchmark; the other 414 runs of its four sets
unchanged, bit for bit); SGD at 30x its rate over 48 steps, at 1.8e4 against 1.2. A remedy that learned falls over its
trial."""

NO_PROGRESS_STEPS = 50
"""Healthy steps without progress that make a run suspected of not learning: a run that learns makes a new low by the
margin twice or more within it (a post-norm transformer at its stable rate: one every 25 steps or fewer), and a run that
never learned keeps most of its budget for the lower rate. A slow starter flat for longer ties its trial, at the cost
of its steps (the rescue benchmark's, flat for 150 of 400 steps: one trial, 80 extra steps)."""

NO_PROGRESS_MARGIN = 0.05
"""Progress: a new low of the loss level by this share of the starting level; the level of a run stalled at a high
rate still creeps down (1-2% of its start in 50 steps), one that learns falls 10% or more."""

NO_PROGRESS_LEVEL = 0.5
"""Once the loss level has come down to this share of its starting level, the run has learned: the test stops, so a
converged run (at a tenth of its start, or a harder task after a change of data) is not suspected below its start.
It runs again from a relapse, the level back up at the start (what the run learned is lost), and then only a new low
below the last one before it is progress: SGD at 3x its stable rate that swung back above its start ended at 8.5x its
reference, tried 50 steps after the relapse at 1.05x (the rescue benchmark, every set, seeds 0-5: four more runs
ended lower, within their reference before and after, and none higher)."""

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
        retry: a follow-up's remedy from the snapshot a kept remedy started from, at lower rates than that remedy's
            (``REMEDY_RISE``): that snapshot again is no repeat of the last rollback.
    """

    kind: str
    step: int
    reason: str
    source: str
    optimizer_index: int = 0
    onset: int | None = None
    retry: bool = False


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


def at_floor(scale: float, floor: float) -> bool:
    """Whether a backoff's scale has come down to its floor (``LRBackoff(min_scale=...)``), where a suspicion is left
    alone: the scale is a product of factors, which may round a hair above the floor it equals.

    Example:
        >>> at_floor(0.5 ** 10, 0.5 ** 10), at_floor(0.5 ** 9, 0.5 ** 10)
        (True, False)
    """
    return scale <= floor * (1 + 1e-9)


# ---- Fixed values ---------------------------------------------------------------------------------------------
# The detectors' and interventions' thresholds that are no setting: each was measured on the rescue benchmark (healthy
# runs beside the faults) and is the value every configuration of the suite uses. A callback reads each as a class
# attribute named as the setting it replaces; a setting of an earlier release that names one is refused at
# construction with the value it now has (see ``REMOVED_SETTINGS``).

# NonFiniteDetector
MAX_SCALER_OVERFLOWS = 20
"""Consecutive GradScaler overflows taken as calibration: the scale falls from 65536 to 1 in 16."""
DEFAULT_LOSS_SCALE = 2.0**16
"""GradScaler's default initial scale: overflows at a scale above it are calibration however many, since a scaler
started higher halves down to it first (``init_scale=2**40``: 24 overflows more, none of them a divergence)."""
MIN_LOSS_SCALE = 1e-4
"""A GradScaler scale below this is a detection (``scaler_collapse``)."""
BURST_COUNT, BURST_WINDOW = 3, 50
"""Detections within optimizer steps that make a burst (``nonfinite_burst``); an isolated one is absorbed by the skip
alone: one corrupt sample must not cost the learning rate."""
PERSIST_AFTER = 3
"""Consecutive non-finite steps on clean batches after which the state, not the data, produces them
(``nonfinite_persistent``)."""
MAX_SKIPPED_SHARE, SKIP_WINDOW = 0.5, 20
"""The skip budget: more than this share of the last optimizer steps skipped (not counting data faults) is a run that
does not train, in a row or not (``nonfinite_persistent``)."""
HEADROOM_WARN_DECADES = 20.0
"""Warn when the largest magnitude of a step comes within this many decades of FP32's limit: below about 19.3 any
square of the value (a variance, an L2 norm, an MSE) overflows."""

# LossSpikeDetector
LOSS_RATIO, GRAD_RATIO = 1.2, 2.0
"""A spike also exceeds its mean by this ratio (loss; the heavier-tailed gradient norm): a near-constant series, whose
sigma is close to 0, does not call every wobble a spike."""
SPIKE_REBASELINE_AFTER = 100
"""Consecutive spikes of one series after which its level has moved (new data): its statistics restart."""
CONFIRM_STEPS = 3
"""Consecutive steps above the reference before the loss counts as diverging: one spike is one bad batch, or one a
clip already neutralised."""
RUNAWAY_FACTOR = 100.0
"""A loss above this many times the anchor is above its reference whatever the statistics say: a run diverging
inside the warm-up, or one whose statistics drifted along."""
ANCHOR_STEPS = 8
"""Finite losses whose median (at most the first) is the run's anchor, its starting level."""
MIN_RISE = 0.1
"""A loss spike, and a trend, must also rise this many times the anchor, and a level far above its best stand this
many times it: a loss that sat at 0 and rises a little is no spike."""
TREND_WINDOW, TREND_PROBABILITY, TREND_MARGIN = 200, 0.999, 0.5
"""The trend test: every ``TREND_WINDOW`` healthy losses, ``P(slope > 0)`` of their least-squares line above
``TREND_PROBABILITY`` (dlib's trainer) with the window's mean ``TREND_MARGIN`` times above the best window mean: a loss
that plateaus higher after a change of data is no divergence."""
LEVEL_WINDOW, LEVEL_FACTOR, LEVEL_SIGMAS = 20, 2.0, 3.0
"""The level test: the moving level of ``LEVEL_WINDOW`` healthy losses above ``LEVEL_FACTOR`` times the best level
(or the anchor, where that is lower) and ``MIN_RISE`` times the anchor, averages allowed ``LEVEL_SIGMAS`` standard
errors of chance. A harmless rise (new data, a harder task) that passes it is a trial's false alarm, whose tie leaves
the run as it is. Also asking that half the progress from the anchor be given back left SGD at 2x its stable rate
swinging back to 3x its best: without it, 5 more runs of the rescue benchmark's held-out sets within reference and no
harmless run moved; at 1.5x instead of 2x, a harmless level change ended 6% worse."""
GROWTH_WINDOW, GROWTH_FACTOR, GROWTH_PROGRESS, GROWTH_RUNAWAY_FACTOR = 50, 2.0, 0.2, 10.0
"""The weight-growth test: the weight norm grew ``GROWTH_FACTOR`` times within ``GROWTH_WINDOW`` steps while the loss
median did not fall by ``GROWTH_PROGRESS``, or a loss ran beyond ``GROWTH_RUNAWAY_FACTOR`` times the anchor (at a
stable rate the runs measured grow theirs at most 1.25x in 50 steps)."""

# AutoClip
PERCENTILE_WINDOW = 1000
"""``"percentile"`` mode: recent norms kept (the paper keeps all)."""
ZSCORE_ALPHA = 0.97
"""``"zscore"`` mode: the EMA's smoothing factor (ZClip's)."""
WARMUP_ANCHOR_FACTOR, WARMUP_ANCHOR_STEPS = 10.0, 3
"""``"zscore"`` mode: during the warm-up, the norm is capped at this many times the median of the first norms;
healthy runs stay within 6x of their first norms there."""
ZSCORE_MIN_RATIO = 5.0
"""``"zscore"`` mode: after the warm-up the threshold is at least this many times the running mean; small noisy
batches put about one healthy step in a hundred at 3-5x the mean, and clipping those protects nothing."""
AGC_EPS = 1e-3
"""``"agc"`` mode: the floor on a unit's weight norm (the paper's), so zero-initialised weights still move."""
CLIP_EVENT_BELOW = 0.1
"""A clip that shrinks the gradients more than tenfold neutralised its batch: it is journaled (at most once every
``AutoClip.EVENT_GAP``), and that step's loss tells of the batch, not of the weights (the weight-growth test leaves
it out)."""
UPDATE_RATIO, RESTART_STEPS = 0.01, 10
"""The update bound: armed when a restored state diverged again within ``RESTART_STEPS`` steps after updates beyond
``UPDATE_RATIO`` times its weight norm; then ``lr x norm`` is held within that share of the weights."""
CLIP_REBASELINE_AFTER = 3
"""``"zscore"`` mode: steps in a row clipped by the statistics that make a new level, not outliers: without it a task
whose targets grow 3x is clipped for 160 steps and ends 1.11x the unprotected run; with it within 1.05x."""

# LRBackoff
WINDOW_GROWTH = 2.0
"""A backoff soon after a regrowth doubles the steps the next regrowth waits: it came too early."""

# Rollback
ROLLBACK_WINDOW = 1000
"""The optimizer steps within which ``max_rollbacks`` counts rollbacks."""

# Trials
TAKEOVER_LOSSES = 3
"""A trial ended by a certain fault (or by the fit's end, the run as it is inf/NaN) hands the run to the remedy whose
last this many losses were finite and lowest: one finite loss can be luck, a whole trial's are not all there yet."""
TRIAL_SIGMAS, TRIAL_MIN_GAIN, TRIAL_JUDGED_SHARE = 2.0, 0.02, 0.5
"""A remedy wins by more than ``TRIAL_SIGMAS`` standard errors of the paired differences and a mean of
``TRIAL_MIN_GAIN`` (a loss about 4% lower), judged on the last ``TRIAL_JUDGED_SHARE`` of the trial's pairs: its first
batches measure where an older state starts from, the last ones where each candidate is going."""
SCHEDULED_MIN_GAIN = 0.2
"""A scheduled trial's remedy wins only by a mean of this much (a loss about a third lower): no suspicion chose the
moment, and a lower rate does a little better on most healthy runs for a while (annealing). ``default_callbacks()``
with scheduled trials every 100 steps, rescue benchmark, seeds 0-2: with the suspicions' ``TRIAL_MIN_GAIN`` 12 of the
main matrix's 18 stable runs kept a lower rate and 5 of its 27 harmless runs ended beyond 1.05x their unprotected
run; with this, 5 of the 30 stable runs of the main and hard matrices kept one (within 1.02x of their evaluation),
no harmless run moved beyond 1.05x, and SGD at 2-3x its stable rate (a plateau that clipping every step fixes) is
rescued (main matrix 97 to 99 runs within reference, held-out 58 to 60)."""

REMOVED_SETTINGS = {
    "NonFiniteDetector": {"max_scaler_overflows": "MAX_SCALER_OVERFLOWS", "min_loss_scale": "MIN_LOSS_SCALE",
                          "burst_count": "BURST_COUNT", "burst_window": "BURST_WINDOW",
                          "persist_after": "PERSIST_AFTER", "max_skipped_share": "MAX_SKIPPED_SHARE",
                          "skip_window": "SKIP_WINDOW", "headroom_warn_decades": "HEADROOM_WARN_DECADES"},
    "LossSpikeDetector": {"loss_ratio": "LOSS_RATIO", "grad_ratio": "GRAD_RATIO",
                          "rebaseline_after": "SPIKE_REBASELINE_AFTER", "confirm_steps": "CONFIRM_STEPS",
                          "runaway_factor": "RUNAWAY_FACTOR", "anchor_steps": "ANCHOR_STEPS", "min_rise": "MIN_RISE",
                          "trend_window": "TREND_WINDOW", "trend_probability": "TREND_PROBABILITY",
                          "trend_margin": "TREND_MARGIN", "level_window": "LEVEL_WINDOW",
                          "level_factor": "LEVEL_FACTOR", "level_fraction": None,
                          "level_sigmas": "LEVEL_SIGMAS", "growth_window": "GROWTH_WINDOW",
                          "growth_factor": "GROWTH_FACTOR", "growth_progress": "GROWTH_PROGRESS",
                          "growth_runaway_factor": "GROWTH_RUNAWAY_FACTOR",
                          "plateau_steps": None},
    "AutoClip": {"window": "PERCENTILE_WINDOW", "alpha": "ZSCORE_ALPHA", "anchor_factor": "WARMUP_ANCHOR_FACTOR",
                 "anchor_steps": "WARMUP_ANCHOR_STEPS", "min_ratio": "ZSCORE_MIN_RATIO", "eps": "AGC_EPS",
                 "event_below": "CLIP_EVENT_BELOW", "update_ratio": "UPDATE_RATIO", "restart_steps": "RESTART_STEPS",
                 "rebaseline_after": "CLIP_REBASELINE_AFTER"},
    "LRBackoff": {"window_growth": "WINDOW_GROWTH", "escalate_within": None, "min_lr": None, "per_optimizer": None},
    "Rollback": {"window": "ROLLBACK_WINDOW", "skip_batches": None},
    "TrialConfig": {"sigmas": "TRIAL_SIGMAS", "min_gain": "TRIAL_MIN_GAIN", "judged_share": "TRIAL_JUDGED_SHARE"},
}  # fmt: skip
"""The settings of earlier releases, by the callback that had them: the constant that holds the value now, or
``None`` for an option gone with its feature (the loss plateau test, which measured 5 of 18 long healthy runs better
at a lower rate, left to ``no_progress`` and scheduled trials; the escalation of a backoff and the absolute LR floor,
which no configuration of the benchmark used; batches skipped after a rollback, which restoring already answers; one
backoff for every optimizer together, where each optimizer's own signals are the evidence; the level test's second
condition, half the progress given back, which trials made unnecessary: see ``LEVEL_FACTOR``)."""
