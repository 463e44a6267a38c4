"""A trial: the remedy against doing nothing, judged on the same unseen batches.

A suspicion (the loss settled far above its best, a trend, runaway weights, a GradScaler that keeps overflowing) does
not decide what the run needs. It opens a trial: the suspect state (the *incumbent*) and the *remedy* (the last
verified snapshot at a lower learning rate) train side by side for ``steps`` optimizer steps on the same batches.
Each batch is scored by both before either trains on it (prequential: every score is a loss on data neither has
seen), and the scores are compared pair by pair, so that how hard a batch is cancels out.

The comparison of one pair is the relative difference of the two losses,

    r = (incumbent - remedy) / (|incumbent| + |remedy|)        (0 when both are 0)

in [-1, 1]: positive where the remedy did better. It is free of the loss's scale (a run diverging geometrically does
not drown the other pairs), bounded, and defined where a loss is inf/NaN: a pair where only the incumbent's loss is
non-finite counts +1, where only the remedy's is, -1 (where both are, the batch itself is bad: no pair). The remedy
wins when the mean of ``r`` stands more than ``sigmas`` standard errors above 0 **and** above ``min_gain``; anything
less is a tie, and a tie goes to the incumbent: the run goes on as if nothing had been suspected.

This module is pure: host floats in, a verdict out. :mod:`lightning_overflow.trials` runs trials in a Lightning fit.

Example:
    >>> trial = Trial(kind="loss_divergence", step=40, config=TrialConfig(steps=4))
    >>> for incumbent, remedy in [(2.0, 1.0), (2.2, 1.1), (1.9, 1.0), (2.4, 1.2)]:
    ...     trial.add(incumbent, remedy)
    >>> verdict = trial.verdict()
    >>> verdict.winner, round(verdict.comparisons[0].mean, 3)
    (0, 0.322)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Literal

from lightning_overflow._validation import check_choice, check_float, check_int
from lightning_overflow.policy import SCHEDULED, SCHEDULED_MIN_GAIN, TRIAL_JUDGED_SHARE, TRIAL_MIN_GAIN, TRIAL_SIGMAS

__all__ = ["DEFAULT_TRIAL", "MODES", "Comparison", "Trial", "TrialConfig", "TrialVerdict", "paired_score"]

MODES = ("ab", "frozen")
"""How the two candidates run: ``"ab"`` trains both on every batch (the loop trains the incumbent, the suite trains
the remedy beside it); ``"frozen"`` trains the remedy and only scores the incumbent, frozen (half the extra compute;
an incumbent that wins has missed the trial's batches)."""


@dataclass(frozen=True, kw_only=True)  # no slots: LightningCLI reads the defaults of a config through vars()
class TrialConfig:
    """How suspicions are tried. Every field is checked when the config is built.

    Attributes:
        steps: optimizer steps a trial runs (default 20): its batches are scored by every candidate.
        remedies: how many remedies run against the incumbent (default 2): the learning rate times ``factor``,
            ``factor**3``, ``factor**5``... (``LRBackoff``'s factor; 0.5 and 0.125 by default), each from the same
            start. One rate may be too little where a run diverges at many times its stable rate; the trial then
            measures a stronger one at once instead of waiting for the next suspicion. ``"frozen"`` mode runs one.
        mode: ``"ab"`` (default) or ``"frozen"`` (see :data:`MODES`).
        max_share: trials opened by suspicions may take at most this share of the fit's optimizer steps so far
            (default 0.25; the first is always allowed, and so is the next rung of a ladder, see
            :mod:`lightning_overflow.trials`).
        every_n_steps: also open a trial every this many optimizer steps without a suspicion, testing whether a
            lower learning rate does better from the current state (default ``None``: off; needs ``LRBackoff``).
            No suspicion chose the moment, so the lower rate is kept only when it does much better
            (``SCHEDULED_MIN_GAIN``, 0.2: a loss about a third lower), and after each such trial that keeps the rate
            the next waits twice as long as the last: a healthy run pays for a few over its fit, not one per interval.

    How a remedy wins is the policy's (no setting): by more than ``sigmas`` (``TRIAL_SIGMAS``, 2) standard errors of
    the paired differences and a mean of ``min_gain`` (``TRIAL_MIN_GAIN``, 0.02: a loss about 4% lower; below it a
    remedy is not worth the batches the incumbent trained on since its snapshot), judged on the last ``judged_share``
    (``TRIAL_JUDGED_SHARE``, half) of the trial's pairs: a remedy restarts from an older state, so its first batches
    measure where it starts from, the last ones where each candidate is going.

    What a trial costs, in ``"ab"`` mode: ``steps`` optimizer steps of compute per remedy (a forward, a backward and
    an optimizer step on the same batches), and one more copy of the weights, buffers and optimizer state per remedy
    in device memory while it runs (and of each weight average a callback keeps: an EMA, SWA); ``"frozen"`` mode:
    ``steps`` forward passes and one copy.
    """

    steps: int = 20
    remedies: int = 2
    mode: Literal["ab", "frozen"] = "ab"
    max_share: float = 0.25
    every_n_steps: int | None = None
    sigmas: ClassVar[float] = TRIAL_SIGMAS
    min_gain: ClassVar[float] = TRIAL_MIN_GAIN
    judged_share: ClassVar[float] = TRIAL_JUDGED_SHARE

    def __post_init__(self) -> None:
        check_int("steps", self.steps, minimum=2)
        check_int("remedies", self.remedies, minimum=1)
        check_choice("mode", self.mode, MODES)
        check_float("max_share", self.max_share, low=0.0, high=1.0, low_open=True)
        check_int("every_n_steps", self.every_n_steps, minimum=1, optional=True)

    @property
    def remedy_count(self) -> int:
        """The remedies a trial runs: ``remedies``, or one in ``"frozen"`` mode."""
        return 1 if self.mode == "frozen" else self.remedies


DEFAULT_TRIAL = TrialConfig()
"""The trial settings of ``LRBackoff``, ``Rollback`` and ``default_callbacks()`` unless given."""


def paired_score(incumbent: float, remedy: float) -> float | None:
    """The relative difference of one pair, positive where the remedy's loss is lower; ``None`` when both losses
    are inf/NaN (the batch itself is bad).

    Example:
        >>> paired_score(3.0, 1.0), paired_score(float("nan"), 1.0), paired_score(0.0, 0.0)
        (0.5, 1.0, 0.0)
    """
    good_incumbent, good_remedy = math.isfinite(incumbent), math.isfinite(remedy)
    if not (good_incumbent or good_remedy):
        return None
    if not good_incumbent:
        return 1.0
    if not good_remedy:
        return -1.0
    scale = abs(incumbent) + abs(remedy)
    return (incumbent - remedy) / scale if scale > 0.0 else 0.0


@dataclass(frozen=True)
class Comparison:
    """One remedy against the incumbent, on the judged batches.

    Attributes:
        mean: the mean relative difference (positive: the remedy did better).
        stderr: its standard error (``inf`` with fewer than two pairs).
        pairs: the pairs compared.
        better: on how many of them the remedy's loss was lower.
        wins: whether the remedy did better beyond ``sigmas`` standard errors and ``min_gain``.
    """

    mean: float
    stderr: float
    pairs: int
    better: int
    wins: bool


@dataclass(frozen=True)
class TrialVerdict:
    """The outcome of a trial.

    Attributes:
        winner: the index of the remedy kept (``None``: the incumbent stays).
        comparisons: each remedy against the incumbent.
        reason: a sentence for messages and the journal.
    """

    winner: int | None
    comparisons: tuple[Comparison, ...]
    reason: str

    @property
    def remedy_wins(self) -> bool:
        return self.winner is not None


@dataclass
class Trial:
    """One trial under way: what opened it, and the scores so far.

    Attributes:
        kind: the signal that opened it (``"scheduled"`` for a trial opened without one).
        step: the optimizer step at which it opened.
        config: how it is judged.
        reason: the signal's sentence.
        source: who raised the signal.
        snapshot_step: the step of the snapshot the remedies start from (``None``: the current state).
        lr_factors: the factor each remedy's learning rate was multiplied by (1.0: unchanged).
        rung: 1 for a trial a signal opened; ``n + 1`` for the one a kept remedy of rung ``n`` opened at once, one
            rate lower.
        incumbent: the incumbent's score on each batch (its loss before the step; ``nan`` when non-finite).
        remedies: each remedy's scores on the same batches.
    """

    kind: str
    step: int
    config: TrialConfig
    reason: str = ""
    source: str = ""
    snapshot_step: int | None = None
    lr_factors: list[float] = field(default_factory=lambda: [1.0])
    rung: int = 1
    incumbent: list[float] = field(default_factory=list)
    remedies: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.remedies:
            self.remedies = [[] for _ in self.lr_factors]

    def add(self, incumbent: float, *remedies: float) -> None:
        """Score one optimizer step's batch: each candidate's loss before it trained on it."""
        self.incumbent.append(float(incumbent))
        for scores, value in zip(self.remedies, remedies):
            scores.append(float(value))

    @property
    def min_gain(self) -> float:
        """The least mean gain that wins: ``SCHEDULED_MIN_GAIN`` for a scheduled trial, else the config's."""
        return SCHEDULED_MIN_GAIN if self.kind == SCHEDULED else self.config.min_gain

    @property
    def done(self) -> bool:
        return len(self.incumbent) >= self.config.steps

    def compare(self, remedy: int) -> Comparison:
        """Remedy ``remedy`` against the incumbent on the judged (last) batches."""
        judged = max(2, math.ceil(self.config.judged_share * len(self.incumbent)))
        pairs = list(zip(self.incumbent, self.remedies[remedy]))[-judged:]
        scores = [s for s in (paired_score(i, r) for i, r in pairs) if s is not None]
        n = len(scores)
        if n < 2:
            return Comparison(0.0, math.inf, n, 0, False)
        mean = sum(scores) / n
        stderr = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1) / n)
        wins = mean > max(self.config.sigmas * stderr, self.min_gain)
        return Comparison(mean, stderr, n, sum(s > 0 for s in scores), wins)

    def rise(self, remedy: int) -> float:
        """How many times its level at the trial's start remedy ``remedy``'s loss level at its end is: the median of
        its finite losses on the last third of the trial's batches over that on the first third (``inf`` where the
        last third has none finite; ``nan`` where the first has none, or with fewer than 3 batches)."""
        scores = self.remedies[remedy]
        third = len(scores) // 3
        if third == 0:
            return math.nan
        first = [s for s in scores[:third] if math.isfinite(s)]
        last = [s for s in scores[-third:] if math.isfinite(s)]
        if not first:
            return math.nan
        if not last:
            return math.inf
        start, end = statistics.median(first), statistics.median(last)
        return end / start if start > 0 else math.nan

    def verdict(self) -> TrialVerdict:
        """The remedy that did best among those that did better beyond the noise of the paired differences and by
        ``min_gain``; none of them: the incumbent stays (ties go to the incumbent)."""
        comparisons = tuple(self.compare(j) for j in range(len(self.remedies)))
        winners = [j for j, c in enumerate(comparisons) if c.wins]
        winner = max(winners, key=lambda j: comparisons[j].mean) if winners else None
        parts = [
            f"the learning rate x{factor:g} did better on {c.better} of the last {c.pairs} batches, by {c.mean:+.3f} "
            f"on average (relative; standard error {c.stderr:.3f})"
            for factor, c in zip(self.lr_factors, comparisons)
        ]
        bound = f"{self.config.sigmas:g} standard errors and {self.min_gain:g}"
        if winner is None:
            reason = f"{'; '.join(parts)}: none beyond {bound}, so the run goes on as it was"
        else:
            reason = f"{'; '.join(parts)}: x{self.lr_factors[winner]:g} beyond {bound}, so it is kept"
        return TrialVerdict(winner, comparisons, reason)

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state["config"] = asdict(self.config)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Trial:
        values = dict(state)
        # A config of an earlier release may hold settings that are the policy's now (``TRIAL_SIGMAS``...).
        names = {f.name for f in fields(TrialConfig)}
        values["config"] = TrialConfig(**{k: v for k, v in values["config"].items() if k in names})
        values["lr_factors"] = [float(v) for v in values["lr_factors"]]
        values["incumbent"] = [float(v) for v in values["incumbent"]]
        values["remedies"] = [[float(v) for v in scores] for scores in values["remedies"]]
        return cls(**values)
