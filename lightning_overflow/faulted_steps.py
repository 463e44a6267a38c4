"""A ``training_step`` that a bad value broke before it produced a loss to backpropagate, answered as an inf/NaN loss.

Some models check their values and raise before a loss exists: ``torch.distributions`` validates its arguments
("Expected parameter loc ... to satisfy the constraint Real(), but found invalid values": gluonts' DeepAR,
pytorch-forecasting's distribution losses), ``binary_cross_entropy`` checks its input's range on the CPU,
``torch.multinomial`` refuses inf/NaN probabilities. Others return a loss cut from the graph (pytorch-forecasting's
DeepAR on a target of 1e30), on which Lightning's backward raises. Either way there is no step to skip: a data fault
or a bad weight ends the fit.

When the step's batch holds inf/NaN or values beyond ``HUGE_INPUT``, or the model's parameters or buffers hold
inf/NaN, the failure is that fault's consequence: the step returns a NaN loss through every trainable parameter
instead, and the suite answers it as any inf/NaN loss (it skips the step, rolls back where the state is bad). The
backward runs on every rank, as DDP's reducer requires, so every rank sees the same NaN gradients and decides alike.
Under manual optimization, where the optimizers step inside ``training_step``, each optimizer steps on that loss
(in one process only: one rank's own steps could not be sure to meet the other ranks' collectives).
Any other exception, and any failure of a step whose batch and weights are sound, passes unchanged: a bug in the
model is never swallowed. Nor is one on a batch whose bad values the model masks (chemprop's missing targets are
NaN): in one process, a step that raised on such a batch runs once more with them set to 0, and raises on. Nor is
data that is bad in every batch: when skipping does not get past such steps (``NonFiniteDetector(
max_consecutive_skips=...)`` reached, or ``action="raise"``), the fit ends with the module's own error, the one it
would have ended with without the suite, with a note of what was tried.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from lightning_overflow.diagnosis.records import HUGE_INPUT
from lightning_overflow.diagnosis.replay import BatchStats, bad_values_zeroed, batch_stats
from lightning_overflow.distributed import world
from lightning_overflow.numerics._float64 import summed_loss
from lightning_overflow.numerics.norms import any_sharded
from lightning_overflow.numerics.snapshots import nonfinite_paths
from lightning_overflow.preserve import preserved_state, side_run
from lightning_overflow.training_step import silenced_logging

__all__ = ["ANSWERED_ERRORS", "NEVER_ANSWERED", "FaultedStep", "answer_detached", "answer_error", "nonfinite_cause",
           "raises_without_bad_values", "stand_in_loss"]

# What value checks raise: torch's ValueError and RuntimeError, a user's ``assert torch.isfinite(x).all()``,
# ArithmeticError (``math.exp(1e3)``, ``int(inf)``, numpy's FloatingPointError), and a library's own NaN check
# raising a bare Exception (neuralforecast: "Loss is NaN, training stopped."). Another subclass of Exception is control
# flow or a bug of another kind (StopIteration ends a dataloader_iter step); out-of-memory, a missing method and a
# recursion too deep are RuntimeErrors that no value causes.
ANSWERED_ERRORS = (ValueError, RuntimeError, AssertionError, ArithmeticError)
NEVER_ANSWERED = (torch.OutOfMemoryError, NotImplementedError, RecursionError)
MAX_ERROR = 200  # characters of the exception's first line kept in the journal
MAX_NAMES = 3


@dataclass(frozen=True)
class FaultedStep:
    """How a step failed, and the bad value it was verified to come from."""

    failure: str  # 'raised ValueError("Expected parameter loc ...")'
    cause: str  # "its batch holds inf/NaN in row(s) 12"
    brief: str = ""  # the failure without its message, for a count of such steps: "raised ValueError"
    batch: BatchStats | None = None  # what the batch holds, when its bad values are the cause
    # What it raised: when skipping does not get past such steps, the fit ends with it, as it would without the suite.
    error: BaseException | None = field(default=None, compare=False, repr=False)

    def describe(self, code: str) -> str:
        """In words, ``code`` naming what computed the loss (``training_step``, a plain loop's ``loss_fn``)."""
        return f"; {code} {self.failure} while {self.cause}: answered as an inf/NaN loss"


def nonfinite_cause(module: nn.Module, inputs: Any) -> tuple[str, BatchStats | None]:
    """Why a step on ``inputs`` cannot have a sound loss: its batch holds inf/NaN or values beyond ``HUGE_INPUT``
    (with what it holds), or the module's parameters or buffers hold inf/NaN (``""`` when none of these is so)."""
    with torch.no_grad():
        stats = batch_stats(inputs)
        rows = f" in row(s) {', '.join(str(r) for r in stats.rows)}" if stats.rows else ""
        if stats.nan or stats.inf:
            return f"its batch holds inf/NaN{rows}", stats
        if stats.magnitude > HUGE_INPUT:
            return f"its batch holds values up to {stats.magnitude:.3g}{rows}", stats
    bad = nonfinite_paths({**dict(module.named_parameters()), **dict(module.named_buffers())})
    if bad:
        more = f" and {len(bad) - MAX_NAMES} more" if len(bad) > MAX_NAMES else ""
        return f"the model holds inf/NaN in {', '.join(bad[:MAX_NAMES])}{more}", None
    return "", None


def stand_in_loss(module: nn.Module) -> Tensor | None:
    """A NaN loss whose backward reaches every trainable parameter (``None`` when there is none, or the parameters
    are sharded: a DTensor's element is no plain tensor to sum). Its backward reaches the parameters directly, not
    through the layers: right for DDP, whose reducer hooks each parameter, not for FSDP, which reduces each layer's
    gradients from hooks on the layer's outputs (NonFiniteDetector answers no step under a sharded strategy)."""
    params = [p for p in module.parameters() if p.requires_grad and p.numel()]
    if not params or any_sharded(params):
        return None
    parts = [(torch.view_as_real(p) if p.is_complex() else p).reshape(-1)[0].float() for p in params]
    return torch.stack(parts).sum() * float("nan")


def answer_error(error: BaseException, module: nn.Module, inputs: Any) -> tuple[Tensor, FaultedStep] | None:
    """The stand-in loss for a step on ``inputs`` that raised ``error``, and what to tell of it; ``None`` when the
    error is not a bad value's consequence (raise it)."""
    if not (isinstance(error, ANSWERED_ERRORS) or type(error) is Exception) or isinstance(error, NEVER_ANSWERED):
        return None
    line = (str(error).strip().splitlines() or [""])[0].rstrip(": ")  # torch prints the tensor after it
    raised = f"raised {type(error).__name__}"
    answer = _answer(f"{raised}({line[:MAX_ERROR]!r})", raised, module, inputs)
    return (answer[0], replace(answer[1], error=error)) if answer is not None else None


def raises_without_bad_values(call: Callable[[], Any], module: nn.Module, inputs: Any) -> bool:
    """Whether ``call()``, a step that raised on a batch holding inf/NaN or values beyond ``HUGE_INPUT``, raises all
    the same with those values set to 0 (put back afterwards, as is the module's state: random streams, buffers,
    metric states, attributes; its logging silenced): then they are not what broke it (a model that masks missing
    values, as chemprop masks its NaN targets) and its error is one of its own. Not inside a side run (a replay or a
    trial repeats the run's step, answered as it was), and in one process only: a rerun on one rank could not meet
    the other ranks' collectives."""
    if side_run() is not None or world()[1] > 1:
        return False
    with bad_values_zeroed(inputs) as held, preserved_state(module, kind="replay"), silenced_logging(module):
        if not held:
            return False
        try:
            call()
        except Exception:
            return True
    return False


def answer_detached(loss: Tensor, module: nn.Module, inputs: Any) -> tuple[Tensor, FaultedStep] | None:
    """The same for a step whose loss has no graph to backpropagate (``None``: the loss is usable, or the step's
    batch and weights are sound, and Lightning's own error stands)."""
    if loss.requires_grad or not torch.is_grad_enabled():
        return None
    value = float(summed_loss(loss))
    return _answer(f"returned a loss ({value:.4g}) cut from the graph", "returned a loss cut from the graph", module,
                   inputs)


def _answer(failure: str, brief: str, module: nn.Module, inputs: Any) -> tuple[Tensor, FaultedStep] | None:
    # The stand-in first: with sharded parameters there is none, and reading a DTensor's finiteness on the one rank
    # whose step failed would start a collective the others never join.
    loss = stand_in_loss(module)
    cause, batch = nonfinite_cause(module, inputs) if loss is not None else ("", None)
    return (loss, FaultedStep(failure, cause, brief, batch)) if cause and loss is not None else None
