"""Argument checks, one message grammar for the whole package; free of Lightning and of torch.

Every message reads ``'<name>' must be <what is allowed> (got <value>)``::

    'factor' must be in (0, 1) (got 1.5)
    'action' must be one of 'skip', 'raise', 'warn' (got 'ignore')
    'burst_window' must be an int (got True)
    'triggers' must be a non-empty collection of signal kinds (got [])

A value of the wrong type raises ``TypeError``; a value of the right type outside what is allowed raises
``ValueError``. Each check returns the value as the caller should keep it (an ``int`` as ``int``, a number as
``float``, an iterable as a ``tuple``), so a constructor checks and stores in one line. The module imports nothing
of the package and nothing of Lightning: the callbacks, the numerics, ``testing`` and ``default_callbacks`` all use
it, and ``import lightning_overflow.numerics`` must stay free of Lightning.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Collection, Iterable
from typing import Any, Literal, overload

__all__ = [
    "check_bool",
    "check_choice",
    "check_choices",
    "check_float",
    "check_int",
    "check_names",
    "check_norm_type",
    "check_type",
    "refuse_removed",
]

# Checked by identity first: the numerics check their arguments on every optimizer step, and an isinstance against
# the numbers ABCs (which admits numpy scalars) costs several times more.
_PLAIN_NUMBERS = (float, int)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a ``bool`` (``1`` and ``"yes"`` are not).

    Raises:
        TypeError: ``value`` is not a ``bool``.

    Example:
        >>> check_bool("diagnose", "yes")
        Traceback (most recent call last):
        ...
        TypeError: 'diagnose' must be a bool (got 'yes')
    """
    if not isinstance(value, bool):
        raise TypeError(f"'{name}' must be a bool (got {value!r})")
    return value


@overload
def check_int(name: str, value: Any, *, minimum: int = ..., optional: Literal[False] = ...) -> int: ...
@overload
def check_int(name: str, value: Any, *, minimum: int = ..., optional: bool) -> int | None: ...
def check_int(name: str, value: Any, *, minimum: int = 0, optional: bool = False) -> int | None:
    """``value`` as an ``int`` of at least ``minimum``.

    Args:
        name: the argument's name, for the message.
        value: the value given; a ``bool`` is not an int here (``True`` steps would be a typo).
        minimum: the smallest value allowed (default 0).
        optional: ``None`` is allowed too (and returned as is).

    Raises:
        TypeError: ``value`` is not an int (or ``None`` where ``optional``).
        ValueError: ``value`` is below ``minimum``.

    Example:
        >>> check_int("window", 0, minimum=1)
        Traceback (most recent call last):
        ...
        ValueError: 'window' must be >= 1 (got 0)
    """
    if value is None and optional:
        return None
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"'{name}' must be {kind} (got {value!r})")
    value = int(value)
    if value < minimum:
        raise ValueError(f"'{name}' must be >= {minimum} (got {value})")
    return value


@overload
def check_float(
    name: str,
    value: Any,
    *,
    low: float = ...,
    high: float = ...,
    low_open: bool | None = ...,
    high_open: bool | None = ...,
    optional: Literal[False] = ...,
) -> float: ...
@overload
def check_float(
    name: str,
    value: Any,
    *,
    low: float = ...,
    high: float = ...,
    low_open: bool | None = ...,
    high_open: bool | None = ...,
    optional: bool,
) -> float | None: ...
def check_float(
    name: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool | None = None,
    high_open: bool | None = None,
    optional: bool = False,
) -> float | None:
    """``value`` as a ``float`` inside an interval; NaN is never inside.

    Args:
        name: the argument's name, for the message.
        value: the value given: an int or a float (numpy scalars too), not a ``bool`` nor a string.
        low, high: the ends of the interval (default: unbounded).
        low_open, high_open: whether an end itself is excluded. The default (``None``) excludes an infinite end and
            includes a finite one: ``inf`` is rarely a usable setting. Pass ``False`` to allow ``inf`` itself, e.g.
            a clipping threshold of ``inf`` that clips nothing.
        optional: ``None`` is allowed too (and returned as is).

    Raises:
        TypeError: ``value`` is not a number (or ``None`` where ``optional``).
        ValueError: ``value`` lies outside the interval, or is NaN.

    Example:
        >>> check_float("factor", 1.5, low=0.0, high=1.0, low_open=True, high_open=True)
        Traceback (most recent call last):
        ...
        ValueError: 'factor' must be in (0, 1) (got 1.5)
        >>> check_float("factor", float("inf"))
        Traceback (most recent call last):
        ...
        ValueError: 'factor' must be a finite number (got inf)
    """
    if value is None and optional:
        return None
    if type(value) not in _PLAIN_NUMBERS and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        kind = "a number or None" if optional else "a number"
        raise TypeError(f"'{name}' must be {kind} (got {value!r})")
    value = float(value)
    low_open = math.isinf(low) if low_open is None else low_open
    high_open = math.isinf(high) if high_open is None else high_open
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if math.isnan(value) or too_low or too_high:
        if low == -math.inf and high == math.inf and low_open and high_open:
            allowed = "a finite number"
        else:
            allowed = f"in {'(' if low_open else '['}{_fmt(low)}, {_fmt(high)}{')' if high_open else ']'}"
        raise ValueError(f"'{name}' must be {allowed} (got {value:g})")
    return value


