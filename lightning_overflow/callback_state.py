"""The suite's callback state in checkpoints: versioned, and read strictly.

Every suite callback writes its ``state_dict()`` with a ``version`` (:data:`VERSION`) and reads it back with a
:class:`StateReader`: an entry the version must hold and does not, or one that does not convert (a string where a
count belongs), is an error that names the callback and the key; an entry this release does not know is named in a
warning and ignored. Nothing is reset silently. A state without a version was written by the previous release (0.2):
the entries added since start from their documented values (``since``), which is what that release ran with: no
reset, so no warning.

Example:
    >>> reader = StateReader("LRBackoff", {"version": 2, "scales": [0.5]})
    >>> reader.get("scales", lambda v: [float(s) for s in v])
    [0.5]
    >>> reader.get("windows", list)
    Traceback (most recent call last):
    ...
    ValueError: LRBackoff's checkpoint state has no 'windows' entry (version 2 writes it): the checkpoint is damaged or was written by another callback
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_overflow.exceptions import OverflowWarning

__all__ = ["VERSION", "StateReader", "versioned"]

VERSION = 2
"""The version of the callback state this release writes (the previous release, 0.2, wrote none: version 1)."""

T = TypeVar("T")

def versioned(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the version this release writes, first."""
    return {"version": VERSION, **state}


class StateReader:
    """Reads one callback's checkpoint state strictly (see the module docstring).

    Args:
        owner: the callback's name, for messages.
        state: what its ``state_dict()`` wrote.
        since: the entries added after version 1, by the version that added them: a state of an older version has
            none of them, and :meth:`get` gives their ``old`` value instead.
        version: the version of a nested state (one that carries none of its own: its owner's); default: the
            state's own ``version`` entry, 1 without one.
    """

    def __init__(
        self, owner: str, state: Mapping[str, Any], since: Mapping[str, int] | None = None, version: int | None = None
    ) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"{owner}'s checkpoint state must be a mapping (got {type(state).__name__})")
        version = state.get("version", 1) if version is None else version
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= VERSION:
            raise ValueError(
                f"{owner}'s checkpoint state has version {version!r}; this release reads versions 1 to {VERSION}: "
                "it was written by a later release, or is damaged"
            )
        self.owner, self.state, self.version = owner, state, version
        self.since = dict(since or {})
        self._read: set[str] = {"version"}

    def get(self, key: str, convert: Callable[[Any], T], old: T | None = None) -> T:
        """The entry ``key`` converted by ``convert``; for an entry added after the state's version, ``old``.

        Raises:
            ValueError: the entry is missing though the state's version writes it, or does not convert.
        """
        self._read.add(key)
        if key not in self.state:
            if self.since.get(key, 1) > self.version:
                return old  # type: ignore[return-value]
            raise ValueError(
                f"{self.owner}'s checkpoint state has no {key!r} entry (version {self.version} writes it): the "
                "checkpoint is damaged or was written by another callback"
            )
        value = self.state[key]
        try:
            return convert(value)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as error:
            raise ValueError(
                f"{self.owner}'s checkpoint state has a malformed {key!r} entry ({_short(value)}): {error}"
            ) from error

    def finish(self, ignored: Iterable[str] = ()) -> None:
        """Warn once about the entries nobody read (written by another release or callback), naming them."""
        unknown = sorted(set(self.state) - self._read - set(ignored))
        if unknown:  # on rank zero; Python shows one message from one place once
            rank_zero_warn(
                f"{self.owner}: the checkpoint state holds entries this release does not know ({', '.join(unknown)}); "
                "they were ignored.",
                category=OverflowWarning,
                stacklevel=3,
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
