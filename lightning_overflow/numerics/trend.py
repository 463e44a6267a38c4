"""Is a series trending up? The probability that the least-squares slope of recent values is positive. How much does
it scatter about its mean, whatever its trend? And has it come down from where it started at all?

The test dlib's trainer uses to notice a slow divergence without any spike: fit ``y = a + b t`` to the last values
and ask how likely ``b > 0`` is given the residual noise. Pure Python on host floats: each runs on a few hundred
values every so often, never on the device.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["Progress", "loss_scatter", "slope_probability"]

_MEDIAN_DIFFERENCE = 0.6745 * math.sqrt(2.0)  # the median |x - y| of two normal draws, in standard deviations


def slope_probability(values: Sequence[float]) -> float:
    """``P(slope > 0)`` of an ordinary least-squares line through ``values`` (at times 0, 1, ...), under a normal
    approximation of the slope's estimate. ``0.5`` when there are fewer than three values or no variation.

    Example:
        >>> round(slope_probability([1.0, 2.0, 2.5, 4.0, 5.5, 5.0, 7.0]), 4)
        1.0
        >>> slope_probability([3.0, 3.0, 3.0])
        0.5
    """
    n = len(values)
    if n < 3:
        return 0.5
    t_mean = (n - 1) / 2
    y_mean = sum(values) / n
    s_tt = sum((t - t_mean) ** 2 for t in range(n))
    s_ty = sum((t - t_mean) * (y - y_mean) for t, y in enumerate(values))
    slope = s_ty / s_tt
    residual = sum((y - y_mean - slope * (t - t_mean)) ** 2 for t, y in enumerate(values))
    if residual <= 0.0:
        return 0.5 if slope == 0 else (1.0 if slope > 0 else 0.0)
    stderr = math.sqrt(residual / (n - 2) / s_tt)
    return 0.5 * (1.0 + math.erf(slope / stderr / math.sqrt(2.0)))


def loss_scatter(losses: Sequence[float]) -> float:
    """How much consecutive losses scatter about their mean, as a standard deviation: the median of their
    successive differences over 0.954 (what it is for normal noise, ``0.6745 * sqrt(2)``). A slow trend barely moves
    it, and a few outliers do not move it at all.

    Example:
        >>> round(loss_scatter([1.0, 3.0, 1.0, 3.0, 1.0]), 3)
        2.097
    """
    if len(losses) < 2:
        return 0.0
    return statistics.median(abs(b - a) for a, b in zip(losses, losses[1:])) / _MEDIAN_DIFFERENCE


class Progress:
    """Whether a loss level is coming down from its starting level: a clock of the steps since its last new low by
    ``margin`` times the start, which stops once the level has come down to ``learned`` times the start, and runs
    again if the level comes back up to the start (a relapse: what the run had learned is lost).

    A run whose learning rate is too high to learn, but not high enough to overflow or spike, has no best to diverge
    from: its level sits at its start, or stalls far above it. :meth:`observe` answers ``True`` once ``steps``
    observations in a row brought no new low by the margin while the run has not yet learned, and starts the clock
    again. Host floats; a state of plain numbers.

    Args:
        steps: observations without progress that answer ``True``.
        margin: a new low counts as progress when it is this share of the start below the last one.
        learned: the share of the start at which the run has learned (the clock stops until a relapse).

    Example:
        >>> progress = Progress(steps=3, margin=0.05, learned=0.5)
        >>> [progress.observe(level, start=2.0) for level in (2.0, 1.95, 1.92, 2.1, 1.8, 1.79)]
        [False, False, False, True, False, False]
        >>> progress.observe(0.9, start=2.0), progress.learned_at is not None
        (False, True)
        >>> [progress.observe(level, start=2.0) for level in (1.9, 2.2, 2.1, 2.0)]  # back at the start from 2.2
        [False, False, False, True]
    """

    def __init__(self, steps: int, margin: float, learned: float) -> None:
        self.steps, self.margin, self.learned = steps, margin, learned
        self.mark = math.inf  # the level at the last progress
        self.since = 0  # observations since then, or since the last answer
        self.stalled = 0  # observations since then, whatever was answered: the states that made no progress
        self.learned_at: float | None = None  # the level at which the run had learned (no answers until a relapse)
        self.relapsed_from: float | None = None  # that level, once the run came back up to its start since

    def observe(self, level: float, start: float) -> bool:
        """Take the level of one step (``start``: the run's starting level, above 0); ``True`` when the run has made
        no progress for ``steps`` observations."""
        if self.learned_at is not None:
            if level < start:
                return False
            # A relapse: the level is back at its start. The clock runs again from here, and only a new low below the
            # last one is progress (coming down from the relapse is not).
            self.relapsed_from, self.learned_at, self.since, self.stalled = self.learned_at, None, 0, 0
        if level <= self.learned * start:
            self.learned_at = level
            return False
        if level < self.mark - self.margin * start:
            self.mark, self.since, self.stalled = level, 0, 0
            return False
        self.since += 1
        self.stalled += 1
        if self.since < self.steps:
            return False
        self.since = 0
        return True

    def restart(self, forget_low: bool = False) -> None:
        """The clock starts again (a run accepted as it is); ``forget_low``: from the next level, not from the last low
        (a restored state: its progress is measured from where it stands)."""
        self.since = 0
        if forget_low:
            self.mark, self.stalled, self.relapsed_from = math.inf, 0, None

    def state_dict(self) -> dict[str, Any]:
        return {"mark": self.mark, "since": self.since, "stalled": self.stalled, "learned_at": self.learned_at,
                "relapsed_from": self.relapsed_from}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mark, self.since, self.stalled = float(state["mark"]), int(state["since"]), int(state["stalled"])
        learned, relapsed = state["learned_at"], state.get("relapsed_from")  # none in a state of an earlier release
        self.learned_at = None if learned is None else float(learned)
        self.relapsed_from = None if relapsed is None else float(relapsed)
