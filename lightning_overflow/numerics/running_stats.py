"""Running mean and standard deviation that no inf/NaN and no spike can poison, and the spike test built on them.

Pure torch, no Lightning. The functions below are sync-free: the statistics are tensors on any device, updated with
``torch.where`` rather than branches, so a training loop on a GPU never waits for them. A value enters the statistics
only when it is finite and not itself a spike. The reference implementations of ZClip and AutoClip, and
llm-foundry's ``KillLossSpike``, let one NaN into their moving average or history, where it stays for ever and
disables the detector; and a statistic that takes in the spikes it is meant to find raises its own threshold while
the run diverges.

The statistics are an exponential moving average with the span of a ``window`` (``alpha = 2 / (window + 1)``, the
same centre of mass as a window of that many steps), bias-free from the first value: while the count ``n`` of values
taken in is below ``1 / alpha = (window + 1) / 2``, the statistics are the plain cumulative mean and variance.
Several series (the loss and the gradient norm, say) are tracked side by side as the channels of one 1-D tensor,
with the same few kernels.

A value ``x`` is a spike when the statistics hold at least ``warmup`` values and

.. math::

    x > \\mu + \\max(k\\,\\sigma,\\; (r - 1)\\,|\\mu|)

with ``k`` the ``sigmas`` and ``r`` the ``ratio`` of the test: both the z-score (``k`` standard deviations, as
OLMo-core) and the relative rise (``r`` times the mean, as llm-foundry's ``2x`` and Megatron-LM's ``10x``) must be
exceeded. The z-score adapts to the noise of the series; the ratio keeps a near-constant series, whose standard
deviation is almost zero, from calling every tiny wobble a spike.

Two forms compute the same statistics: the functions below on tensors (:class:`RunningStats` runs them on float64
CPU tensors), and :class:`HostRunningStats` on Python floats, for values that are already on the host (the suite
reads its loss and gradient norm back once per step): the same float64 values, bit for bit, without a tensor op per
arithmetic step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_overflow._validation import check_float, check_int
from lightning_overflow.numerics import _float64

__all__ = ["HostRunningStats", "RunningStats", "ema_alpha", "spike_flags", "spike_threshold", "update_running_stats"]


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


def update_running_stats(
    mean: Tensor, var: Tensor, count: Tensor, value: Tensor, alpha: float, include: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """One masked update of the running ``(mean, var, count)``; channels where ``value`` is not finite, or where
    ``include`` is ``False``, are left exactly as they were.

    The weight of the new value is ``max(alpha, 1 / n)`` with ``n`` the updated count: the cumulative mean and
    (population) variance while ``n < 1 / alpha``, an EMA after that (West's weighted incremental variance).

    Args:
        mean, var, count: the statistics, 1-D tensors of one dtype and device (float64 advised).
        value: the new values, same shape (any float dtype; converted).
        alpha: the EMA weight, in (0, 1] (:func:`ema_alpha`).
        include: optional bool tensor of the same shape: which channels may take the value in.

    Returns:
        The new ``(mean, var, count)``.

    Raises:
        TypeError: ``alpha`` is not a number.
        ValueError: ``alpha`` is not in (0, 1].

    Example:
        >>> m, v, n = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), torch.zeros(1)
        >>> for x in (1.0, 3.0, float("nan")):
        ...     m, v, n = update_running_stats(m, v, n, torch.tensor([x]), alpha=0.1)
        >>> m.item(), v.item(), n.item()
        (2.0, 1.0, 2.0)
    """
    alpha = check_float("alpha", alpha, low=0.0, high=1.0, low_open=True)
    value = value.to(device=mean.device, dtype=mean.dtype)
    accept = torch.isfinite(value)
    if include is not None:
        accept = accept & include.to(device=mean.device, dtype=torch.bool)
    new_count = count + accept.to(count.dtype)
    weight = torch.clamp(new_count.to(mean.dtype), min=1.0).reciprocal().clamp(min=alpha)
    weight = torch.where(accept, weight, torch.zeros_like(weight))
    safe = torch.where(accept, value, mean)  # 0 * NaN is NaN: the rejected value must not reach any product
    delta = safe - mean
    step = weight * delta
    new_mean = mean + step
    new_var = (1.0 - weight) * (var + delta * step)
    return new_mean, new_var, new_count


def spike_threshold(mean: Tensor, var: Tensor, sigmas: Tensor | float, ratio: Tensor | float) -> Tensor:
    """The value above which a new value is a spike: ``mean + max(sigmas * std, (ratio - 1) * |mean|)``.

    Example:
        >>> spike_threshold(torch.tensor([2.0]), torch.tensor([0.25]), sigmas=6.0, ratio=1.5)
        tensor([5.])
    """
    std = torch.sqrt(torch.clamp(var, min=0.0))
    sigmas_t = torch.as_tensor(sigmas, dtype=mean.dtype, device=mean.device)
    ratio_t = torch.as_tensor(ratio, dtype=mean.dtype, device=mean.device)
    margin = torch.maximum(sigmas_t * std, (ratio_t - 1.0) * mean.abs())
    return mean + margin


def spike_flags(
    mean: Tensor,
    var: Tensor,
    count: Tensor,
    value: Tensor,
    sigmas: Tensor | float,
    ratio: Tensor | float,
    warmup: int,
) -> Tensor:
    """Which channels of ``value`` are spikes (bool tensor; never for a non-finite value or during warm-up).

    Example:
        >>> one = torch.ones(1, dtype=torch.float64)
        >>> spike_flags(2 * one, 0.25 * one, 50 * one, torch.tensor([5.0, 5.1]), 6.0, 1.5, warmup=50)
        tensor([False,  True])
    """
    warmup = check_int("warmup", warmup, minimum=0)
    value = value.to(device=mean.device, dtype=mean.dtype)
    warm = count >= warmup
    return torch.isfinite(value) & warm & (value > spike_threshold(mean, var, sigmas, ratio))


class RunningStats:
    """NaN-safe, spike-proof running mean and standard deviation of one or more series, as float64 CPU tensors: the
    functions above, step by step (the reference that :class:`HostRunningStats` is checked against).

    Args:
        channels: how many series are tracked side by side (e.g. 2: the loss and the gradient norm).
        window: the span of the moving average in steps (OLMo-core's is 128).
        warmup: values taken in before a channel tests for spikes.

    Attributes:
        mean, var, count: the statistics (1-D tensors of ``channels`` entries).

    Raises:
        TypeError: ``channels``, ``window`` or ``warmup`` is not an int.
        ValueError: one of them is below 1.

    Example:
        >>> stats = RunningStats(channels=1, window=128, warmup=3)
        >>> for loss in (1.0, 1.1, 0.9, float("nan"), 50.0, 1.0):
        ...     value = torch.tensor([loss])
        ...     spike = stats.spikes(value, sigmas=6.0, ratio=1.5)
        ...     stats.update(value, include=~spike)
        >>> spike, stats.count  # 50.0 was a spike and NaN was ignored: neither entered the statistics
        (tensor([False]), tensor([4.], dtype=torch.float64))
    """

    def __init__(self, channels: int, window: int, warmup: int) -> None:
        channels = check_int("channels", channels, minimum=1)
        self.alpha = ema_alpha(window)
        self.window = window
        self.warmup = check_int("warmup", warmup, minimum=1)
        self.mean = torch.zeros(channels, dtype=torch.float64)
        self.var = torch.zeros_like(self.mean)
        self.count = torch.zeros_like(self.mean)

    def spikes(self, value: Tensor, sigmas: Tensor | float, ratio: Tensor | float) -> Tensor:
        """Which channels of ``value`` are spikes against the current statistics (no update)."""
        return spike_flags(self.mean, self.var, self.count, value, sigmas, ratio, self.warmup)

    def update(self, value: Tensor, include: Tensor | None = None) -> None:
        """Take ``value`` in where it is finite (and ``include`` allows)."""
        self.mean, self.var, self.count = update_running_stats(
            self.mean, self.var, self.count, value, self.alpha, include
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain Python lists (loadable with ``torch.load(weights_only=True)``). Reads the statistics to the host."""
        return {"mean": self.mean.tolist(), "var": self.var.tolist(), "count": self.count.tolist()}


class HostRunningStats:
    """:class:`RunningStats` (float64) on host floats: the same statistics and spike flags, bit for bit, in plain
    Python lists, for values that are already on the host.

    Args:
        channels, window, warmup: as for :class:`RunningStats`.

    Attributes:
        mean, var, count: the statistics (lists of ``channels`` floats; ``count`` holds whole numbers as floats,
            as :class:`RunningStats` does, so that the two :meth:`state_dict` formats are one).

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
        """The current spike threshold of each channel (see :func:`spike_threshold`; ``ratio`` may be per channel)."""
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
        """Take ``values`` in where they are finite (and ``include`` allows); as :func:`update_running_stats`."""
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
        """Plain Python lists (loadable with ``torch.load(weights_only=True)``), in :class:`RunningStats`' format."""
        return {"mean": list(self.mean), "var": list(self.var), "count": list(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s (or :meth:`RunningStats.state_dict`'s) statistics.

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
