"""Errors and warnings raised by ``lightning_overflow``.

The hierarchy::

    ArithmeticError
     └── FloatingPointError
          └── NonFiniteError        inf/NaN that the suite would not (or could no longer) absorb
    RuntimeError
     ├── DivergenceError            the escalation ladder ran out: backoffs or rollbacks exhausted
     └── RollbackError              a rollback was needed but no verified-finite snapshot exists
    UserWarning
     └── OverflowWarning            something worth a look that does not stop training

Every error carries the facts of its message as attributes, so a caller can react without parsing text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["DivergenceError", "NonFiniteError", "OverflowWarning", "RollbackError"]


class NonFiniteError(FloatingPointError):
    """A non-finite value was found where training cannot go on.

    Attributes:
        kind: where it was found: ``"loss"``, ``"grad"``, ``"weight"`` or ``"optimizer_state"``.
        step: the ``global_step`` of the optimizer step concerned.
        ranks: the ranks that observed it (all ranks for gradients, which are all-reduced).
        parameters: the first offending parameter names (empty for the loss).
        overflow: ``True`` when the values were finite but their norm lies beyond the FP32 range,
            ``False`` when they contain inf/NaN.
        hint: what to try.
        diagnosis: the diagnosis record, when one was made (``None`` otherwise).
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        step: int,
        ranks: Sequence[int] = (),
        parameters: Sequence[str] = (),
        overflow: bool = False,
        hint: str = "",
        diagnosis: Any = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.step = step
        self.ranks = list(ranks)
        self.parameters = list(parameters)
        self.overflow = overflow
        self.hint = hint
        self.diagnosis = diagnosis

    def __reduce__(self) -> Any:  # keep attributes across processes (ddp_spawn returns errors by pickle)
        return (_rebuild, (type(self), self.args, self.__dict__))


class DivergenceError(RuntimeError):
    """The run keeps diverging after every remedy the suite may apply.

    Attributes:
        step: the ``global_step`` at which the run was stopped.
        history: one dict per remedy applied (``step``, ``reason`` and what was done), oldest first.
    """

    def __init__(self, message: str, *, step: int, history: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.history = [dict(h) for h in history]

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), self.args, self.__dict__))


class RollbackError(RuntimeError):
    """A rollback was required but could not be carried out (no verified-finite snapshot, unreadable file).

    Attributes:
        step: the ``global_step`` at which the rollback was attempted.
    """

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), self.args, self.__dict__))


class OverflowWarning(UserWarning):
    """A numerical event that training survives but a person should know about."""


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    error = cls.__new__(cls)
    BaseException.__init__(error, *args)
    error.__dict__.update(state)
    return error
