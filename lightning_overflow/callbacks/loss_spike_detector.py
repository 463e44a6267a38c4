"""LossSpikeDetector: statistical spikes of the training loss and of the gradient norm, against NaN-safe statistics."""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytorch_lightning as pl
from typing_extensions import override

from lightning_overflow._validation import check_bool, check_float, check_int, refuse_removed
from lightning_overflow.callback_state import StateReader, versioned
from lightning_overflow.callbacks._base import DETECTOR, SuiteCallback
from lightning_overflow.health import StepHealth
from lightning_overflow.numerics import parameters_of
from lightning_overflow.numerics.growth import WeightGrowth
from lightning_overflow.numerics.norms import squared_norm_share
from lightning_overflow.numerics.running_stats import HostRunningStats
from lightning_overflow.numerics.trend import Progress, loss_scatter, slope_probability
from lightning_overflow.policy import (
    ANCHOR_STEPS,
    CLIP_EVENT_BELOW,
    CONFIRM_STEPS,
    GRAD_RATIO,
    GROWTH_FACTOR,
    GROWTH_PROGRESS,
    GROWTH_RUNAWAY_FACTOR,
    GROWTH_WINDOW,
    LEVEL_FACTOR,
    LEVEL_SIGMAS,
    LEVEL_WINDOW,
    LOSS_RATIO,
    MIN_RISE,
    NO_PROGRESS_LEVEL,
    NO_PROGRESS_MARGIN,
    NO_PROGRESS_STEPS,
    REMOVED_SETTINGS,
    RUNAWAY_FACTOR,
    SPIKE_REBASELINE_AFTER,
    TREND_MARGIN,
    TREND_PROBABILITY,
    TREND_WINDOW,
    StepAction,
)
from lightning_overflow.trials import TrialOutcome

__all__ = ["LossSpikeDetector"]

_CHANNELS = ("loss", "grad_norm")
_SCATTER_WINDOWS = 5  # the level test's scatter is measured over this many of its windows of losses
_SIGNALS = {"loss": "loss_spike", "grad_norm": "grad_spike"}
_WHAT = {"loss": "the training loss", "grad_norm": "the gradient norm"}


