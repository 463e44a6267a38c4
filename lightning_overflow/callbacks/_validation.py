"""Constructor argument checks, one message grammar: ``'factor' must be in (0, 1) (got 1.5)``."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any


def check_choice(name: str, value: Any, allowed: Collection[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"'{name}' must be one of {choices} (got {value!r})")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"'{name}' must be a bool (got {value!r})")
    return value


def check_int(name: str, value: Any, *, minimum: int = 0, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"'{name}' must be {kind} (got {value!r})")
    if value < minimum:
        raise ValueError(f"'{name}' must be >= {minimum} (got {value})")
    return value


def check_float(
    name: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a number or None" if optional else "a number"
        raise TypeError(f"'{name}' must be {kind} (got {value!r})")
    value = float(value)
    # An infinite end is always open: inf is never a usable setting (thresholds, factors, floors).
    low_open = low_open or math.isinf(low)
    high_open = high_open or math.isinf(high)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if math.isnan(value) or too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        raise ValueError(f"'{name}' must be in {left}{_fmt(low)}, {_fmt(high)}{right} (got {value:g})")
    return value


def check_norm_type(value: Any) -> float:
    """2 or inf; the strings ``"2"`` / ``"inf"`` too, so YAML configs can say ``norm_type: inf``."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (value != 2 and value != math.inf):
        raise ValueError(f"'norm_type' must be 2 or inf (got {value!r})")
    return float(value)


def _fmt(x: float) -> str:
    return "inf" if x == math.inf else "-inf" if x == -math.inf else f"{x:g}"
