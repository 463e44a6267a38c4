"""Fault injection at an exact ``(step, rank, kind)``: test recovery paths without provoking NaN by luck."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_overflow._compat import Callback
from lightning_overflow._validation import check_bool, check_choice, check_float, check_int, check_type
from lightning_overflow.distributed import flags_by_rank
from lightning_overflow.numerics.norms import any_sharded, local_shard

__all__ = ["FAULT_KINDS", "Fault", "FaultInjector"]

FAULT_KINDS = ("nan_loss", "inf_loss", "loss_spike", "nan_grad", "inf_grad", "nan_weight", "inf_weight", "scale_weight")

_LOSS_FACTORS = {"nan_loss": float("nan"), "inf_loss": float("inf")}
_VALUES = {"nan_grad": float("nan"), "inf_grad": float("inf"), "nan_weight": float("nan"), "inf_weight": float("inf")}


@dataclass(frozen=True)
class Fault:
    """One fault to inject.

    Args:
        step: the ``trainer.global_step`` at which it fires (the first batch, or backward, of that step).
        kind: ``"nan_loss"`` / ``"inf_loss"`` (the loss is multiplied by NaN/inf, so the gradients follow),
            ``"loss_spike"`` (the loss is multiplied by ``factor``), ``"nan_grad"`` / ``"inf_grad"`` (one element
            of one parameter's gradient, before the DDP all-reduce; refused for a parameter FSDP2 shards, whose
            gradient no tensor hook sees), ``"nan_weight"`` / ``"inf_weight"`` (one element of one parameter, before
            the batch; under FSDP2, of the rank's own shard), ``"scale_weight"`` (one parameter, or the rank's shard
            of it, multiplied by ``factor`` before the batch: finite weights that run away, as a too-high learning
            rate makes them).
        rank: the global rank it fires on (``None``: every rank).
        parameter: the parameter name for gradient and weight faults (``None``: the first parameter).
        factor: the multiplier of ``"loss_spike"`` and ``"scale_weight"`` (default 1e3).
        once: fire on the first execution only; ``False`` fires every time the step is executed (a replay too).

    Raises:
        TypeError: an argument of the wrong type (``step=1.5``, ``rank=True``, ``factor="x"``).
        ValueError: ``step`` or ``rank`` below 0, an unknown ``kind``, a non-finite ``factor``.
    """

    step: int
    kind: str
    rank: int | None = None
    parameter: str | None = None
    factor: float = 1e3
    once: bool = True

    def __post_init__(self) -> None:
        check_int("step", self.step, minimum=0)
        check_choice("kind", self.kind, FAULT_KINDS)
        check_int("rank", self.rank, minimum=0, optional=True)
        check_type("parameter", self.parameter, str, "a parameter name", optional=True)
        check_float("factor", self.factor)
        check_bool("once", self.once)


class FaultInjector(Callback):
    """Inject :class:`Fault` s into a fit. Put it anywhere in ``callbacks``; it wraps the module's
    ``training_step`` (automatic optimization) or ``manual_backward`` (manual) for loss faults and restores them at
    teardown.

    Attributes:
        fired: ``(step, kind, rank)`` of each fault that fired, in order.

    Example:
        >>> injector = FaultInjector(Fault(step=3, kind="nan_loss", rank=1))
    """

    def __init__(self, *faults: Fault) -> None:
        for fault in faults:
            check_type("faults", fault, Fault, "Fault instances")
        self.faults = list(faults)
        self.fired: list[tuple[int, str, int]] = []
        self._done: set[int] = set()
        self._wrapped: list[tuple[Any, str]] = []
        self._handles: list[Any] = []
        self._start = 0  # the fit's first step

    def _due(self, trainer: pl.Trainer, kinds: tuple[str, ...]) -> list[tuple[int, Fault]]:
        due = []
        for i, fault in enumerate(self.faults):
            if fault.kind not in kinds or fault.step != trainer.global_step or i in self._done:
                continue
            if fault.rank is not None and fault.rank != trainer.global_rank:
                continue
            due.append((i, fault))
        return due

    def _fire(self, trainer: pl.Trainer, i: int, fault: Fault) -> None:
        if fault.once:
            self._done.add(i)
        self.fired.append((int(trainer.global_step), fault.kind, int(trainer.global_rank)))

    # ---- loss faults ------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for fault in self.faults:
            if fault.kind.endswith(("_grad", "_weight")):  # scale_weight too
                _parameter(pl_module, fault.parameter)  # a wrong name fails now, not at the fault's step
        name = "training_step" if pl_module.automatic_optimization else "manual_backward"
        setattr(pl_module, name, _WithLossFaults(self, trainer, pl_module, name, getattr(pl_module, name)))
        self._wrapped.append((pl_module, name))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._warn_unfired(trainer)
        for module, name in self._wrapped:
            if name in vars(module):
                delattr(module, name)
        self._wrapped.clear()
        self._remove_hooks()

    def _warn_unfired(self, trainer: pl.Trainer) -> None:
        """A fault the fit went past without firing would leave a test that tests nothing: say so (a resumed fit from
        its own first step)."""
        fired = {(step, kind) for step, kind, _ in self.fired}
        missed = [fault for fault in self.faults
                  if self._start <= fault.step < trainer.global_step and (fault.step, fault.kind) not in fired
                  and fault.rank in (None, trainer.global_rank)]  # fmt: skip
        if missed:
            warnings.warn(
                f"FaultInjector: {', '.join(map(repr, missed))} never fired, though the fit went on to step "
                f"{trainer.global_step}: weight and gradient faults fire at a batch's start, at the batch's first "
                "global_step (under manual optimization global_step moves by each optimizer's step, so a batch "
                "stepping two optimizers starts at every other step); loss faults at the step whose loss it is",
                stacklevel=2,
            )

    def _faulty_output(self, trainer: pl.Trainer, output: Any) -> Any:
        if isinstance(output, Tensor):
            return self._faulty_loss(trainer, output)
        if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
            return {**output, "loss": self._faulty_loss(trainer, output["loss"])}
        return output

    def _faulty_loss(self, trainer: pl.Trainer, loss: Tensor) -> Tensor:
        if not trainer.training:
            return loss
        for i, fault in self._due(trainer, ("nan_loss", "inf_loss", "loss_spike")):
            self._fire(trainer, i, fault)
            loss = loss * _LOSS_FACTORS.get(fault.kind, fault.factor)
        return loss

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = int(trainer.global_step)  # a resumed fit starts past the faults of the steps before it
        sharded = [f for f in self.faults if f.kind.endswith(("_grad", "_weight"))
                   and any_sharded([_parameter(pl_module, f.parameter)])]  # fmt: skip
        for fault in sharded:
            if fault.kind.endswith("_grad"):
                raise ValueError(
                    f"FaultInjector: {fault!r} cannot reach a sharded parameter's gradient (FSDP2 writes it by its "
                    "reduce-scatter, past any tensor hook): inject a loss fault on that rank (nan_loss, inf_loss) or "
                    "a weight fault instead"
                )
        if sharded:  # every rank holds sharded parameters: every rank enters, and every rank refuses alike
            rank = trainer.global_rank
            empty = [torch.tensor(float(f.rank in (None, rank) and local_shard(_parameter(pl_module, f.parameter))
                                        .numel() == 0)) for f in sharded]  # fmt: skip
            for fault, ranks in zip(sharded, flags_by_rank(empty, trainer.strategy.root_device)):
                if ranks:
                    raise ValueError(
                        f"FaultInjector: {fault!r} names a parameter of which rank(s) {', '.join(map(str, ranks))} "
                        "hold no element (their shard is empty): name a larger parameter, or another rank"
                    )

    # ---- gradient and weight faults ---------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        for i, fault in self._due(trainer, ("nan_weight", "inf_weight")):
            self._fire(trainer, i, fault)
            with torch.no_grad():
                _own_part(pl_module, fault).view(-1)[0] = _VALUES[fault.kind]
        for i, fault in self._due(trainer, ("scale_weight",)):
            self._fire(trainer, i, fault)
            with torch.no_grad():
                _own_part(pl_module, fault).mul_(fault.factor)
        for i, fault in self._due(trainer, ("nan_grad", "inf_grad")):
            self._fire(trainer, i, fault)
            # A tensor hook changes the gradient before DDP all-reduces it, as a real fault on one rank would.
            # With ``once`` it poisons the first backward pass only, so a replay of the batch sees a clean gradient.
            poison = _Poison(_VALUES[fault.kind], once=fault.once)
            self._handles.append(_parameter(pl_module, fault.parameter).register_hook(poison))

    @override
    def on_train_batch_end(self, *_: Any) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _Poison:
    """A gradient hook that sets one element to ``value``; with ``once``, only on its first call."""

    def __init__(self, value: float, once: bool) -> None:
        self.value, self.once, self.calls = value, once, 0

    def __call__(self, grad: Tensor) -> Tensor:
        self.calls += 1
        if self.once and self.calls > 1:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = self.value
        return grad


def _own_part(pl_module: pl.LightningModule, fault: Fault) -> Tensor:
    """The part of the fault's parameter this rank holds (its shard under FSDP2, never empty there: refused at the
    fit's start; written there without a collective, as a fault of this rank's own would be; the whole parameter
    otherwise)."""
    return local_shard(_parameter(pl_module, fault.parameter))


def _parameter(pl_module: pl.LightningModule, name: str | None) -> Tensor:
    params = dict(pl_module.named_parameters())
    if name is None:
        return next(iter(params.values()))
    if name not in params:
        raise ValueError(f"'parameter' must name a parameter of the model (got {name!r}; have {', '.join(params)})")
    return params[name]


class _WithLossFaults:
    """The module's ``training_step`` (or ``manual_backward``) with the injector's loss faults. An object rather than a
    closure, so that the module still pickles and deep-copies in the middle of a fit (a checkpoint that pickles it,
    a library that copies it): the copy gets the module's own method back."""

    def __init__(self, injector: FaultInjector, trainer: pl.Trainer, module: Any, name: str, original: Any) -> None:
        self._injector, self._trainer, self._module = injector, trainer, module
        self._name, self._original = name, original
        functools.update_wrapper(self, original)  # its signature is the method's (whether it takes batch_idx)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._name == "manual_backward":
            args = (self._injector._faulty_loss(self._trainer, args[0]), *args[1:])
            return self._original(*args, **kwargs)
        return self._injector._faulty_output(self._trainer, self._original(*args, **kwargs))

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return getattr, (self._module, self._name)
