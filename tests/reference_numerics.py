"""The tensor forms of the suite's adaptive statistics, written out op for op: the reference the shipped host forms
are checked against, bit for bit.

The callbacks read each step's loss and gradient norm back to the host once, and compute their statistics from
Python floats (:class:`~lightning_overflow.numerics.clipping.HostZScore`,
:class:`~lightning_overflow.numerics.clipping.HostPercentile`,
:class:`~lightning_overflow.numerics.running_stats.HostRunningStats`). These float64 tensor forms state the same
arithmetic with ``torch.where`` instead of branches, as the papers' algorithms read (ZClip, AutoClip, a masked
EMA); the tests check them against numpy and float64 Python references, then the host forms against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_overflow._validation import check_float, check_int, check_type
from lightning_overflow.numerics.norms import FP32_MAX
from lightning_overflow.numerics.running_stats import ema_alpha


def _as_total(total: Tensor | float, like: Tensor | None = None) -> Tensor:
    device = like.device if like is not None else (total.device if isinstance(total, Tensor) else None)
    return torch.as_tensor(total, dtype=torch.float64, device=device).reshape(())


def _accepted(total: Tensor) -> Tensor:
    """Whether a total norm may enter the statistics: finite and within the FP32 range."""
    return torch.isfinite(total) & (total <= FP32_MAX)


# ---- percentile (AutoClip) ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PercentileState:
    """The bounded history of total norms behind :func:`percentile_threshold`.

    Attributes:
        history: float64 ring buffer of the last ``window`` accepted norms; ``nan`` marks an empty slot.
        count: int64 0-d tensor, the number of norms accepted so far (the next slot is ``count % window``).
    """

    history: Tensor
    count: Tensor

    @classmethod
    def empty(cls, window: int, device: torch.device | str | None = None) -> PercentileState:
        """A state with no history yet, keeping the last ``window`` norms."""
        check_int("window", window, minimum=1)
        history = torch.full((window,), float("nan"), dtype=torch.float64, device=device)
        return cls(history, torch.zeros((), dtype=torch.int64, device=device))

    @property
    def window(self) -> int:
        return self.history.numel()

    def to_dict(self) -> dict[str, Any]:
        """The state as primitives (one host read): the accepted norms oldest first, and the count.

        Loadable with ``torch.load(weights_only=True)``, writable as JSON, comparable with ``==``.
        """
        n = min(int(self.count), self.window)
        slots = [(int(self.count) - n + i) % self.window for i in range(n)]
        values = self.history.tolist()
        return {"window": self.window, "history": [values[i] for i in slots], "count": int(self.count)}

    @classmethod
    def from_dict(
        cls, state: dict[str, Any], window: int | None = None, device: torch.device | str | None = None
    ) -> PercentileState:
        """Rebuild a state from :meth:`to_dict`; with another ``window``, the most recent norms that fit are kept."""
        window = int(state["window"]) if window is None else window
        count = int(state["count"])
        history = [float(v) for v in state["history"]][-window:]
        if len(history) < min(count, window):  # the window grew: fewer norms are known than would fit
            count = len(history)
        rebuilt = cls.empty(window, device)
        n = len(history)
        for i, value in enumerate(history):
            rebuilt.history[(count - n + i) % window] = value
        return cls(rebuilt.history, torch.tensor(count, dtype=torch.int64, device=device))


def percentile_threshold(
    state: PercentileState, total: Tensor | float, percentile: float = 10.0
) -> tuple[Tensor, PercentileState]:
    """AutoClip's threshold: the ``percentile``-th percentile of the norms seen so far, this step's included, as
    :class:`~lightning_overflow.numerics.clipping.HostPercentile` computes it (its docstring states the rules), from a
    float64 window that ``torch.nanquantile`` sorts every step.

    Args:
        state: the current history.
        total: this step's total gradient norm, pre-clip.
        percentile: in ``[0, 100]``; the paper's default 10 clips about nine steps in ten, gently.

    Returns:
        ``(threshold, new_state)``: a float64 0-d tensor and the updated history.

    Example:
        >>> state = PercentileState.empty(window=4)
        >>> for norm in [1.0, 2.0, 3.0, 4.0]:
        ...     threshold, state = percentile_threshold(state, torch.tensor(norm), percentile=50.0)
        >>> threshold
        tensor(2.5000, dtype=torch.float64)
    """
    check_type("state", state, PercentileState, "a PercentileState")
    percentile = check_float("percentile", percentile, low=0.0, high=100.0)
    history = state.history
    total = _as_total(total, like=history)
    ok = _accepted(total)
    slot = torch.arange(history.numel(), device=history.device) == torch.remainder(state.count, history.numel())
    updated = torch.where(slot & ok, total, history)
    threshold = torch.nanquantile(updated, percentile / 100.0)
    threshold = torch.where(torch.isnan(threshold), torch.full_like(threshold, float("inf")), threshold)
    return threshold, PercentileState(updated, state.count + ok.to(torch.int64))


# ---- z-score (ZClip) ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ZScoreState:
    """The running statistics behind :func:`zscore_threshold` (float64 0-d tensors).

    Attributes:
        mean: the mean of the warm-up norms, then their exponential moving average.
        var: the (population) variance of the warm-up norms, then its exponential moving average.
        count: the number of norms accepted so far; the first ``warmup_steps`` of them only build the statistics.
    """

    mean: Tensor
    var: Tensor
    count: Tensor

    @classmethod
    def empty(cls, device: torch.device | str | None = None) -> ZScoreState:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return cls(zero, zero.clone(), zero.clone())

    def to_dict(self) -> dict[str, Any]:
        """The state as primitives (one host read); loadable with ``torch.load(weights_only=True)``, JSON-able."""
        return {"mean": self.mean.item(), "var": self.var.item(), "count": int(self.count)}

    @classmethod
    def from_dict(cls, state: dict[str, Any], device: torch.device | str | None = None) -> ZScoreState:
        """Rebuild a state from :meth:`to_dict`."""
        values = (torch.tensor(float(state[k]), dtype=torch.float64, device=device) for k in ("mean", "var", "count"))
        return cls(*values)


def zscore_threshold(
    state: ZScoreState,
    total: Tensor | float,
    alpha: float = 0.97,
    z_threshold: float = 2.5,
    warmup_steps: int = 25,
    eps: float = 1e-6,
) -> tuple[Tensor, ZScoreState]:
    """ZClip's threshold for this step (reciprocal z-score clipping) and the updated statistics: the arithmetic of
    :class:`~lightning_overflow.numerics.clipping.HostZScore` (its docstring states the algorithm), written as tensor
    ops that compute every branch and select one with ``torch.where``.

    Args:
        state: the current statistics.
        total: this step's total gradient norm, pre-clip.
        alpha, z_threshold, warmup_steps, eps: as for ``HostZScore`` (the defaults are the paper's).

    Returns:
        ``(threshold, new_state)``: a float64 0-d tensor and the updated statistics.

    Raises:
        TypeError, ValueError: an argument is not a number (an int for ``warmup_steps``) in its range.

    Example:
        >>> state = ZScoreState.empty()
        >>> for norm in [1.0, 2.0, 3.0]:
        ...     _, state = zscore_threshold(state, torch.tensor(norm), warmup_steps=3)
        >>> state.mean.item(), round(state.var.item(), 6)
        (2.0, 0.666667)
        >>> threshold, _ = zscore_threshold(state, torch.tensor(10.0), warmup_steps=3)
        >>> round(threshold.item(), 4)
        2.5208
    """
    check_type("state", state, ZScoreState, "a ZScoreState")
    alpha = check_float("alpha", alpha, low=0.0, high=1.0, low_open=True, high_open=True)
    z_threshold = check_float("z_threshold", z_threshold, low=0.0, low_open=True)
    check_int("warmup_steps", warmup_steps, minimum=2)
    eps = check_float("eps", eps, low=0.0)
    mean, var, count = state.mean, state.var, state.count
    total = _as_total(total, like=mean)
    ok = _accepted(total)
    g = torch.where(ok, total, mean)  # keeps inf/NaN out of the arithmetic below

    # Warm-up: Welford's running mean and population variance (equal to the batch values at the end).
    n1 = count + 1
    warm_mean = mean + (g - mean) / n1
    warm_var = (var * count + (g - mean) * (g - warm_mean)) / n1

    # After warm-up: reciprocal z-score clipping, then the EMA update with the clipped norm.
    std = var.sqrt()
    z = (total - mean) / (std + eps)
    outlier = torch.isfinite(total) & (z > z_threshold)
    safe_z = torch.where(outlier, z, torch.ones_like(z))
    target = mean + z_threshold**2 * std / safe_z
    boundary = torch.maximum(mean + z_threshold * (std + eps), g)  # at least g: an inlier is never touched
    adaptive = torch.where(outlier, target, boundary)
    clipped = torch.where(outlier, target, g)
    ema_mean = alpha * mean + (1.0 - alpha) * clipped
    ema_var = alpha * var + (1.0 - alpha) * (clipped - ema_mean) ** 2

    warming = count < warmup_steps
    threshold = torch.where(warming, torch.full_like(adaptive, float("inf")), adaptive)
    new_mean = torch.where(ok, torch.where(warming, warm_mean, ema_mean), mean)
    new_var = torch.where(ok, torch.where(warming, warm_var, ema_var), var)
    return threshold, ZScoreState(new_mean, new_var, count + ok.to(count.dtype))


# ---- running statistics -------------------------------------------------------------------------------------------
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
        channels, window, warmup: as for :class:`~lightning_overflow.numerics.running_stats.HostRunningStats`.

    Attributes:
        mean, var, count: the statistics (1-D tensors of ``channels`` entries).

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
