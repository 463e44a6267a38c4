"""Float64 arithmetic on Python floats that rounds, and treats edge cases, exactly as torch's CPU kernels do.

Python floats are IEEE binary64, so ``+ - * /`` round as a float64 tensor op does. Python differs from torch where
an operation has no finite answer (``x / 0`` raises, ``max`` may drop a NaN), in ``torch.lerp``, which torch's
vectorised CPU kernels compute with one fused multiply-add (a single rounding), and in ``torch.sqrt``, whose CPU
kernel (MKL's) is not correctly rounded: about one float64 root in a hundred is one unit in the last place away from
``math.sqrt``'s (on AVX2, where the exact root lies within 0.03 units of the midpoint between two floats; on AVX-512,
3 in 400, one unit low, within 0.23 units below the midpoint). The functions below close those gaps, so that a
statistic computed here on host floats equals, bit for bit, the same statistic computed with float64 tensors on the CPU.
"""

from __future__ import annotations

import functools
import math
import struct
from fractions import Fraction

import torch

_SPLIT = 134217729.0  # 2**27 + 1: Dekker's constant, splits a float64 into two halves of 26 bits
_TINY_PRODUCT = 2.0**-960  # below this, the rounding error of a product may be subnormal, hence inexact
_HUGE_FACTOR = 2.0**995  # above this, the split of a factor overflows
_HUGE = 2.0**1000  # above this, the partial products of the split may overflow


def summed_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss as one value, summed in float32, or in float64 where it came in float64: a float64 loss beyond the
    FP32 range (3.4e38) is finite, and rounding it to float32 would make it inf.

    Example:
        >>> summed_loss(torch.tensor([1e40, 1.0], dtype=torch.float64))
        tensor(1.0000e+40, dtype=torch.float64)
    """
    value = loss.detach()
    value = value if value.dtype == torch.float64 else value.float()
    return value if value.numel() == 1 else value.sum()


def div(a: float, b: float) -> float:
    """``a / b`` with IEEE results for ``b == 0``: ``+-inf``, or NaN for ``0 / 0`` and ``NaN / 0``."""
    if b == 0.0:
        if a == 0.0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


def to_float32(value: float) -> float:
    """The float32 nearest to ``value`` (ties to even; ``+-inf`` beyond the float32 range), as ``Tensor.float()``
    rounds it, as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # the rounded value is infinite
        return math.copysign(math.inf, value)


def sqrt(x: float) -> float:
    """The float64 square root as ``torch.sqrt`` computes it on the CPU (NaN for a negative argument): callers take
    a root once per update, not once per query."""
    return sqrt_each([x])[0]


def sqrt_each(xs: list[float]) -> list[float]:
    """:func:`sqrt` of several floats. Most roots are settled on the host (:func:`_settled_sqrt`); where one is not,
    all of them are taken in one tensor op (the kernel rounds each element as it rounds one alone).

    A tensor op costs microseconds on its own and tens of them between a training step's large kernels, which have
    pushed its code out of the caches: hence the host path."""
    roots = [_settled_sqrt(x) for x in xs]
    if None not in roots:
        return roots  # type: ignore[return-value]
    return torch.tensor(xs, dtype=torch.float64).sqrt_().tolist()


def sqrt_bracket(x: float) -> tuple[float, float] | None:
    """Two floats between which :func:`sqrt` of ``x`` lies, from ``math.sqrt`` alone (no tensor op): the correctly
    rounded root two units in the last place down and up (the CPU kernel is at most one unit from it). ``None``
    outside the normal range, where the kernel may flush (a subnormal ``x``) or the bound may not hold.

    A decision that is the same at both ends (a threshold compared with a value, monotone in the root) needs no exact
    root: statistics take one only when a value falls inside the bracket, or when the root itself is reported.

    Example:
        >>> sqrt_bracket(4.0)[0] < 2.0 < sqrt_bracket(4.0)[1]
        True
    """
    if x == 0.0:
        return 0.0, 0.0
    if not (_SQRT_RANGE[0] <= x <= _SQRT_RANGE[1]):
        return None
    root = math.sqrt(x)
    low = math.nextafter(math.nextafter(root, 0.0), 0.0)
    return low, math.nextafter(math.nextafter(root, math.inf), math.inf)


# Where the exact root lies within this many units in the last place of the correctly rounded one, the kernel returns
# that float too: its result is off only near the midpoint between two floats, beyond 0.47 units (measured on 300,000
# roots across 35 decades). That holds for MKL's vdSqrt on AVX2 and SSE4.2, not on AVX-512, where the root is one unit
# low for exact roots from 0.27 units below the float (3 in 400 roots, 1 in 4,400 within this bound): there
# :func:`_kernel_agrees` finds it false, and every root comes from the kernel.
_SETTLED = 0.4
_SQRT_RANGE = (2.0**-900, 2.0**1000)  # inside it, the residual of a root is exact (no underflow, no overflow)