def check_choice(name: str, value: Any, allowed: Collection[str]) -> str:
    """``value`` if it is one of the strings ``allowed``.

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: ``value`` is a string outside ``allowed``.

    Example:
        >>> check_choice("action", "ignore", ("skip", "raise", "warn"))
        Traceback (most recent call last):
        ...
        ValueError: 'action' must be one of 'skip', 'raise', 'warn' (got 'ignore')
    """
    if not isinstance(value, str) or value not in allowed:
        error = ValueError if isinstance(value, str) else TypeError
        raise error(f"'{name}' must be one of {_listed(allowed)} (got {value!r})")
    return value


def check_choices(
    name: str, values: Any, allowed: Collection[str], *, what: str | None = None, allow_empty: bool = False
) -> tuple[str, ...]:
    """``values``, an iterable of strings each one of ``allowed``, as a tuple without repeats (first order kept).

    Args:
        name: the argument's name, for the message.
        values: the iterable given (a list, tuple, set...). A bare string is refused rather than read letter by
            letter.
        allowed: the vocabulary.
        what: how the message names the items (default: the vocabulary itself, listed).
        allow_empty: an empty iterable is allowed (default: at least one item is needed).

    Raises:
        TypeError: ``values`` is not an iterable (``None``, ``7``), is a string, or holds a non-string.
        ValueError: ``values`` is empty where it may not be, or holds a string outside ``allowed``.

    Example:
        >>> check_choices("triggers", ["loss_spike", "loss_spike", "grad_spike"], ("loss_spike", "grad_spike"))
        ('loss_spike', 'grad_spike')
        >>> check_choices("triggers", [], ("loss_spike", "grad_spike"), what="signal kinds")
        Traceback (most recent call last):
        ...
        ValueError: 'triggers' must be a non-empty collection of signal kinds (got [])
    """
    items = _items(name, values, f"collection of {what or _listed(allowed)}", allow_empty)
    for item in items:
        check_choice(name, item, allowed)
    return tuple(dict.fromkeys(items))


def check_names(name: str, value: Any, *, what: str = "str", allow_empty: bool = True) -> tuple[str, ...]:
    """``value``, an iterable of strings (names of parameters, modules, keys), as a tuple.

    Args:
        name: the argument's name, for the message.
        value: the iterable given. A bare string is refused rather than read letter by letter.
        what: how the message names the items (default ``"str"``; e.g. ``"parameter names"``).
        allow_empty: an empty iterable is allowed (default ``True``).

    Raises:
        TypeError: ``value`` is not an iterable (``None``, ``7``), is a string, or holds a non-string.
        ValueError: ``value`` is empty where it may not be.

    Example:
        >>> check_names("exclude", None, what="parameter names")
        Traceback (most recent call last):
        ...
        TypeError: 'exclude' must be a sequence of parameter names (got None)
    """
    noun = f"sequence of {what}"
    items = _items(name, value, noun, allow_empty)
    if not all(isinstance(item, str) for item in items):
        raise TypeError(f"'{name}' must be a {noun} (got {value!r})")
    return items


