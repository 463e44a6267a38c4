"""Gradient clipping of the total norm that survives overflow and NaN: fixed, percentile (AutoClip), z-score (ZClip).

Pure torch, no Lightning. The tensor functions (:func:`clip_coefficient`, :func:`scale_grads_`,
:func:`clip_grad_norm_`) are sync-free: the coefficient stays on the device, clamped and always multiplied (never
``if coef < 1:``), so nothing is read back to the host. Unit-wise clipping (AGC) lives in
:mod:`~lightning_overflow.numerics.agc` and follows the same rules. The adaptive thresholds, :class:`HostZScore`
and :class:`HostPercentile`, take the total norm as a host float: the suite reads it back once per step anyway, and
plain Python computes a threshold in a few microseconds where tensor ops on 0-d tensors dispatch dozens of kernels
(the one op left is ZClip's square root, taken by torch once per update, since torch's CPU root is not always
correctly rounded). Their arithmetic is the papers' in float64; the tests check it, bit for bit, against the same
algorithms written as tensor ops.

Three rules hold throughout:

- **Non-finite norms never enter the statistics**, and neither do finite norms beyond the FP32 range (3.4e38), an
  overflow that ``NonFiniteDetector`` treats as a fault. A NaN that entered an EMA or a window would stay there for
  good and silence the clipper (ZClip's and AutoClip's reference code both have this flaw).
- **Clipping never turns NaN into finite numbers.** Where the norm is inf/NaN the coefficient is 1: the gradients
  stay as they are, for a detector or the GradScaler to see (``clip_grad_norm_`` multiplies them by ``max/inf = 0``,
  which zeroes the finite ones and turns inf into NaN).
- **Finite gradients whose FP32 norm overflows are scaled down, not zeroed**, given their exact norm (from
  :func:`~lightning_overflow.numerics.grad_norm_report` or the suite's step record). A coefficient below the
  smallest normal FP32 number (a norm above about ``8.5e37 * threshold``) would flush to zero; it is clamped there.

A plain PyTorch loop::

    zclip = HostZScore(alpha=0.97, z_threshold=2.5, warmup_steps=25)  # the paper's values
    for batch in loader:
        model(batch).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        total = grad_norm_report(grads).total  # exact beyond FP32, one read
        scale_grads_(grads, host_clip_coefficient(total, zclip.observe(total)))
        optimizer.step()

Papers:
    - Percentile: P. Seetharaman, G. Wichern, B. Pardo, J. Le Roux, "AutoClip: Adaptive Gradient Clipping for
      Source Separation Networks", IEEE MLSP 2020.
    - Z-score: A. Kumar, L. Owen, N. R. Chowdhury, F. Güra, "ZClip: Adaptive Spike Mitigation for LLM
      Pre-Training", arXiv:2504.02507, 2025.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_overflow._validation import check_float, check_int
from lightning_overflow.numerics import _float64
from lightning_overflow.numerics.norms import FP32_MAX, tensor_norms, total_norm

__all__ = [
    "HostPercentile",
    "HostZScore",
    "clip_coefficient",
    "clip_grad_norm_",
    "host_clip_coefficient",
    "scale_grads_",
]

FP32_TINY = float(torch.finfo(torch.float32).tiny)
"""The smallest normal FP32 number; a smaller coefficient would flush to zero under ``set_flush_denormal``."""


def _as_total(total: Tensor | float, like: Tensor | None = None) -> Tensor:
    device = like.device if like is not None else (total.device if isinstance(total, Tensor) else None)
    return torch.as_tensor(total, dtype=torch.float64, device=device).reshape(())


def clip_coefficient(total: Tensor | float, threshold: Tensor | float) -> Tensor:
    """The factor that brings a gradient norm down to ``threshold``: ``min(1, threshold / total)``, in float64.

    The coefficient is 1 where ``total`` is inf/NaN (nothing to fix here: it is a detector's business, and
    multiplying by ``threshold / inf = 0`` would zero finite gradients and turn inf into NaN), where ``total`` does
    not exceed ``threshold``, and where ``threshold`` is inf/NaN. It is at least :data:`FP32_TINY`.

    Args:
        total: the exact total norm (a 0-d tensor or a float; may exceed the FP32 range).
        threshold: the norm to clip to (``inf`` disables clipping).

    Example:
        >>> clip_coefficient(torch.tensor(25.0), 5.0)
        tensor(0.2000, dtype=torch.float64)
        >>> clip_coefficient(torch.tensor(float("nan")), 5.0)
        tensor(1., dtype=torch.float64)
    """
    total = _as_total(total)
    threshold = _as_total(threshold, like=total)
    clip = torch.isfinite(total) & (total > threshold)
    coef = torch.where(clip, threshold / total, torch.ones_like(total))
    return coef.clamp(min=FP32_TINY, max=1.0)


def host_clip_coefficient(total: float, threshold: float) -> float:
    """:func:`clip_coefficient` of host floats, in plain Python: the same float64 value, no tensor op.

    Args:
        total: the exact total norm (may exceed the FP32 range).
        threshold: the norm to clip to (``inf`` disables clipping).

    Example:
        >>> host_clip_coefficient(25.0, 5.0)
        0.2
        >>> host_clip_coefficient(float("nan"), 5.0)
        1.0
    """
    if not (math.isfinite(total) and total > threshold):
        return 1.0
    return min(max(_float64.div(threshold, total), FP32_TINY), 1.0)


def scale_grads_(grads: Sequence[Tensor], coef: Tensor | float) -> None:
    """Multiply every gradient by ``coef`` in place, always (no host read to decide whether it is needed).

    Args:
        grads: the gradients (any devices and floating dtypes).
        coef: a 0-d tensor on any device, or a float.

    Example:
        >>> grads = [torch.tensor([7.0, 24.0])]
        >>> scale_grads_(grads, clip_coefficient(25.0, 5.0))
        >>> grads[0]
        tensor([1.4000, 4.8000])
    """
    by_group: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        by_group.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), group in by_group.items():
        factor = coef
        if isinstance(coef, Tensor):
            # Into an accelerator the copy is queued before the multiplication that reads it; into host memory an
            # asynchronous copy could still be in flight when the CPU multiplies, so that one blocks.
            factor = coef.to(device=device, dtype=dtype, non_blocking=device.type != "cpu")
        torch._foreach_mul_(group, factor)


def clip_grad_norm_(
    grads: Sequence[Tensor], max_norm: float, total: Tensor | float | None = None
) -> tuple[Tensor, Tensor]:
    """Clip the total L2 norm of ``grads`` to ``max_norm``, in place; overflow-safe given the exact total.

    Unlike ``torch.nn.utils.clip_grad_norm_``, finite gradients whose FP32 norm overflows are scaled down to
    ``max_norm`` (pass their exact ``total``, e.g. ``grad_norm_report(grads).total``), and inf/NaN gradients are
    left as they are rather than multiplied by 0. Without ``total`` the fast FP32 norm is used (sync-free); an FP32
    overflow then reads as a non-finite norm and the gradients are left untouched.

    Args:
        grads: the gradients.
        max_norm: the largest total norm allowed.
        total: the exact total norm of ``grads`` (default: computed here, in FP32 per tensor).

    Returns:
        ``(total, coef)``: the pre-clip total norm and the coefficient applied (float64 tensors).

    Example:
        >>> grads = [torch.tensor([7.0, 24.0])]
        >>> clip_grad_norm_(grads, 5.0)
        (tensor(25., dtype=torch.float64), tensor(0.2000, dtype=torch.float64))
        >>> grads[0]
        tensor([1.4000, 4.8000])
    """
    # inf is allowed: the norm is measured and nothing is clipped.
    check_float("max_norm", max_norm, low=0.0, low_open=True, high_open=False)
    if total is None:
        total = total_norm(tensor_norms(grads)) if grads else torch.zeros((), dtype=torch.float64)
    total = _as_total(total)
    coef = clip_coefficient(total, max_norm)
    scale_grads_(grads, coef)
    return total, coef


# ---- percentile (AutoClip) ----------------------------------------------------------------------------------------
def _accepted_host(total: float) -> bool:
    """Whether a total norm may enter the statistics: finite and within the FP32 range."""
    return math.isfinite(total) and total <= FP32_MAX


class HostPercentile:
    """AutoClip's threshold on host floats: the ``percentile``-th percentile of the norms seen so far, this step's
    included.

    The history is bounded to the last ``window`` accepted norms (the paper keeps every norm). Percentiles
    interpolate linearly, as ``numpy.percentile`` does, and round as ``torch.nanquantile``'s CPU kernel does. A norm
    that is not accepted (inf/NaN, or beyond the FP32 range) is neither added nor counted; the threshold then comes
    from the history alone (``inf`` while it is empty). A ring buffer and a sorted copy kept with :mod:`bisect`: a
    threshold costs two binary searches, an update one removal and one insertion.

    Args:
        window: the number of recent norms kept (AutoClip keeps 1000).
        percentile: the percentile of the norms to clip to, in ``[0, 100]`` (the paper's is 10).

    Attributes:
        count: the number of norms accepted so far.

    Raises:
        TypeError, ValueError: ``window`` is not an int >= 1, or ``percentile`` not a number in ``[0, 100]``.

    Example:
        >>> history = HostPercentile(window=4, percentile=50.0)
        >>> [history.observe(norm) for norm in [1.0, 2.0, 3.0, 4.0, 10.0]]
        [1.0, 1.5, 2.0, 2.5, 3.5]
    """

    def __init__(self, window: int, percentile: float) -> None:
        self.window = check_int("window", window, minimum=1)
        self.percentile = check_float("percentile", percentile, low=0.0, high=100.0)
        self._q = self.percentile / 100.0
        self._ring: list[float] = []  # the accepted norms; the next one goes to slot count % window
        self._sorted: list[float] = []  # the same norms, sorted
        self.count = 0

    @property
    def history(self) -> list[float]:
        """The norms in the window, oldest first."""
        if len(self._ring) < self.window:
            return list(self._ring)
        slot = self.count % self.window
        return self._ring[slot:] + self._ring[:slot]

    def threshold(self, total: float) -> float:
        """The percentile of the window with ``total`` taken in (where accepted), without taking it in."""
        ordered = self._sorted
        if not _accepted_host(total):
            n = len(ordered)
            return self._interpolate(ordered.__getitem__, n) if n else math.inf
        # The window as it would be: the oldest norm out (once the window is full), ``total`` in at ``pos``.
        out = bisect.bisect_left(ordered, self._ring[self.count % self.window]) if self._full else len(ordered)
        pos = bisect.bisect_right(ordered, total)
        if out < pos:
            pos -= 1

        def at(k: int) -> float:
            if k == pos:
                return total
            j = k if k < pos else k - 1
            return ordered[j if j < out else j + 1]

        return self._interpolate(at, len(ordered) + (0 if self._full else 1))

    def update(self, total: float) -> None:
        """Take ``total`` into the window, where accepted (finite and within the FP32 range)."""
        if not _accepted_host(total):
            return
        if self._full:
            slot = self.count % self.window
            del self._sorted[bisect.bisect_left(self._sorted, self._ring[slot])]
            self._ring[slot] = total
        else:
            self._ring.append(total)
        bisect.insort(self._sorted, total)
        self.count += 1

    def observe(self, total: float) -> float:
        """:meth:`threshold`, then :meth:`update`."""
        threshold = self.threshold(total)
        self.update(total)
        return threshold

    def to_dict(self) -> dict[str, Any]:
        """The state as primitives: the accepted norms in the window, oldest first, and the count (loadable with
        ``torch.load(weights_only=True)``, writable as JSON)."""
        return {"window": self.window, "history": self.history, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`to_dict`'s state into this window; with another window size, the most recent norms that fit
        are kept.

        Raises:
            ValueError: the history holds a norm that could never have been accepted, or more norms than counted.
        """
        history = [float(v) for v in state["history"]]
        count = int(state["count"])
        if count < len(history):
            raise ValueError(f"'count' must be >= {len(history)}, the length of 'history' (got {count})")
        bad = [v for v in history if not _accepted_host(v)]
        if bad:
            raise ValueError(f"'history' must hold finite norms within the FP32 range (got {bad[0]})")
        history = history[-self.window :]
        if len(history) < min(count, self.window):  # the window grew: fewer norms are known than would fit
            count = len(history)
        ring = list(history)
        if len(history) == self.window:
            for i, value in enumerate(history):
                ring[(count - self.window + i) % self.window] = value
        self._ring, self._sorted, self.count = ring, sorted(history), count

    @property
    def _full(self) -> bool:
        return len(self._ring) == self.window

    def _interpolate(self, at: Any, n: int) -> float:
        """The ``percentile`` of the ``n`` sorted values ``at(0) ... at(n - 1)``, as ``torch.nanquantile``."""
        rank = self._q * (n - 1)
        below = int(rank)
        above = below + 1 if rank > below else below
        return _float64.lerp(at(below), at(above), rank - below)

    def __repr__(self) -> str:
        return f"HostPercentile(window={self.window}, percentile={self.percentile}, count={self.count})"


# ---- z-score (ZClip) ----------------------------------------------------------------------------------------------
class HostZScore:
    """ZClip's statistics and threshold (reciprocal z-score clipping) on host floats.

    During warm-up the norms only build the mean and (population) variance (threshold ``inf``). After it, with
    ``z = (g - mean) / (std + eps)``: an outlier (``z > z_threshold``) is clipped to
    ``mean + z_threshold**2 * std / z``, so the larger the spike the harder the clip; otherwise the threshold is the
    detection boundary ``mean + z_threshold * (std + eps)``, which ``g`` does not exceed. The EMAs are then updated
    with the clipped norm, as the paper does, so a spike does not inflate the variance that must detect the next one::

        mean <- alpha * mean + (1 - alpha) * g_clipped
        var  <- alpha * var  + (1 - alpha) * (g_clipped - mean) ** 2

    Norms that are not accepted (inf/NaN, or beyond the FP32 range) leave the statistics as they are. One tensor op
    per update: the standard deviation's root, rounded as torch rounds it.

    Args:
        alpha: EMA smoothing factor, in (0, 1) (paper: 0.97).
        z_threshold: z-score above which a norm is an outlier, in (0, inf) (paper: 2.5).
        warmup_steps: norms collected before clipping starts, at least 2: a variance needs two norms, and with a
            variance of 0 every norm above the mean would be clipped to it (paper: 25).
        eps: added to the standard deviation in the z-score, in [0, inf) (paper: 1e-6).

    Attributes:
        mean, var: the mean and variance of the warm-up norms, then their exponential moving averages.
        count: the number of norms accepted so far; the first ``warmup_steps`` of them only build the statistics.

    Raises:
        TypeError, ValueError: an argument is not a number (an int for ``warmup_steps``) in its range.

    Example:
        >>> stats = HostZScore(alpha=0.97, z_threshold=2.5, warmup_steps=3)
        >>> for norm in [1.0, 2.0, 3.0]:
        ...     stats.update(norm)
        >>> stats.mean, round(stats.var, 6)
        (2.0, 0.666667)
        >>> round(stats.threshold(10.0), 4)
        2.5208
    """

    def __init__(self, alpha: float, z_threshold: float, warmup_steps: int, eps: float = 1e-6) -> None:
        self.alpha = check_float("alpha", alpha, low=0.0, high=1.0, low_open=True, high_open=True)
        self.z_threshold = check_float("z_threshold", z_threshold, low=0.0, low_open=True)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=2)
        self.eps = check_float("eps", eps, low=0.0)
        self.mean = 0.0
        self.var = 0.0
        self.count = 0
        self._rooted = (0.0, 0.0)  # (var, sqrt(var)): one root per new variance, not per query
        self._bracketed: tuple[float, tuple[float, float] | None] = (math.nan, None)  # (var, its root's bracket)

    def threshold(self, total: float) -> float:
        """This step's threshold (``inf`` during the warm-up), without taking ``total`` in."""
        return self._step(total)[0]

    def inlier(self, total: float) -> bool:
        """Whether ``total`` is accepted and no outlier after the warm-up, whatever the last bit of the root of the
        variance (see :func:`~lightning_overflow.numerics._float64.sqrt_bracket`), decided without taking that root:
        its threshold is then at least ``total`` itself, and :meth:`update` takes it in unclipped."""
        if self.count < self.warmup_steps or not _accepted_host(total):
            return False
        if self._bracketed[0] != self.var:  # asked twice a step (the threshold, the update) for one variance
            self._bracketed = (self.var, _float64.sqrt_bracket(self.var))
        bracket = self._bracketed[1]
        if bracket is None:
            return False
        # The smallest root gives the largest z-score (the division is monotone in its divisor).
        return not _float64.div(total - self.mean, bracket[0] + self.eps) > self.z_threshold

    def update(self, total: float) -> None:
        """Take ``total`` into the statistics (clipped, as the paper does), where accepted. An inlier needs no root
        (:meth:`inlier`): the same arithmetic as :meth:`observe`, which clips nothing then."""
        if self.inlier(total):
            mean, var = self.mean, self.var
            ema_mean = self.alpha * mean + (1.0 - self.alpha) * total
            deviation = total - ema_mean
            self.mean, self.var = ema_mean, self.alpha * var + (1.0 - self.alpha) * (deviation * deviation)
            self.count += 1
            return
        self.observe(total)

    def observe(self, total: float) -> float:
        """:meth:`threshold`, then :meth:`update`, in one pass."""
        threshold, mean, var, accepted = self._step(total)
        if accepted:
            self.mean, self.var, self.count = mean, var, self.count + 1
        return threshold

    def to_dict(self) -> dict[str, Any]:
        """The statistics as primitives (loadable with ``torch.load(weights_only=True)``, writable as JSON)."""
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`to_dict`'s state."""
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])

    def _step(self, total: float) -> tuple[float, float, float, bool]:
        """``(threshold, new mean, new var, accepted)``: the warm-up's Welford update (the batch mean and population
        variance at its end), or the clip and the EMA update with the clipped norm."""
        mean, var, count = self.mean, self.var, self.count
        accepted = _accepted_host(total)
        g = total if accepted else mean
        if count < self.warmup_steps:
            if not accepted:
                return math.inf, mean, var, False
            n1 = count + 1
            warm_mean = mean + (g - mean) / n1
            return math.inf, warm_mean, (var * count + (g - mean) * (g - warm_mean)) / n1, True
        if self._rooted[0] != var:
            self._rooted = (var, _float64.sqrt(var))
        std = self._rooted[1]
        z = _float64.div(total - mean, std + self.eps)
        if math.isfinite(total) and z > self.z_threshold:  # an outlier: clipped to the reciprocal target
            threshold = clipped = mean + self.z_threshold**2 * std / z
        else:
            threshold = _float64.maximum(mean + self.z_threshold * (std + self.eps), g)
            clipped = g
        if not accepted:
            return threshold, mean, var, False
        ema_mean = self.alpha * mean + (1.0 - self.alpha) * clipped
        deviation = clipped - ema_mean
        return threshold, ema_mean, self.alpha * var + (1.0 - self.alpha) * (deviation * deviation), True

    def __repr__(self) -> str:
        return f"HostZScore(mean={self.mean!r}, var={self.var!r}, count={self.count})"
