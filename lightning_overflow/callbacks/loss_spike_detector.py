"""LossSpikeDetector: statistical spikes of the training loss and of the gradient norm, against NaN-safe statistics."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
from typing_extensions import override

from lightning_overflow.callbacks._base import SuiteCallback
from lightning_overflow._validation import check_bool, check_float, check_int
from lightning_overflow.health import StepHealth
from lightning_overflow.numerics.running_stats import RunningStats

__all__ = ["LossSpikeDetector"]

_CHANNELS = ("loss", "grad_norm")
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
    nor spikes, so a diverging run cannot raise its own threshold. After ``rebaseline_after`` consecutive spikes the
    level itself has moved (a new data mixture, a deliberate change of the schedule): the statistics of that series
    start again, with a new warm-up, and the event is journaled.

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
        loss_ratio: the loss must also exceed ``loss_ratio`` times its mean (default 1.2; for a negative loss the
            margin is ``(loss_ratio - 1) * |mean|``).
        grad_ratio: the gradient norm must also exceed ``grad_ratio`` times its mean (default 2).
        check_grad_norm: also test the gradient norm (default ``True``; signal ``grad_spike``).
        rebaseline_after: consecutive spikes of one series after which its statistics restart from the new level
            (default 100; ``None`` never restarts them).

    Signals (read by interventions): ``loss_spike`` and ``grad_spike``, at the first step of a spike and again at
    each step that climbs above the highest value of the same spike (still diverging). The steps of a spike that is
    falling back (recovering) are counted and journaled but signal nothing, so that one long spike does not cost the
    learning rate again and again.

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

    def __init__(
        self,
        window: int = 128,
        warmup: int = 50,
        sigmas: float = 6.0,
        loss_ratio: float = 1.2,
        grad_ratio: float = 2.0,
        check_grad_norm: bool = True,
        rebaseline_after: int | None = 100,
    ) -> None:
        self.window = check_int("window", window, minimum=2)
        self.warmup = check_int("warmup", warmup, minimum=1)
        self.sigmas = check_float("sigmas", sigmas, low=0.0, low_open=True)
        self.loss_ratio = check_float("loss_ratio", loss_ratio, low=1.0)
        self.grad_ratio = check_float("grad_ratio", grad_ratio, low=1.0)
        self.check_grad_norm = check_bool("check_grad_norm", check_grad_norm)
        self.rebaseline_after = check_int("rebaseline_after", rebaseline_after, minimum=1, optional=True)
        self._ratios = torch.tensor([self.loss_ratio, self.grad_ratio], dtype=torch.float64)
        self._stats: dict[int, RunningStats] = {}
        self._streaks: dict[int, list[int]] = {}
        self._peaks: dict[int, list[float]] = {}
        self.loss_spikes = 0
        self.grad_spikes = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(window=self.window, sigmas=self.sigmas)

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
            self.loss_spikes = self.grad_spikes = 0

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        record = self.board(trainer).step_health(trainer, pl_module, optimizer)
        self._observe(trainer, record)

    # ---- the decision -----------------------------------------------------------------------------------------
    def _observe(self, trainer: pl.Trainer, record: StepHealth) -> None:
        """Test this step's loss and gradient norm (host values identical on every rank), then learn from them."""
        grad = record.total_norm if self.check_grad_norm and record.grads_finite else math.nan
        values = torch.tensor([record.loss_mean, grad], dtype=torch.float64)
        stats = self._stats_for(record.optimizer_index)
        flags = stats.spikes(values, self.sigmas, self._ratios)
        found = flags.tolist()
        if any(found):
            self._report(trainer, record, stats, values.tolist(), found)
        # A gradient norm beyond FP32 is an overflow (NonFiniteDetector's fault): tested above, never learned from.
        learnable = torch.tensor([True, not record.grads_beyond_fp32])
        stats.update(values, include=~flags & learnable)
        self._track_streaks(trainer, record, stats, found, values.tolist())

    def _stats_for(self, index: int) -> RunningStats:
        stats = self._stats.get(index)
        if stats is None:
            stats = self._stats[index] = RunningStats(len(_CHANNELS), self.window, self.warmup)
            self._streaks[index] = [0] * len(_CHANNELS)
            self._peaks[index] = [-math.inf] * len(_CHANNELS)
        return stats

    def _report(
        self, trainer: pl.Trainer, record: StepHealth, stats: RunningStats, values: list[float], found: list[bool]
    ) -> None:
        means, stds = stats.mean.tolist(), stats.std.tolist()
        thresholds = stats.threshold(self.sigmas, self._ratios).tolist()
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
        self, trainer: pl.Trainer, record: StepHealth, stats: RunningStats, found: list[bool], values: list[float]
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
            mask = torch.zeros(len(_CHANNELS), dtype=torch.bool)
            mask[channel] = True
            stats.reset(mask)
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
        return {"overflow/spikes": self.spikes}

    @override
    def _after_restore(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        # The statistics describe the healthy run before the divergence and stay; the streaks belong to the
        # state that was just undone.
        for index in self._streaks:
            self._streaks[index] = [0] * len(_CHANNELS)
            self._peaks[index] = [-math.inf] * len(_CHANNELS)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "stats": {str(i): stats.state_dict() for i, stats in self._stats.items()},
            "streaks": {str(i): list(streaks) for i, streaks in self._streaks.items()},
            "peaks": {str(i): list(peaks) for i, peaks in self._peaks.items()},
            "loss_spikes": self.loss_spikes,
            "grad_spikes": self.grad_spikes,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._stats.clear()
        self._streaks.clear()
        self._peaks.clear()
        for key, stats_state in state_dict.get("stats", {}).items():
            self._stats_for(int(key)).load_state_dict(stats_state)
        for key, streaks in state_dict.get("streaks", {}).items():
            self._stats_for(int(key))
            self._streaks[int(key)] = [int(s) for s in streaks]
        for key, peaks in state_dict.get("peaks", {}).items():
            self._stats_for(int(key))
            self._peaks[int(key)] = [float(p) for p in peaks]
        self.loss_spikes = int(state_dict.get("loss_spikes", 0))
        self.grad_spikes = int(state_dict.get("grad_spikes", 0))
