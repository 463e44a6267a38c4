"""Are the weights running away while the loss stands still? The weight-growth test on host floats.

A learning rate far too high for the model does not always overflow or spike: the updates overshoot, the weights
grow step after step (a ReLU network's units die, its output collapses to a constant) and the loss hovers where it
started, or drifts up. The loss alone cannot tell such a run from a healthy one whose loss plateaus, and the norm
alone cannot tell it from a healthy run that grows its weights while it learns (a small initialisation, new data).
Together they can: in a window of steps the weight norm grew by a large factor, the loss did not fall over the
window, **and** it stands above the best it had reached, or ran away within the window (a loss many times the run's
first ones: the overshoot seen directly). A run that learns pays for its weights' growth with a lower loss; a run
that escapes a small initialisation grows its weights fast too, but its loss goes down as they grow and stays at its
best, and never runs away; a healthy run on a plateau barely moves its weights.

Measured on the rescue benchmark (``benchmarks/rescue.py``) and on healthy runs of other kinds (weights drawn 3-350x
smaller than Kaiming's, a GPT-style N(0, 0.02) transformer with and without warm-up, a BatchNorm CNN): at a stable
learning rate the weights grow at most 1.25x over the first 50 steps and less after; runs that learn at a higher
rate (Adam at 4-8x) or out of a small initialisation grow them 2-9x in their first 50 steps, with the loss falling
and at its best; SGD with momentum at 4-16x its stable rate, or a large batch at 8x, grows them 2-400x in the first
50 steps while the loss climbs back above the best it had reached; Adam at 16x grows them 3x in its first 10 steps
while single losses reach 75-135x the first one: such a run is caught at its first samples, before a whole window
has passed. A run that never learned overshoots with its loss median at its best, its first losses, and single losses
far beyond them: Adam at 12x grows its weights 4x in 10 steps with single losses 21-80x the first ones; under
``bf16-mixed``, SGD at 16x grows them 26x in 20 steps with single losses 2000-3400x the first ones.

Pure Python, a few values every ``every_n_steps`` steps: no device, no Lightning.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["GrowthFinding", "WeightGrowth"]


class GrowthFinding(NamedTuple):
    """Weights that ran away: the norm at the window's start (step ``since``) and now, the loss median then and
    now, and the best loss median the run had reached; ``at_best``: the median stood at its best, and the finding
    rests on losses that ran away within the window."""

    since: int
    step: int
    norm_before: float
    norm: float
    loss_before: float
    loss: float
    best_loss: float
    at_best: bool = False


@dataclass
class WeightGrowth:
    """The weight norm sampled every few steps beside the median of the losses just before each sample; a
    finding when, since the oldest sample at most ``window`` steps back, the norm grew ``factor`` times or more while
    the loss median fell by less than ``progress`` of its value and stands ``above_best`` or more above the least
    median of the samples since the test (re)started, or a loss since that sample ran away (see :meth:`add_loss`).
    Only a median of at least half of ``losses_per_sample`` losses can be the least: the first sample of a fit rests
    on one loss, an easy batch's maybe, no level the run reached (in 4 of 48 healthy runs measured whose weights escape
    a small initialisation, all Adam in batches of 16, the first loss stood below the median of the next 10-20 steps,
    and the growth read as overshoot).

    Args:
        window: how many steps back the sample compared with the newest may lie (once the test has run that long,
            the two samples are ``window`` steps apart; before, the first sample is compared).
        factor: the growth of the weight norm over the window that counts as running away (> 1).
        progress: the least fraction by which the loss must have fallen over the window for the growth to be the
            price of learning (in [0, 1)).
        losses_per_sample: finite losses whose median stands beside each sample.
        above_best: how far above its best median the loss median must stand (a fraction, >= 0).

    Example:
        >>> growth = WeightGrowth(window=20, factor=2.0, progress=0.2, losses_per_sample=2)
        >>> for step, norm, losses in ((0, 5.0, (3.0, 3.2)), (10, 7.0, (1.0, 1.2)), (20, 11.25, (3.0, 3.2))):
        ...     for loss in losses:
        ...         growth.add_loss(loss)
        ...     finding = growth.observe(step, norm)
        >>> finding[:7]  # 2.25x in 20 steps, the loss back where it started and far above its best
        (0, 20, 5.0, 11.25, 3.1, 3.1, 1.1)

        A run that never learned: its loss median stays at its best, its first losses, while single losses run away
        (the caller's verdict):

        >>> growth = WeightGrowth(window=20, factor=2.0, progress=0.2, losses_per_sample=2)
        >>> for step, norm, losses in ((0, 5.0, (3.0, 3.2)), (10, 7.0, (3.1, 900.0)), (20, 11.25, (3.0, 3.1))):
        ...     for loss in losses:
        ...         growth.add_loss(loss, runaway=loss > 100 * 3.0)
        ...     finding = growth.observe(step, norm)
        >>> finding.loss, finding.best_loss, finding.at_best
        (3.05, 3.1, True)
    """

    window: int = 50
    factor: float = 2.0
    progress: float = 0.2
    losses_per_sample: int = 20
    above_best: float = 0.1
    best: float = math.inf  # the least loss median of the samples so far
    size: int = 0  # how many values the sampled norms cover
    # (step, weight norm, loss median, whether a loss ran away since the previous sample)
    samples: list[tuple[int, float, float, bool]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # the last finite losses
    ran_away: bool = False  # a loss ran away since the last sample

    def add_loss(self, loss: float, runaway: bool = False) -> None:
        """Take one step's loss (non-finite losses are the non-finite detector's business: left out); ``runaway``:
        the caller's verdict that it is far beyond the run's first losses."""
        if math.isfinite(loss):
            self.losses.append(loss)
            self.ran_away = self.ran_away or runaway
            if len(self.losses) > self.losses_per_sample:
                del self.losses[0]

    def observe(self, step: int, norm: float, size: int = 0) -> GrowthFinding | None:
        """Take the weight norm at ``step`` of ``size`` values; return what was found when the weights ran away over
        the window, else ``None``. After a finding the test starts again (the next one must show a new window of
        growth), and so it does when ``size`` changed (parameters added to the optimizer: no longer the same norm)."""
        if size != self.size:
            self.samples, self.best, self.size = [], math.inf, size
        if not math.isfinite(norm) or not self.losses:
            return None  # a non-finite weight is the non-finite detector's business
        median = statistics.median(self.losses)
        # The least median so far, or this one when none counts yet: a median of fewer than half a sample's losses
        # (the fit's first sample rests on one) is one batch's luck, no level the run reached.
        best = self.best if self.best < math.inf else median
        if 2 * len(self.losses) >= self.losses_per_sample:
            self.best = min(self.best, median)
        # The oldest sample at most a window back: growth over fewer steps is no weaker evidence, and a run that
        # overshoots in its first steps is caught before a whole window passed.
        self.samples = [s for s in self.samples if s[0] >= step - self.window]
        then = self.samples[0] if self.samples else None
        self.samples.append((step, norm, median, self.ran_away))
        self.ran_away = False
        if then is None:
            return None
        then_step, then_norm, then_median, _ = then
        # A loss that is 0 or goes negative (a log-likelihood) has no scale for "fell by a fraction": no test.
        if then_norm <= 0.0 or then_median <= 0.0:
            return None
        if norm < self.factor * then_norm or median < (1.0 - self.progress) * then_median:
            return None
        # The loss at its best: weights that grow out of a small initialisation as it learns. Unless a loss ran away
        # since: the median of a run that never learned stays at its best, its first losses, while it overshoots.
        at_best = median < (1.0 + self.above_best) * best
        if at_best and not any(sample[3] for sample in self.samples[1:]):
            return None
        self.restart()
        return GrowthFinding(then_step, step, then_norm, norm, then_median, median, best, at_best)

    def restart(self) -> None:
        """Forget the samples and losses (after a finding, and after the state was restored from a snapshot)."""
        self.samples = []
        self.losses = []
        self.best = math.inf
        self.ran_away = False

    def state_dict(self) -> dict[str, Any]:
        return {"samples": [list(s) for s in self.samples], "losses": list(self.losses), "best": self.best,
                "size": self.size, "ran_away": self.ran_away}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Samples saved before the runaway flag existed carry three values.
        self.samples = [(int(s[0]), float(s[1]), float(s[2]), bool(s[3]) if len(s) > 3 else False)
                        for s in state.get("samples", [])]  # fmt: skip
        self.losses = [float(v) for v in state.get("losses", [])]
        self.best = float(state.get("best", math.inf))
        self.size = int(state.get("size", 0))
        self.ran_away = bool(state.get("ran_away", False))
