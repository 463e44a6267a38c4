"""Is a series trending up? The probability that the least-squares slope of recent values is positive. And how
much does it scatter about its mean, whatever its trend?

The test dlib's trainer uses to notice a slow divergence without any spike: fit ``y = a + b t`` to the last values
and ask how likely ``b > 0`` is given the residual noise. Pure Python on host floats: each runs on a few hundred
values every so often, never on the device.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["loss_scatter", "slope_probability"]

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
