"""Running mean and standard deviation that no inf/NaN and no spike can poison, and the spike test built on them.

No Lightning. A value enters the statistics only when it is finite and not itself a spike. The reference
implementations of ZClip and AutoClip, and llm-foundry's ``KillLossSpike``, let one NaN into their moving average or
history, where it stays for ever and disables the detector; and a statistic that takes in the spikes it is meant to
find raises its own threshold while the run diverges.

The statistics are an exponential moving average with the span of a ``window`` (``alpha = 2 / (window + 1)``, the
same centre of mass as a window of that many steps), bias-free from the first value: while the count ``n`` of values
taken in is below ``1 / alpha = (window + 1) / 2``, the statistics are the plain cumulative mean and variance.
Several series (the loss and the gradient norm, say) are tracked side by side, as channels.

A value ``x`` is a spike when the statistics hold at least ``warmup`` values and

.. math::

    x > \\mu + \\max(k\\,\\sigma,\\; (r - 1)\\,|\\mu|)

with ``k`` the ``sigmas`` and ``r`` the ``ratio`` of the test: both the z-score (``k`` standard deviations, as
OLMo-core) and the relative rise (``r`` times the mean, as llm-foundry's ``2x`` and Megatron-LM's ``10x``) must be
exceeded. The z-score adapts to the noise of the series; the ratio keeps a near-constant series, whose standard
deviation is almost zero, from calling every tiny wobble a spike.

:class:`HostRunningStats` computes them on Python floats, for values that are already on the host (the suite reads
its loss and gradient norm back once per step): float64 arithmetic, with one tensor op (a root rounded as torch
rounds it) only where a value lies within a rounding of its threshold. The tests check it, bit for bit, against the
same statistics written as masked tensor ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_overflow._validation import check_int
from lightning_overflow.numerics import _float64

__all__ = ["HostRunningStats", "ema_alpha"]


def ema_alpha(window: int) -> float:
    """The EMA weight with the span of ``window`` steps: ``2 / (window + 1)``.

    Raises:
        TypeError: ``window`` is not an int.
        ValueError: ``window`` is below 1.

    Example:
        >>> ema_alpha(127)
        0.015625
    """
    return 2.0 / (check_int("window", window, minimum=1) + 1)


class HostRunningStats:
    """NaN-safe, spike-proof running mean and standard deviation of one or more series, on host floats.

    A masked update per channel: a value that is not finite, or that ``include`` leaves out (a spike), leaves the
    channel exactly as it was. The weight of a new value is ``max(alpha, 1 / n)`` with ``n`` the updated count: the
    cumulative mean and (population) variance while ``n < 1 / alpha``, an EMA after that (West's weighted
    incremental variance).

    Args:
        channels: how many series are tracked side by side (e.g. 2: the loss and the gradient norm).
        window: the span of the moving average in steps (OLMo-core's is 128).
        warmup: values taken in before a channel tests for spikes.

    Attributes:
        mean, var, count: the statistics (lists of ``channels`` floats; ``count`` holds whole numbers as floats).

    Raises:
        TypeError: ``channels``, ``window`` or ``warmup`` is not an int.
        ValueError: one of them is below 1.

    Example:
        >>> stats = HostRunningStats(channels=1, window=128, warmup=3)
        >>> for loss in (1.0, 1.1, 0.9, float("nan"), 50.0, 1.0):
        ...     spike = stats.spikes([loss], sigmas=6.0, ratio=1.5)
        ...     stats.update([loss], include=[not spike[0]])
        >>> spike, stats.count  # 50.0 was a spike and NaN was ignored: neither entered the statistics
        ([False], [4.0])
    """

    def __init__(self, channels: int, window: int, warmup: int) -> None:
        self.channels = check_int("channels", channels, minimum=1)
        self.alpha = ema_alpha(window)
        self.window = window
        self.warmup = check_int("warmup", warmup, minimum=1)
        self.mean = [0.0] * channels
        self.var = [0.0] * channels
        self.count = [0.0] * channels
        self._rooted: tuple[list[float], list[float]] = (list(self.var), list(self.var))  # (var, std) of the last root

    @property
    def std(self) -> list[float]:
        """``sqrt(max(var, 0))`` per channel, rounded as ``torch.sqrt`` rounds it (taken once per new variance)."""
        if self._rooted[0] != self.var:
            clamped = [v if v > 0.0 or math.isnan(v) else 0.0 for v in self.var]
            self._rooted = (list(self.var), _float64.sqrt_each(clamped))
        return list(self._rooted[1])

    def threshold(self, sigmas: float, ratio: float | Sequence[float]) -> list[float]:
        """The current spike threshold of each channel, ``mean + max(sigmas * std, (ratio - 1) * |mean|)``
        (``ratio`` may be per channel)."""
        ratios = [ratio] * self.channels if isinstance(ratio, (int, float)) else list(ratio)
        return [m + _float64.maximum(sigmas * s, (r - 1.0) * abs(m)) for m, s, r in zip(self.mean, self.std, ratios)]

    def spikes(self, values: Sequence[float], sigmas: float, ratio: float | Sequence[float]) -> list[bool]:
        """Which channels of ``values`` are spikes against the current statistics (no update).

        The threshold grows with the standard deviation: a value above it at the largest root the CPU kernel could
        return, or below it at the smallest (:func:`~lightning_overflow.numerics._float64.sqrt_bracket`), is decided
        without the root rounded as torch rounds it (a tensor op); only a value in between takes it."""
        ratios = [ratio] * self.channels if isinstance(ratio, (int, float)) else list(ratio)
        flags = []
        for value, count, mean, var, r in zip(values, self.count, self.mean, self.var, ratios):
            if not (math.isfinite(value) and count >= self.warmup):
                flags.append(False)
                continue
            bracket = _float64.sqrt_bracket(max(var, 0.0)) if sigmas >= 0.0 and not math.isnan(var) else None
            if bracket is not None:
                floor = (r - 1.0) * abs(mean)
                if value > mean + _float64.maximum(sigmas * bracket[1], floor):
                    flags.append(True)
                    continue
                if value <= mean + _float64.maximum(sigmas * bracket[0], floor):
                    flags.append(False)
                    continue
            flags.append(value > self.threshold(sigmas, ratio)[len(flags)])
        return flags

    def update(self, values: Sequence[float], include: Sequence[bool] | None = None) -> None:
        """Take ``values`` in where they are finite (and ``include`` allows)."""
        for c, value in enumerate(values):
            if not math.isfinite(value) or (include is not None and not include[c]):
                continue  # as the masked update leaves a rejected channel: exactly as it was
            count = self.count[c] + 1.0
            weight = max(1.0 / max(count, 1.0), self.alpha)
            mean = self.mean[c]
            delta = value - mean
            step = weight * delta
            self.mean[c] = mean + step
            self.var[c] = (1.0 - weight) * (self.var[c] + delta * step)
            self.count[c] = count

    def reset(self, channels: Sequence[bool] | None = None) -> None:
        """Forget the statistics (of the channels where ``channels`` is set; all by default): the warm-up starts
        again from the next value."""
        for c in range(self.channels):
            if channels is None or channels[c]:
                self.mean[c] = self.var[c] = self.count[c] = 0.0

    def state_dict(self) -> dict[str, Any]:
        """Plain Python lists (loadable with ``torch.load(weights_only=True)``)."""
        return {"mean": list(self.mean), "var": list(self.var), "count": list(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s statistics.

        Raises:
            ValueError: a list does not have ``channels`` entries.
        """
        loaded = {}
        for name in ("mean", "var", "count"):
            values = [float(v) for v in state[name]]
            if len(values) != self.channels:
                raise ValueError(f"'{name}' must have {self.channels} channels (got {len(values)})")
            loaded[name] = values
        self.mean, self.var, self.count = loaded["mean"], loaded["var"], loaded["count"]