class LossSpikeDetector(SuiteCallback):
    """Find statistical spikes of the training loss and of the total gradient norm, and report them.

    A monitor: it changes nothing in training. Interventions act on its signals (``LRBackoff`` halves the learning
    rate, ``Rollback`` restores the last finite state).

    Each optimizer step is tested against running statistics of the steps before it: an exponential moving
    average and standard deviation with the span of ``window`` steps. A value is a spike when it exceeds the mean by
    ``sigmas`` standard deviations **and** by ``ratio - 1`` times the mean::

        spike  <=>  value > mean + max(sigmas * std, (ratio - 1) * |mean|)

    Non-finite values (left to ``NonFiniteDetector``) never enter the statistics, nor do gradient norms beyond the
    FP32 range (3.4e38: finite gradients that ``NonFiniteDetector`` treats as an overflow; they are still tested),
    nor spikes, so a diverging run cannot raise its own threshold. After ``SPIKE_REBASELINE_AFTER`` consecutive spikes
    the level itself has moved (a new data mixture, a deliberate change of the schedule): the statistics of that
    series start again, with a new warm-up, and the event is journaled.

    The loss is the mean finite training loss of the step over its micro-batches and all ranks, and the gradient
    norm is taken after the DDP all-reduce (both gathered by the suite's one read per step), so every rank decides
    the same thing at the same step, at no extra cost. With several optimizers (manual optimization) each
    optimizer's step has its own statistics: a GAN's generator and discriminator losses are different series.

    Why these defaults (compared with what large runs use):

    - llm-foundry's ``KillLossSpike`` flags a loss above **2x** the mean of a 100-step window. On a small-batch
      run one batch's loss is routinely several times the mean (a healthy 500-step run at batch size 2 reaches
      7x), so a pure ratio cries wolf there; on a large-batch language model whose loss sits at 3.0 with a
      step-to-step spread of a few hundredths, 2x misses a spike to 5.0.
    - Megatron-LM's rerun machinery flags a loss **10x** above its recent values: only catastrophes.
    - OLMo-core flags **mean + 6 sigma over 128 steps**: the z-score adapts to the noise of each run. Healthy small
      runs (loss and gradient norm, noisy small batches, dropout, a GAN) peak at 4.2 sigma, so 6 leaves room. The
      defaults are OLMo-core's 6 sigma and span of 128 steps, plus a small ratio (1.2x for the loss, 2x for the
      heavier-tailed gradient norm) so that a near-constant series, whose sigma is close to 0, does not call every
      wobble a spike.

    Args:
        window: span of the moving statistics, in optimizer steps (default 128, OLMo-core's window).
        warmup: values each series takes in before it is tested (default 50: early training is where losses fall
            fastest and where statistics are thinnest).
        sigmas: standard deviations above the mean for a spike (default 6).
        check_grad_norm: also test the gradient norm (default ``True``; signal ``grad_spike``).
        growth_every_n_steps: how often the weight-growth test samples the norm of the weights (default 10; ``None``
            disables the test; at most ``GROWTH_WINDOW``). The sample joins the step's one read.

    The tests behind the signals; their thresholds are constants of :mod:`lightning_overflow.policy` (no settings),
    named here in capitals:

    - **Spikes**: a loss must also exceed ``LOSS_RATIO`` (1.2) times its mean (for a negative loss the margin is
      ``(LOSS_RATIO - 1) * |mean|``), a gradient norm ``GRAD_RATIO`` (2) times its mean, and a loss its mean by
      ``MIN_RISE`` (0.1) times the anchor, so that a loss that sat at exactly 0 and rises a little is no spike. After
      ``SPIKE_REBASELINE_AFTER`` (100) consecutive spikes of one series its statistics restart from the new level.
    - **Divergence**: ``CONFIRM_STEPS`` (3) consecutive steps whose loss stays above its reference (the spike
      threshold, or the runaway bound). A single spike is one bad batch, or one that a clip already neutralised: it
      is journaled, and signals ``loss_spike`` only. A loss above ``RUNAWAY_FACTOR`` (100) times the run's anchor (the
      median magnitude of its first ``ANCHOR_STEPS`` (8) finite losses, and at most the first one) is above its
      reference whatever the statistics say: the absolute anchor that catches a run diverging inside the warm-up, or
      one whose statistics drifted along.
    - **Trend**: every ``TREND_WINDOW`` (200) healthy losses, ``P(slope > 0)`` of their least-squares line above
      ``TREND_PROBABILITY`` (0.999, the test of dlib's trainer), with the window's mean ``TREND_MARGIN`` (0.5) times
      above the best window mean so far (a loss that plateaus higher after a change of data is no divergence) and
      ``MIN_RISE`` times the anchor above it (a hinge loss at 1e-6 that creeps to 5e-5, or one that has fallen a
      hundredfold and creeps back by a fraction of a percent of its first losses, is no divergence).
    - **Level**: the moving level of the healthy losses (the mean of the first ``LEVEL_WINDOW`` (20), then their
      exponential moving average) stands far above its best when it exceeds ``LEVEL_FACTOR`` (2) times the best level:
      ``level > max(LEVEL_FACTOR * min(best, anchor), MIN_RISE * anchor)``; a run that never went below its anchor is
      thus measured against twice its first losses, and a level below a tenth of the anchor is never far above its best
      (a loss that sat at 0 and rises a little). Held for ``CONFIRM_STEPS`` consecutive healthy steps, with most of
      those steps' own losses above the bound too (one outlier that the spike test let through lifts the level for many
      steps), that is divergence (``loss_divergence``): a run whose loss went down and settles back up at a collapsed
      level (its predictor dead, its moments blown) is not coming back at this learning rate. A harmless rise as large
      (new data, a harder task) is a trial's false alarm: the run goes on as it is. Averages are allowed
      ``LEVEL_SIGMAS`` (3) standard errors of chance, measured by the scatter of the healthy losses when the best level
      was reached, so a run whose losses scatter widely but whose mean does not move never stands far above its best.
      The level starts again after the signal and after a rollback; the best level stays. A state restored above the
      bound (the fit's first snapshot) is on its way down, not diverged: until its level has come back within the bound
      it is judged against the fit's first loss instead. With several optimizers (manual optimization) the test is off:
      each loss is one player's in a game. It is off as well while the anchor is 0 and once the level went negative (a
      log-likelihood: no ratio means anything).
    - **Weight growth** (:class:`~lightning_overflow.numerics.growth.WeightGrowth`): a learning rate far too high can
      overshoot without overflowing or spiking: the weights grow step after step while the loss hovers where it
      began. Signal ``weight_growth`` when the weight norm grew ``GROWTH_FACTOR`` (2) times or more within
      ``GROWTH_WINDOW`` (50) steps while the median of the losses did not fall by ``GROWTH_PROGRESS`` (0.2) and stands
      10% above the best median since the test started, or a loss since the window's first sample ran beyond
      ``GROWTH_RUNAWAY_FACTOR`` (10) times the anchor (not the loss of a step whose gradients a clip shrank more than
      tenfold: that batch was an outlier the clip neutralised). Weights that grow out of a small initialisation as
      the loss falls are learning, not divergence. The signal names the window's start, so ``Rollback`` returns to a
      snapshot from before the growth. Off with several optimizers; it measures every parameter of the optimizer,
      and starts again after a finding, after a rollback and when parameters join the optimizer. Measured: Adam at
      12-16x its stable rate grows its weights 4-6x in 10 steps with single losses 21-325x the anchor; at a stable
      rate the runs measured grow theirs at most 1.25x in 50 steps.

    Signals (read by interventions): ``loss_divergence`` when the loss stays above its reference for
    ``CONFIRM_STEPS`` steps, ``loss_trend`` for a slow rise with no spike, ``weight_growth`` for weights that run
    away while the loss does not fall, ``loss_spike`` and ``grad_spike`` at the first step of a spike and again at
    each step that climbs above the highest value of the same spike. The default interventions act on
    ``loss_divergence``, ``loss_trend`` and ``weight_growth``: the evidence that the training state itself degrades;
    a spike alone is the batch's business.

    ``no_progress`` when the run does not learn: its level (see **Level**) has not come down to half the
    anchor of its first losses and has made no new low by 5% of that anchor in 50 healthy steps (the constants
    ``NO_PROGRESS_*`` of :mod:`lightning_overflow.policy`, no setting). A learning rate too high that never overflows
    leaves the loss at its start, or stalled far above what the run could reach, with no best to diverge from. Only a
    suspicion: where trials run, it opens one from the snapshot before the last progress (the fit's first, for a run
    that never learned) at the backed-off rates, twice the usual length; a slow starter about to learn ties it and
    goes on as it is. The test is off where the level test is, and once the level has come down to half the anchor it
    stops, so a run that learned is not suspected of it again (not after a change of data either) unless its level
    comes back up to the anchor: a relapse, from which only a new low below the last one is progress; a false alarm
    keeps the anchor and restarts the clock. Measured on the rescue benchmark: post-norm transformers at 8-25x
    their stable rate, none of whose runs any method kept within 1.5x of the stable run's loss before, end within
    1.2x of it (at 40x, 1.5-2.2x instead of 3.6x); every harmless run ends where it did, its trials all ties.

    Attributes:
        spikes: spikes found so far (loss and gradient norm).
        loss_spikes, grad_spikes: the same, by series.

    Logged keys:

    ===================  ===========================================
    key                  meaning
    ===================  ===========================================
    ``overflow/spikes``  cumulative spikes (loss and gradient norm)
    ===================  ===========================================

    Each spike is also one ``"spike"`` line in the journal, with the value, the reference mean and standard
    deviation, the threshold it crossed and whether it was rising; a restart of the statistics is a
    ``"rebaseline"`` line.

    Example:
        >>> import pytorch_lightning as pl
        >>> trainer = pl.Trainer(callbacks=[LossSpikeDetector(sigmas=6.0, window=128)], logger=False)
    """

    stage = DETECTOR

    loss_ratio, grad_ratio = LOSS_RATIO, GRAD_RATIO
    rebaseline_after = SPIKE_REBASELINE_AFTER
    confirm_steps = CONFIRM_STEPS
    runaway_factor = RUNAWAY_FACTOR
    anchor_steps = ANCHOR_STEPS
    min_rise = MIN_RISE
    trend_window, trend_probability, trend_margin = TREND_WINDOW, TREND_PROBABILITY, TREND_MARGIN
    level_window, level_factor, level_sigmas = LEVEL_WINDOW, LEVEL_FACTOR, LEVEL_SIGMAS
    growth_window, growth_factor = GROWTH_WINDOW, GROWTH_FACTOR
    growth_progress, growth_runaway_factor = GROWTH_PROGRESS, GROWTH_RUNAWAY_FACTOR

    def __init__(
        self,
        window: int = 128,
        warmup: int = 50,
        sigmas: float = 6.0,
        check_grad_norm: bool = True,
        growth_every_n_steps: int | None = 10,
        **removed: Any,
    ) -> None:
        refuse_removed(LossSpikeDetector, removed, REMOVED_SETTINGS["LossSpikeDetector"])
        self.window = check_int("window", window, minimum=2)
        self.warmup = check_int("warmup", warmup, minimum=1)
        self.sigmas = check_float("sigmas", sigmas, low=0.0, low_open=True)
        self.check_grad_norm = check_bool("check_grad_norm", check_grad_norm)
        self.growth_every_n_steps = check_int("growth_every_n_steps", growth_every_n_steps, minimum=1, optional=True)
        if self.growth_every_n_steps is not None and self.growth_every_n_steps > self.growth_window:
            raise ValueError(
                f"'growth_every_n_steps' must be at most the growth test's window, {self.growth_window} steps: the "
                f"test compares two weight samples within it (got {self.growth_every_n_steps})"
            )
        self._growth: dict[int, WeightGrowth] = {}
        self._evidence: dict[int, DivergenceEvidence] = {}
        self._stats: dict[int, HostRunningStats] = {}
        self._streaks: dict[int, list[int]] = {}
        self._peaks: dict[int, list[float]] = {}
        self.loss_spikes = 0
        self.grad_spikes = 0

    @property
    def state_key(self) -> str:
        try:
            return self._state_key  # built once: Lightning reads it often, its arguments never change
        except AttributeError:
            self._state_key: str = self._generate_state_key(window=self.window, sigmas=self.sigmas)
            return self._state_key

    @property
    def spikes(self) -> int:
        return self.loss_spikes + self.grad_spikes

    # ---- wiring -----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":  # a new fit starts from scratch; a resumed one loads its state right after this
            self._stats.clear()
            self._streaks.clear()
            self._peaks.clear()
            self._evidence.clear()
            self._growth.clear()
            self.loss_spikes = self.grad_spikes = 0

    # ---- the decision -----------------------------------------------------------------------------------------
    def _tests_growth(self, record: StepHealth) -> bool:
        """Whether the weight-growth test runs (with several optimizers it is off, as the level test is: each player
        of a game moves its weights as the game goes)."""
        return self.growth_every_n_steps is not None and record.n_optimizers == 1

    @override
    def _contribute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: StepHealth) -> None:
        if not self._tests_growth(record) or record.step % self.growth_every_n_steps:  # type: ignore[operator]
            return
        # Every parameter the optimizer updates, with a gradient this step or not: the same set at every sample.
        # Each rank's share of their squared norm (its shards, or 1/world of a replica) is summed in the read, so
        # every rank reads the same norm, at no extra collective.
        squares = squared_norm_share(parameters_of(record.optimizer), record.world_size)
        record.add("weight_squares", squares, summed=True)

    @override
    def _after_step(self, trainer: pl.Trainer, record: StepHealth, action: StepAction) -> None:
        """Test this step's loss and gradient norm (host values identical on every rank), then learn from them. A
        skipped step never happened: its values, a rejected batch's, are neither tested nor learned (a target of 1e30
        gave gradient norms of 3e30 that the gradient's statistics took in)."""
        if record.skipped:
            return
        grad = record.total_norm if self.check_grad_norm and record.grads_finite else math.nan
        values = [record.loss_mean, grad]
        stats = self._stats_for(record.optimizer_index)
        evidence = self._evidence.get(record.optimizer_index)
        if evidence is None:  # not setdefault: a new DivergenceEvidence every step would cost more than its use
            evidence = self._evidence[record.optimizer_index] = DivergenceEvidence()
        found = stats.spikes(values, self.sigmas, [self.loss_ratio, self.grad_ratio])
        # A reference of zero mean and zero spread gives no threshold of its own: the anchor sets the least rise.
        found[0] = found[0] and values[0] > stats.mean[0] + self.min_rise * evidence.anchor
        if any(found):
            self._report(trainer, record, stats, values, found)
        # A gradient norm beyond FP32 is an overflow (NonFiniteDetector's fault): tested above, never learned from.
        stats.update(values, include=[not found[0], not found[1] and not record.grads_beyond_fp32])
        self._track_streaks(trainer, record, stats, found, values)
        self._weigh_evidence(trainer, record, evidence, found[0])
        self._weigh_growth(trainer, record, action, evidence)

    def _weigh_evidence(
        self, trainer: pl.Trainer, record: StepHealth, evidence: DivergenceEvidence, spike: bool
    ) -> None:
        """Signal divergence when the loss stays above its reference, or trends up; a lone spike is not enough."""
        finding = evidence.observe(
            record.loss_mean,
            spike=spike,
            anchor_steps=self.anchor_steps,
            runaway_factor=self.runaway_factor,
            confirm_steps=self.confirm_steps,
            trend_window=self.trend_window,
            trend_probability=self.trend_probability,
            trend_margin=self.trend_margin,
            min_rise=self.min_rise,
            # With several optimizers each loss is one player's in a game (a GAN): its level rises as the game goes.
            level_window=self.level_window if record.n_optimizers == 1 else None,
            level_factor=self.level_factor,
            level_sigmas=self.level_sigmas,
            no_progress=record.n_optimizers == 1,
        )
        if finding is None:
            return
        kind, reason = finding
        suffix = f" of optimizer {record.optimizer_index}" if record.n_optimizers > 1 else ""
        message = f"LossSpikeDetector: the training loss{suffix} {reason} at step {record.step}."
        # The losses judged came from the states of the last ``span`` steps (or more, with spikes between them). The
        # first of those states had taken no update from a judged batch: its snapshot may be sound (the data changed,
        # not the state); one taken after it holds the divergence.
        onset = max(0, record.step - evidence.span + 1)
        self._event(trainer, kind, message, loss=record.loss_mean, anchor=evidence.anchor,
                    optimizer=record.optimizer_index, since=onset)  # fmt: skip
        self._signal(trainer, kind, message, record.optimizer_index, onset=onset)

    def _weigh_growth(
        self, trainer: pl.Trainer, record: StepHealth, action: StepAction, evidence: DivergenceEvidence
    ) -> None:
        """Signal divergence when the weights ran away over the growth window while the loss did not fall."""
        if not self._tests_growth(record):
            return
        growth = self._growth.get(record.optimizer_index)
        if growth is None:
            growth = self._growth[record.optimizer_index] = self._new_growth()
        # A batch whose gradients a clip shrank more than tenfold was an outlier the clip neutralised (a poison
        # batch): its loss tells of the batch, not of the weights.
        neutralised = any(plan.coef < CLIP_EVENT_BELOW for _, plan in action.clips)
        runaway = not neutralised and evidence.runaway(record.loss_mean, self.growth_runaway_factor)
        growth.add_loss(record.loss_mean, runaway=runaway)
        if not record.has("weight_squares"):
            return
        size = sum(p.numel() for p in parameters_of(record.optimizer))  # DTensors count their full size
        f = growth.observe(record.step, math.sqrt(record.value("weight_squares")[0]), size)
        if f is None:
            return
        message = (
            f"LossSpikeDetector: the weight norm grew {f.norm / f.norm_before:.3g}x in {f.step - f.since} steps (from "
            f"{f.norm_before:.4g} at step {f.since} to {f.norm:.4g} at step {f.step}) while the training loss did not "
            f"fall (median {f.loss_before:.4g} then, {f.loss:.4g} now) and "
            + (
                f"single losses ran beyond {self.growth_runaway_factor:g}x its starting level {evidence.anchor:.4g}"
                if f.at_best
                else f"stood above the best it had reached ({f.best_loss:.4g})"
            )
            + ": the updates overshoot at this learning rate. HINT: a lower learning rate, or a longer warm-up."
        )
        self._event(trainer, "weight_growth", message, weight_norm=f.norm, weight_norm_before=f.norm_before,
                    loss=f.loss, loss_before=f.loss_before, best_loss=f.best_loss, at_best=f.at_best,
                    since=f.since)  # fmt: skip
        # The weights were sound where the window started: a snapshot from after it holds the runaway weights.
        self._signal(trainer, "weight_growth", message, record.optimizer_index, onset=f.since)

    def _new_growth(self) -> WeightGrowth:
        # The loss median beside each weight sample: the losses of the two sampling intervals before it.
        every = self.growth_every_n_steps or 1
        return WeightGrowth(self.growth_window, self.growth_factor, self.growth_progress, losses_per_sample=2 * every)

    def _stats_for(self, index: int) -> HostRunningStats:
        stats = self._stats.get(index)
        if stats is None:
            stats = self._stats[index] = HostRunningStats(len(_CHANNELS), self.window, self.warmup)
            self._end_spikes(index)
        return stats

    def _end_spikes(self, index: int) -> None:
        """No spike under way in optimizer ``index``'s series: streaks at 0, no peak."""
        self._streaks[index] = [0] * len(_CHANNELS)
        self._peaks[index] = [-math.inf] * len(_CHANNELS)

    def _report(
        self, trainer: pl.Trainer, record: StepHealth, stats: HostRunningStats, values: list[float], found: list[bool]
    ) -> None:
        means, stds = list(stats.mean), stats.std
        thresholds = stats.threshold(self.sigmas, [self.loss_ratio, self.grad_ratio])
        peaks = self._peaks[record.optimizer_index]
        for channel, name in enumerate(_CHANNELS):
            if not found[channel]:
                continue
            rising = values[channel] > peaks[channel]
            peaks[channel] = max(peaks[channel], values[channel])
            if name == "loss":
                self.loss_spikes += 1
            else:
                self.grad_spikes += 1
            suffix = f" of optimizer {record.optimizer_index}" if len(trainer.optimizers) > 1 else ""
            message = (
                f"LossSpikeDetector: {_WHAT[name]}{suffix} was {values[channel]:.4g} at step {record.step} "
                f"(epoch {trainer.current_epoch}), a spike: its reference is {means[channel]:.4g} "
                f"+/- {stds[channel]:.3g} over about {self.window} steps and the threshold {thresholds[channel]:.4g}."
            )
            self._event(
                trainer,
                "spike",
                message,
                what=name,
                value=values[channel],
                reference=means[channel],
                std=stds[channel],
                threshold=thresholds[channel],
                rising=rising,
                optimizer=record.optimizer_index,
            )
            if rising:
                self._signal(trainer, _SIGNALS[name], message, record.optimizer_index)

    def _track_streaks(
        self, trainer: pl.Trainer, record: StepHealth, stats: HostRunningStats, found: list[bool], values: list[float]
    ) -> None:
        streaks = self._streaks[record.optimizer_index]
        peaks = self._peaks[record.optimizer_index]
        for channel, name in enumerate(_CHANNELS):
            streaks[channel] = streaks[channel] + 1 if found[channel] else 0
            if not found[channel] and math.isfinite(values[channel]):
                peaks[channel] = -math.inf  # the episode is over
            if self.rebaseline_after is None or streaks[channel] < self.rebaseline_after:
                continue
            streaks[channel] = 0
            peaks[channel] = -math.inf
            stats.reset([c == channel for c in range(len(_CHANNELS))])
            self._event(
                trainer,
                "rebaseline",
                f"LossSpikeDetector: {_WHAT[name]} stayed above its threshold for {self.rebaseline_after} "
                f"consecutive steps (last value {values[channel]:.4g} at step {record.step}); its statistics start "
                f"again from this level after a warm-up of {self.warmup} steps.",
                what=name,
                value=values[channel],
                optimizer=record.optimizer_index,
            )

    # ---- counters and state -----------------------------------------------------------------------------------
    @override
    def _counters(self) -> dict[str, float]:
        return {"overflow/spikes": float(self.spikes)}

    @override
    def _after_restore(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        # The statistics describe the healthy run before the divergence and stay; the streaks belong to the
        # state that was just undone.
        for index in self._streaks:
            self._end_spikes(index)
        for evidence in self._evidence.values():
            evidence.after_restore()
        for growth in self._growth.values():
            growth.restart()  # the growth of the state just undone

    @override
    def _after_trial(self, trainer: pl.Trainer, outcome: TrialOutcome) -> None:
        """A kept remedy is a restore. A false alarm accepts the run as it is: the series whose evidence raised it
        start again from the current losses (the anchor, the best level, the trend and the spike statistics),
        instead of raising it again against a level the run has left for good (new data, a harder task)."""
        if outcome.kept:
            super()._after_trial(trainer, outcome)
            return
        if not outcome.false_alarm:
            return
        for index, evidence in list(self._evidence.items()):
            self._evidence[index] = evidence.relearned()
            self._stats_for(index).reset()
            self._end_spikes(index)
        for growth in self._growth.values():
            growth.restart()

    @override
    def state_dict(self) -> dict[str, Any]:
        return versioned({
            "stats": {str(i): stats.state_dict() for i, stats in self._stats.items()},
            "streaks": {str(i): list(streaks) for i, streaks in self._streaks.items()},
            "peaks": {str(i): list(peaks) for i, peaks in self._peaks.items()},
            "loss_spikes": self.loss_spikes,
            "grad_spikes": self.grad_spikes,
            "evidence": {str(i): e.state_dict() for i, e in self._evidence.items()},
            "growth": {str(i): g.state_dict() for i, g in self._growth.items()},
        })  # fmt: skip

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = StateReader("LossSpikeDetector", state_dict)
        self._stats.clear()
        self._streaks.clear()
        self._peaks.clear()
        for key, stats_state in state.get("stats", dict).items():
            self._stats_for(int(key)).load_state_dict(stats_state)
        for key, streaks in state.get("streaks", dict).items():
            self._stats_for(int(key))
            self._streaks[int(key)] = [int(s) for s in streaks]
        for key, peaks in state.get("peaks", dict).items():
            self._stats_for(int(key))
            self._peaks[int(key)] = [float(p) for p in peaks]
        self.loss_spikes = state.get("loss_spikes", int)
        self.grad_spikes = state.get("grad_spikes", int)
        self._evidence = state.get("evidence", lambda v: {int(k): DivergenceEvidence.from_state(e, state.version)
                                                          for k, e in v.items()})  # fmt: skip
        self._growth = {}
        for key, growth_state in state.get("growth", dict).items():
            growth = self._growth[int(key)] = self._new_growth()
            growth.load_state_dict(growth_state)
        # 0.2's probe after a rollback is gone (trials measure the restored weights): its entries are dropped.
        state.finish(ignored=("probes", "snapshots", "probed", "probe_skips", "data_shifts"))


class DivergenceEvidence:
    """What one loss series says about the training state: its anchor, the streak of steps above reference, the
    recent healthy losses for the trend test, the moving level of the healthy losses and its best. Host floats
    only."""

    def __init__(self) -> None:
        self.first: list[float] = []
        self.anchor = 0.0
        self.streak = 0
        self.streak_low = math.inf  # the lowest loss of the streak under way
        self.window: list[float] = []
        self.best_mean = math.inf
        self.level = 0.0
        self.level_count = 0
        self.best_level = math.inf
        self.level_streak = 0
        self.level_armed = True  # the level has been within its bound since the last restore
        # The last healthy losses since the level started: over a few of its windows for their scatter, and at least
        # as many as confirm the level test.
        self.level_losses: list[float] = []
        self.scatter = 0.0  # their scatter (``loss_scatter``), taken once a window
        self.best_scatter = 0.0  # the scatter when the best level was reached
        self.judged = 0.0  # what the last finding judged divergent: the least loss of its streak, a level or a mean
        self.span = 0  # how many of the last finite losses the last finding rests on
        # Whether the run learns at all, against the anchor of the fit's first losses: both outlive a false alarm,
        # after which the rest re-learns the run's level.
        self.start = 0.0
        self.progress = Progress(NO_PROGRESS_STEPS, NO_PROGRESS_MARGIN, NO_PROGRESS_LEVEL)

    def relearned(self) -> DivergenceEvidence:
        """Fresh evidence for a run accepted as it is (a false alarm), which keeps whether the run has learned."""
        fresh = DivergenceEvidence()
        fresh.start, fresh.progress = self.start, self.progress
        self.progress.restart()
        return fresh

    def runaway(self, loss: float, runaway_factor: float) -> bool:
        """Whether ``loss`` is beyond ``runaway_factor`` times the anchor (never while there is no anchor)."""
        return self.anchor > 0 and loss > runaway_factor * self.anchor

    def observe(
        self,
        loss: float,
        *,
        spike: bool,
        anchor_steps: int,
        runaway_factor: float,
        confirm_steps: int,
        trend_window: int | None,
        trend_probability: float,
        trend_margin: float,
        min_rise: float = 0.0,
        level_window: int | None = None,
        level_factor: float = 2.0,
        level_sigmas: float = 0.0,
        no_progress: bool = False,
    ) -> tuple[str, str] | None:
        """Take one step's loss; return ``(signal kind, reason)`` when it is evidence of divergence, or
        (``no_progress``) of a run that does not learn."""
        if not math.isfinite(loss):
            return None  # the detector's business; neither breaks nor extends the streak
        runaway = self.runaway(loss, runaway_factor)
        if len(self.first) < anchor_steps and not runaway:
            self.first.append(abs(loss))
            # The median, but never above the very first loss: a run whose loss climbs from its first steps on
            # would otherwise anchor itself in the climb.
            self.anchor = min(self.first[0], sorted(self.first)[len(self.first) // 2])
        self.streak = self.streak + 1 if (spike or runaway) else 0
        self.streak_low = min(self.streak_low, loss) if self.streak else math.inf
        if self.streak == confirm_steps:
            # The least of the streak: what the diverged state gave on every one of its batches.
            self.judged, self.span = self.streak_low, confirm_steps
            where = (
                f"is {loss:.4g}, {loss / self.anchor:.3g}x its starting level {self.anchor:.4g}"
                if runaway
                else f"is {loss:.4g}, above its spike threshold"
            )
            return "loss_divergence", f"{where}, for {confirm_steps} consecutive steps"
        if spike or runaway:
            return None  # a spike's losses stay out of the trend window and the level
        level = self._level(loss, level_window, level_factor, confirm_steps, level_sigmas, min_rise, no_progress)
        return level or self._trend(loss, trend_window, trend_probability, trend_margin, min_rise)

    def _level(
        self, loss: float, window: int | None, factor: float, confirm_steps: int, sigmas: float, min_rise: float,
        no_progress: bool = False,
    ) -> tuple[str, str] | None:
        """The level test: the moving level of the healthy losses far above the best level the run reached.

        Averages wander by chance as much as the losses scatter: the best level is the least level plus ``sigmas``
        standard errors of an average of ``window`` losses, the anchor (an average of fewer) is taken plus its own,
        and the level is judged less its own, all measured by the scatter of the losses when the best was reached
        (the null hypothesis: nothing changed since). So a run whose losses scatter widely (a small batch, a
        heavy-tailed loss) but whose mean does not move is never far above its best.
        """
        if window is None:
            return None
        self.level_count += 1
        if self.level_count <= window:  # the mean of the first ``window`` losses: no bias toward the first one
            self.level += (loss - self.level) / self.level_count
        else:
            self.level += 2.0 / (window + 1) * (loss - self.level)
        # The scatter over several windows: losses that scale with their level scatter less in a dip of it, which is
        # where the best level is reached.
        self.level_losses.append(loss)
        if len(self.level_losses) > max(_SCATTER_WINDOWS * window, confirm_steps):
            del self.level_losses[0]
        if self.level_count < window:
            return None
        if self.level_count % window == 0:  # once a window: a median, not a cost of every step
            self.scatter = loss_scatter(self.level_losses)
        error = sigmas * self.scatter / math.sqrt(window)
        if self.level + error < self.best_level:
            self.best_level, self.best_scatter = self.level + error, self.scatter
        best = self.best_level
        allowance = sigmas * self.best_scatter / math.sqrt(window)
        if self.anchor <= 0.0 or best < 0.0:
            return None  # no scale to measure by (a first loss of 0), or a loss that goes negative: ratios mean nothing
        stalled = no_progress and self._stalled()
        # The anchor is a median of fewer losses than the level averages: its allowance grows as the square root.
        anchor = self.anchor + allowance * math.sqrt(window / len(self.first))
        # A run that never went below its anchor is measured against the anchor: settled at twice its first losses.
        # A level below ``min_rise`` times the anchor rose less than that from anything, as a spike must: a loss that
        # sat at 0 and rises a little has not diverged.
        bound = max(factor * min(best, anchor), min_rise * self.anchor)
        level = self.level - allowance
        # A state restored above the bound (the fit's first snapshot, restored before any later one exists) is on
        # its way down from the first losses, not diverged: it is judged against the first loss until it trained
        # back within the bound. One above the first loss (a snapshot taken as the divergence began) is judged.
        self.level_armed = self.level_armed or level <= bound
        if not self.level_armed:
            bound = max(bound, self.first[0])  # an anchor above 0 came from the first losses
        self.level_streak = self.level_streak + 1 if level > bound else 0
        # The losses of the confirming steps as well: one outlier that the spike test let through lifts the mean
        # for many steps; a level that settled is in most of the losses.
        if self.level_streak < confirm_steps or statistics.median(self.level_losses[-confirm_steps:]) <= bound:
            return self._no_progress(window) if stalled else None
        # The level averages about a window of losses before its streak: the states that gave them are implicated.
        self.judged, self.span = self.level, self.level_streak + window
        self._restart_level()
        within = f" ({level:.4g} once their usual scatter is allowed for)" if allowance > 0.0 else ""
        return "loss_divergence", (
            f"rose far above its best level and stayed there: its level over about {window} healthy steps is "
            f"{self.judged:.4g}{within}, above {bound:.4g} ({factor:g} times the lower of its best level {best:.4g} "
            f"and its starting level {anchor:.4g}, and at least {min_rise:g}x its starting level) for {confirm_steps} "
            "consecutive steps"
        )

    def _stalled(self) -> bool:
        """Tick the progress clock with this step's level, against the fit's starting level."""
        self.start = self.start or self.anchor
        return self.progress.observe(self.level, self.start)

    def _no_progress(self, window: int) -> tuple[str, str]:
        """The finding of a run that does not learn: it rests on the states since its last progress (the level
        averages a window of losses before it), which a trial's remedy goes back before."""
        self.judged, self.span = self.level, self.progress.stalled + window
        relapsed = self.progress.relapsed_from
        if relapsed is None:
            what, low = "has stalled short of half its starting level", "the last low"
        else:  # a relapse: progress is a new low below the last one on its way down
            what = f"came back up to its starting level after it had come down to {relapsed:.4g}, and has stalled"
            low = "the last low on its way down"
        mark, margin = self.progress.mark, NO_PROGRESS_MARGIN * self.start
        return "no_progress", (
            f"{what}: its level over about {window} healthy steps is {self.level:.4g}, {self.level / self.start:.3g}x "
            f"its starting level {self.start:.4g}, with no new low {NO_PROGRESS_MARGIN:.0%} of that start "
            f"({margin:.4g}) below {low} ({mark:.4g}, so below {mark - margin:.4g}) in {NO_PROGRESS_STEPS} healthy "
            "steps"
        )

    def _restart_level(self) -> None:
        self.level = 0.0
        self.level_count = 0
        self.level_streak = 0
        self.level_losses = []

    def _trend(
        self, loss: float, window: int | None, probability: float, margin: float, min_rise: float
    ) -> tuple[str, str] | None:
        if window is None:
            return None
        self.window.append(loss)
        if len(self.window) < window:
            return None
        values, self.window = self.window, []
        mean = sum(values) / len(values)
        p = slope_probability(values)
        # Relative to the best window and to the run's scale: a best near 0 yields no threshold of 0.
        rise = max(margin * abs(self.best_mean), min_rise * self.anchor)
        rising = p > probability and mean > self.best_mean + rise
        best = self.best_mean
        self.best_mean = min(self.best_mean, mean)
        if not rising:
            return None
        self.judged, self.span = mean, window
        return "loss_trend", (
            f"trends up: P(slope > 0) = {p:.4f} over the last {window} healthy steps, whose mean {mean:.4g} stands "
            f"above the best window mean {best:.4g} by more than {margin:g}x it and {min_rise:g}x its "
            f"starting level {self.anchor:.4g}"
        )

    def after_restore(self) -> None:
        self.streak = 0
        self.streak_low = math.inf
        self.window = []
        self._restart_level()  # the level of the state just undone; the best level stays
        self.level_armed = False
        self.progress.restart(forget_low=True)  # the restored state's progress counts from where it stands

    def state_dict(self) -> dict[str, Any]:
        return {"first": list(self.first), "anchor": self.anchor, "streak": self.streak, "window": list(self.window),
                "best_mean": self.best_mean, "level": self.level, "level_count": self.level_count,
                "best_level": self.best_level, "level_streak": self.level_streak, "judged": self.judged,
                "streak_low": self.streak_low, "level_armed": self.level_armed,
                "level_losses": list(self.level_losses), "scatter": self.scatter,
                "best_scatter": self.best_scatter, "start": self.start,
                "progress": self.progress.state_dict()}  # fmt: skip

    @classmethod
    def from_state(cls, saved: dict[str, Any], version: int) -> DivergenceEvidence:
        """The evidence :meth:`state_dict` wrote, in a state of ``version``."""
        # The progress clock came within version 2 (counted as 3 here): a version-2 state without it starts it afresh.
        state = StateReader("LossSpikeDetector's evidence", saved, version=version,
                            since={"start": 3, "progress": 3})  # fmt: skip
        evidence = cls()
        evidence.first = state.get("first", _floats)
        evidence.anchor = state.get("anchor", float)
        evidence.streak = state.get("streak", int)
        evidence.window = state.get("window", _floats)
        evidence.best_mean = state.get("best_mean", float)
        evidence.level = state.get("level", float)
        evidence.level_count = state.get("level_count", int)
        evidence.best_level = state.get("best_level", float)
        evidence.level_streak = state.get("level_streak", int)
        evidence.judged = state.get("judged", float)
        evidence.streak_low = state.get("streak_low", float)
        evidence.level_armed = state.get("level_armed", bool)
        evidence.level_losses = state.get("level_losses", _floats)
        evidence.scatter = state.get("scatter", float)
        evidence.best_scatter = state.get("best_scatter", float)
        evidence.start = state.get("start", float, old=0.0)
        progress = state.get("progress", dict, old=None)
        if progress is not None:
            evidence.progress.load_state_dict(progress)
        # 0.2 kept the last losses for its probe; the lowest level and the steps since were the plateau test's
        state.finish(ignored=("recent", "lowest_level", "since_lowest"))
        return evidence


def _floats(values: Any) -> list[float]:
    return [float(v) for v in values]