def check_norm_type(value: Any, name: str = "norm_type") -> float:
    """2 or inf, as a float; the strings ``"2"`` and ``"inf"`` too, so that YAML configs can say ``norm_type: inf``.

    Raises:
        TypeError: ``value`` is neither a number nor a string.
        ValueError: ``value`` is another number or string.

    Example:
        >>> check_norm_type("inf")
        inf
        >>> check_norm_type(1)
        Traceback (most recent call last):
        ...
        ValueError: 'norm_type' must be 2 or inf (got 1)
    """
    if type(value) in _PLAIN_NUMBERS and (value == 2 or value == math.inf):
        return float(value)  # the common case, on every optimizer step: no message built
    message = f"'{name}' must be 2 or inf (got {value!r})"
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ValueError(message) from None
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(message)
    if number != 2 and number != math.inf:
        raise ValueError(message)
    return float(number)


def check_type(name: str, value: Any, types: type | tuple[type, ...], what: str, *, optional: bool = False) -> Any:
    """``value`` if it is an instance of ``types`` (or ``None`` where ``optional``).

    Args:
        name: the argument's name, for the message.
        value: the value given.
        types: the class, or classes, allowed.
        what: how the message names them (``"a path"``, ``"a torch.optim.Optimizer"``).
        optional: ``None`` is allowed too.

    Raises:
        TypeError: ``value`` is of another type.

    Example:
        >>> import os
        >>> check_type("dirpath", 3, (str, os.PathLike), "a path", optional=True)
        Traceback (most recent call last):
        ...
        TypeError: 'dirpath' must be a path or None (got 3)
    """
    if value is None and optional:
        return None
    if not isinstance(value, types):
        raise TypeError(f"'{name}' must be {what}{' or None' if optional else ''} (got {value!r})")
    return value


def refuse_removed(owner: type, given: dict[str, Any], removed: dict[str, str | None]) -> None:
    """Refuse keyword arguments that are no setting of ``owner``. A setting of an earlier release (``removed``: its
    name -> the constant of :mod:`lightning_overflow.policy` that holds its value now, or ``None`` where the option went
    with its feature) is named with the value the suite now uses, ``owner``'s class attribute of the same name.

    Raises:
        TypeError: ``given`` is not empty.

    Example:
        >>> class Detector:
        ...     level_factor = 2.0
        ...     def __init__(self, window: int = 128, **removed: object) -> None:
        ...         refuse_removed(Detector, removed, {"level_factor": "LEVEL_FACTOR"})
        >>> Detector(level_factor=3.0)
        Traceback (most recent call last):
        ...
        TypeError: Detector(level_factor=3.0): 'level_factor' is no longer a setting: the value is fixed at 2.0 \
(lightning_overflow.policy.LEVEL_FACTOR). The settings are: 'window'
    """
    if not given:
        return
    name, value = next(iter(given.items()))
    if name not in removed:
        why = "not a setting"
    elif removed[name] is None:
        why = "no longer a setting: the option was removed with its feature (see lightning_overflow.policy)"
    else:
        fixed = getattr(owner, name)
        why = f"no longer a setting: the value is fixed at {fixed!r} (lightning_overflow.policy.{removed[name]})"
    settings = [p.name for p in inspect.signature(owner).parameters.values() if p.kind is not p.VAR_KEYWORD]
    raise TypeError(f"{owner.__name__}({name}={value!r}): {name!r} is {why}. The settings are: {_listed(settings)}")


def _items(name: str, value: Any, noun: str, allow_empty: bool) -> tuple[Any, ...]:
    """The items of an iterable argument; a string is one value, never an iterable of letters here."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"'{name}' must be a {noun} (got {value!r})")
    items = tuple(value)
    if not items and not allow_empty:
        raise ValueError(f"'{name}' must be a non-empty {noun} (got {value!r})")
    return items


def _listed(allowed: Collection[str]) -> str:
    return ", ".join(repr(a) for a in allowed)


def _fmt(x: float) -> str:
    return "inf" if x == math.inf else "-inf" if x == -math.inf else f"{x:g}"