def _settled_sqrt(x: float) -> float | None:
    """``math.sqrt(x)`` (correctly rounded) where ``torch.sqrt``'s CPU kernel is bound to return the same float,
    ``None`` where it may not (near a midpoint, outside the normal range, or on a torch whose kernel failed the
    check). The residual ``x - r * r`` of a correctly rounded root ``r`` is a float, so :func:`fma` gives it exactly,
    and with it how far the exact root lies from ``r``."""
    if not (_SQRT_RANGE[0] <= x <= _SQRT_RANGE[1]) or not _kernel_agrees():
        return None
    root = math.sqrt(x)
    return root if _near(x, root) else None


def _near(x: float, root: float) -> bool:
    """Whether the exact root of ``x`` lies within ``_SETTLED`` units in the last place of ``root``, its correctly
    rounded root: ``x - root**2`` is about twice ``root`` times that distance."""
    return abs(fma(-root, root, x)) < _SETTLED * 2.0 * root * math.ulp(root)


@functools.cache
def _kernel_agrees() -> bool:
    """Whether this torch's CPU sqrt returns the correctly rounded root wherever the exact root lies within
    ``_SETTLED`` units of it: asked once (a few milliseconds), on 65,536 roots spread over 560 decades. A kernel off
    on one root in 4,400 inside the bound (MKL on AVX-512) shows about 15 of them here; 4,096 roots showed one, or none
    for two seeds in five."""
    gen = torch.Generator().manual_seed(0)
    xs = torch.exp(torch.rand(65536, dtype=torch.float64, generator=gen) * 1290.0 - 600.0)  # inside _SQRT_RANGE
    for x, kernel in zip(xs.tolist(), xs.sqrt().tolist()):
        root = math.sqrt(x)
        if kernel != root and _near(x, root):
            return False
    return True


def maximum(a: float, b: float) -> float:
    """The larger of ``a`` and ``b``, NaN if either is NaN (``torch.maximum``; Python's ``max`` may drop a NaN)."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b)


def fma(a: float, b: float, c: float) -> float:
    """``a * b + c`` rounded once: the product is split exactly into two floats (Dekker) and the three terms are
    summed with one rounding by ``math.fsum``; where a split would underflow or overflow, exact rationals.
    """
    if not (math.isfinite(a) and math.isfinite(b)):
        return a * b + c  # an infinite or NaN product is exact: one rounding or two agree
    if not math.isfinite(c):
        return c  # a finite product plus inf is inf, plus NaN is NaN
    p = a * b
    exact_zero = a == 0.0 or b == 0.0  # a product that rounded to 0 from non-zero factors underflowed: not exact
    if not (exact_zero or _TINY_PRODUCT <= abs(p) <= _HUGE) or abs(a) > _HUGE_FACTOR or abs(b) > _HUGE_FACTOR:
        return _exact(a, b, c)
    t = _SPLIT * a
    a_hi = t - (t - a)
    a_lo = a - a_hi
    t = _SPLIT * b
    b_hi = t - (t - b)
    b_lo = b - b_hi
    error = ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo  # exactly a * b - p
    try:
        return math.fsum((p, error, c))
    except OverflowError:  # the sum lies beyond the float64 range
        return _exact(a, b, c)


def _exact(a: float, b: float, c: float) -> float:
    """``a * b + c`` in exact rationals, rounded to the nearest float (ties to even; ``+-inf`` beyond the range)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    try:
        return float(exact)
    except OverflowError:
        return math.inf if exact > 0 else -math.inf


def lerp(start: float, end: float, weight: float) -> float:
    """``torch.lerp(start, end, weight)`` as torch's float64 CPU kernel rounds it: with one fused multiply-add where
    that kernel fuses (its AVX2 and AVX-512 builds), otherwise as its portable formula."""
    if _lerp_is_fused():
        if abs(weight) < 0.5:
            return fma(weight, end - start, start)
        return fma(weight - 1.0, end - start, end)
    if abs(weight) < 0.5:
        return start + weight * (end - start)
    return end - (end - start) * (1.0 - weight)


@functools.cache
def _lerp_is_fused() -> bool:
    """Whether this torch's CPU lerp rounds once: asked once, on an input where one and two roundings differ."""
    start, end, weight = (torch.tensor(v, dtype=torch.float64) for v in (0.1, 0.7, 0.3))
    return torch.lerp(start, end, weight).item() == fma(0.3, 0.7 - 0.1, 0.1)
